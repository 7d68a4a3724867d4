"""vLLM's post-load processing, run again after a round, on the modules that need it.

Reload-mode parameters (`rl_sync.vllm.modes`) are received into buffers of
the form vLLM's loaders fill (the fused, tensor-parallel parameter as it is
before `process_weights_after_loading`). After a round, every module holding
one of the parameters the round wrote is processed again the way vLLM's own
layerwise reload does it (`vllm/model_executor/model_loader/reload/layerwise.py`):
its parameters are put back in loader form, filled from the buffers,
processed by the module's `quant_method`, and the result is copied into the
live tensors the engine runs on (their storage may be captured by kernels or
CUDA graphs), which are then put back. Attention layers that derive state from
other modules' weights (MLA's `W_UV` / `W_UK_T` from `kv_b_proj`) are processed
after that, as vLLM's reload finalizes them. Tensors that fall back are loaded
through vLLM's layerwise reload (`model.load_weights` between
`initialize_layerwise_reload` and `finalize_layerwise_reload`) for their whole
modules.

Typical use (inside a vLLM worker, after every rank finished the round)::

    processor.after_update(names)          # None: every tensor changed
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from .modes import platform_kind


def _fresh_moe_kernel(layer: torch.nn.Module) -> None:
    """vLLM 0.32 skips the CPU expert prepack when a MoE layer is processed a second time
    (`UnquantizedFusedMoEMethod._setup_kernel` treats it as an in-place update once
    `moe_kernel` is set, and never calls the experts' own `process_weights_after_loading`),
    leaving unpacked weights in packed storage. Processing it as on first load, then copying
    into the live tensors, gives what a fresh load gives. On GPUs the kernel is kept: its
    in-place update copies the processed experts into storage CUDA graphs may have captured,
    and the kernel (with what it references) stays the one those graphs replay."""
    method = getattr(layer, "quant_method", None)
    if platform_kind() != "cpu":
        return
    if method is not None and getattr(method, "moe_kernel", None) is not None:
        method.moe_kernel = None


@torch.no_grad()
def reprocess(layer: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> None:
    """Process `layer` again from loader-form `buffers` (one per parameter it loads) and copy
    the result into its live tensors, which stay registered (see the module docstring)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    live_params, live_buffers = dict(layer._parameters), dict(layer._buffers)
    non_persistent = set(layer._non_persistent_buffers_set)
    info = get_layerwise_info(layer)
    try:
        restore_layer_on_meta(layer, info)
        materialize_layer(layer, info)
        _keep_buffers(layer, live_buffers)
        for name, buffer in buffers.items():
            getattr(layer, name).data.copy_(buffer)
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        _fresh_moe_kernel(layer)
        # vLLM's layer attributes (here and below): torch types nn.Module.__getattr__ as Tensor | Module
        layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr, operator]
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()  # type: ignore[operator]
        for name, tensor in list(live_params.items()) + list(live_buffers.items()):
            processed = getattr(layer, name, None)
            if tensor is None or processed is None or processed is tensor:
                continue
            if _released(tensor, processed):
                (live_params if name in live_params else live_buffers)[name] = processed
            else:
                tensor.data.copy_(processed)
    finally:
        for name in list(layer._parameters) + list(layer._buffers):
            delattr(layer, name)
        for name, param in live_params.items():
            layer.register_parameter(name, param)
        for name, live in live_buffers.items():
            layer.register_buffer(name, live, persistent=name not in non_persistent)


def _keep_buffers(layer: torch.nn.Module, live: Mapping[str, torch.Tensor | None]) -> None:
    """Give the buffers `materialize_layer` left uninitialized the live values: no checkpoint
    tensor feeds them (the embedding scale vLLM's transformers backend keeps for VaultGemma)."""
    for name, tensor in live.items():
        fresh = layer._buffers.get(name)
        if tensor is not None and fresh is not None and fresh is not tensor and fresh.shape == tensor.shape:
            fresh.copy_(tensor)


def _released(live: torch.Tensor, processed: torch.Tensor) -> bool:
    """Whether a live tensor is one a later step released after deriving its own state from it
    (empty where the processed one is not: MLA on a CPU with AMX packs `kv_b_proj`'s weight into
    the attention layer, then frees it). No kernel reads it, so the processed tensor takes its
    place, for the attention layer to derive from again."""
    return live.numel() == 0 and processed.numel() > 0


def _holds_released(module: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> bool:
    """Whether a parameter of `module` that a loader-form buffer feeds is empty (released)."""
    return any((live := module._parameters.get(name)) is not None and _released(live, b) for name, b in buffers.items())


@dataclass
class Processor:
    """Post-round processing of one vLLM rank's model.

    `buffers[module]` maps each parameter a reload-mode module loads to its loader-form
    buffer; `modules_of[name]` lists the reload-mode modules a checkpoint tensor feeds;
    `fallback_modules` are loaded through vLLM's layerwise reload; `attention` are the
    attention layers processed after any round."""

    model: torch.nn.Module
    dtype: torch.dtype
    model_config: object
    buffers: dict[torch.nn.Module, dict[str, torch.Tensor]]
    modules_of: dict[str, list[torch.nn.Module]]
    fallback_modules: list[torch.nn.Module]
    attention: list[torch.nn.Module]

    def after_update(self, names: Collection[str] | None) -> int:
        """Process what the round changed; returns how many modules were processed. A module
        an attention layer derives from, whose weight that layer released (`_released`), is
        processed whatever changed: the attention layers are processed after any round."""
        touched: dict[int, torch.nn.Module] = {}
        for name, modules in self.modules_of.items():
            if names is None or name in names:
                touched.update((id(m), m) for m in modules)
        for layer in self.attention:
            for module in layer.modules():
                if module in self.buffers and _holds_released(module, self.buffers[module]):
                    touched[id(module)] = module
        for module in touched.values():
            reprocess(module, self.buffers[module])
        for layer in self.attention:
            # vLLM's attention method: torch types nn.Module.__getattr__ as Tensor | Module
            layer.process_weights_after_loading(self.dtype)  # type: ignore[operator]
        return len(touched)

    def load_fallbacks(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Whole tensors through vLLM's own loader and layerwise reload, for their modules."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        for module in self.fallback_modules:
            _fresh_moe_kernel(module)
            initialize_layerwise_reload(module)
        try:
            # vLLM's model method: torch types nn.Module.__getattr__ as Tensor | Module
            self.model.load_weights(list(pairs))  # type: ignore[operator]
        finally:
            for module in self.fallback_modules:
                finalize_layerwise_reload(module, self.model_config)
