"""vLLM's post-load processing, run again after a round, on the modules that need it.

Reload-mode parameters (`rl_sync.vllm.modes`) are received into buffers of
the form vLLM's loaders fill (the fused, tensor-parallel parameter as it is
before `process_weights_after_loading`). After a round, every module holding
one of the parameters the round wrote is processed again the way vLLM's own
layerwise reload does it (`vllm/model_executor/model_loader/reload/layerwise.py`):
its parameters are put back in loader form, filled from the buffers,
processed by the module's `quant_method`, and the result is copied into the
live tensors the engine runs on (their storage may be captured by kernels or
CUDA graphs), which are then put back. Attention layers the round wrote into
(their own scales, a module inside them: MLA derives `W_UV` / `W_UK_T` from its
`kv_b_proj`, or a parameter their implementation reads: GPT-OSS's sinks) are
processed after that, as vLLM's reload finalizes them; vLLM's reload processes
every attention layer, since it cannot tell what a load wrote. Tensors that fall back are loaded
through vLLM's layerwise reload (`model.load_weights` between
`initialize_layerwise_reload` and `finalize_layerwise_reload`) for their whole
modules.

A double-buffered round's values wait in shadows until its commit. On CPUs,
where processing a module touches nothing but that module (the packed kernels
are its own attributes), `Processor.prepare` processes a twin of each module
from the shadows before the commit, beside the running engine (a staged
round's thread); the commit then installs each twin's results into its live
module (`install`: the processed tensors copied into the live ones, the
attributes processing set taken over, such as the kernel holding the packed
weights), so the engine waits for no repacking; what the install replaced is
released after the commit returns (`rl_sync.vllm.release`).

Typical use (inside a vLLM worker, after every rank finished the round)::

    processor.after_update(names)          # None: every tensor changed
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..rank.swap import can_swap, swap_memory
from .modes import platform_kind
from .release import Releaser


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


def _process(layer: torch.nn.Module, info, buffers: Mapping[str, torch.Tensor], shared: Mapping) -> None:
    """Run vLLM's post-load processing on `layer` as its layerwise reload does, its tensors first
    put back in loader form and filled from `buffers`; a tensor still one of `shared` (a live
    tensor of another module object: `prepare`'s twin) is replaced by its own copy first."""
    from vllm.model_executor.model_loader.reload.meta import (
        materialize_layer,
        materialize_meta_tensor,
        restore_layer_on_meta,
        to_meta_tensor,
    )

    live_buffers = dict(layer._buffers)
    restore_layer_on_meta(layer, info)
    materialize_layer(layer, info)
    _keep_buffers(layer, live_buffers)
    for name, buffer in buffers.items():
        target = getattr(layer, name)
        if any(target is tensor for tensor in shared.values()):
            target = materialize_meta_tensor(to_meta_tensor(target))
            setattr(layer, name, target)
        target.data.copy_(buffer)
    if hasattr(layer, "_already_called_process_weights_after_loading"):
        delattr(layer, "_already_called_process_weights_after_loading")
    _fresh_moe_kernel(layer)
    # vLLM's layer attributes (here and below): torch types nn.Module.__getattr__ as Tensor | Module
    layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr, operator]
    if hasattr(layer, "update_param_tp_status"):
        layer.update_param_tp_status()  # type: ignore[operator]


def _alone(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is the whole of its storage (a swap of that storage's memory moves it alone)."""
    storage = tensor.untyped_storage()
    return tensor.storage_offset() == 0 and storage.nbytes() == tensor.numel() * tensor.element_size()


_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)
"""PyTorch's count of the references to a storage (some CPU builds of older releases lack it)."""


def _storage_holders(tensor: torch.Tensor) -> int | None:
    """How many references hold `tensor`'s storage (tensors over it, and the one wrapper asked);
    None where this PyTorch cannot tell."""
    return None if _USE_COUNT is None else _USE_COUNT(tensor.untyped_storage()._cdata)


_LONE_HOLDERS = _storage_holders(torch.empty(1))
"""What `_storage_holders` says of a tensor that alone holds its storage."""


def _adopt_references() -> int:
    """What `sys.getrefcount` says, in `_adopt`, of a processed tensor nothing else holds: its
    module's container, `_adopt`'s `result`, and the call's argument."""
    owner = torch.nn.Module()
    owner.register_parameter("w", torch.nn.Parameter(torch.empty(1), requires_grad=False))
    result = getattr(owner, "w", None)
    return sys.getrefcount(result)


_ADOPT_REFERENCES = _adopt_references()


def _sole_storage(tensor: torch.Tensor) -> bool:
    """Whether no other tensor holds `tensor`'s storage: no kernel or closure processing made kept
    a view or alias of it (vLLM's zentorch linear keeps `weight.detach()`). False where this
    PyTorch cannot count a storage's holders (a copy is always right)."""
    return _LONE_HOLDERS is not None and _storage_holders(tensor) == _LONE_HOLDERS


def _swappable(live: torch.Tensor, result: torch.Tensor) -> bool:
    """Whether `result` may swap its memory with `live`: both alike and the whole of their
    storages, and no other tensor over the result's storage."""
    return _alike(live, result) and _alone(live) and _alone(result) and _sole_storage(result) and can_swap()


def _alike(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `a` and `b` have the same shape, strides and dtype."""
    return (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype)


def _adopt(live: MutableMapping[str, Any], processed: torch.nn.Module, swap: Collection[str] = ()) -> None:
    """Copy what processing made of each of a module's `live` tensors (its parameters or its
    buffers, by name) into it, in place; a released live tensor is replaced in `live` instead.
    `swap`: the names (those rl-sync receives in loader form: no binding watches their live
    tensors) whose memory is exchanged with their result's instead of copied, where both are the
    whole of their storages and alike, and nothing but `processed` holds the result or its
    storage (`_swappable`) (`rl_sync.rank.shadow`: for engines whose addresses nothing captured;
    the result is dropped after, freeing the old memory once the work queued on this thread's
    stream so far, which may still read it, has run: `record_stream`)."""
    for name, tensor in live.items():
        result = getattr(processed, name, None)
        if tensor is None or result is None or result is tensor:
            continue
        # Something processing made kept the tensor itself (vLLM's CPU MoE keeps `w13_bias` in its
        # quantization config): a swap would leave it reading the old values.
        held_elsewhere = sys.getrefcount(result) != _ADOPT_REFERENCES
        if _released(tensor, result):
            live[name] = result
        elif name in swap and not held_elsewhere and _swappable(tensor, result):
            swap_memory(tensor.untyped_storage(), result.untyped_storage())
            if result.is_cuda:
                result.record_stream(torch.cuda.current_stream(result.device))
        else:
            tensor.data.copy_(result)


@torch.no_grad()
def reprocess(layer: torch.nn.Module, buffers: Mapping[str, torch.Tensor], swap: Collection[str] = ()) -> None:
    """Process `layer` again from loader-form `buffers` (one per parameter it loads) and copy
    the result into its live tensors, which stay registered (see the module docstring); the
    parameter names in `swap` are swapped in instead where `_adopt` may."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    live_params, live_buffers = dict(layer._parameters), dict(layer._buffers)
    non_persistent = set(layer._non_persistent_buffers_set)
    try:
        _process(layer, get_layerwise_info(layer), buffers, {})
        _adopt(live_params, layer, swap)
        _adopt(live_buffers, layer)
    finally:
        for name in list(layer._parameters) + list(layer._buffers):
            delattr(layer, name)
        for name, param in live_params.items():
            layer.register_parameter(name, param)
        for name, live in live_buffers.items():
            layer.register_buffer(name, live, persistent=name not in non_persistent)


_MODULE_STATE = frozenset({"_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"})
"""A module's own containers, which `install` never takes from a twin wholesale."""


def _own(obj):
    """A shallow copy of `obj`, with containers of its own when it is a module."""
    twin = copy.copy(obj)
    if isinstance(obj, torch.nn.Module):
        containers = (obj._parameters, obj._buffers, obj._modules)
        twin.__dict__.update(zip(("_parameters", "_buffers", "_modules"), map(dict, containers)))
    return twin


@torch.no_grad()
def prepare(layer: torch.nn.Module, buffers: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A twin of `layer` processed from loader-form `buffers`, the live layer untouched (it may
    run meanwhile): the twin has its own tensor containers, attributes and `quant_method` (a
    shallow copy, so state processing keeps there, such as a MoE kernel, stays the twin's)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs

    twin = _own(layer)
    twin.__dict__["_non_persistent_buffers_set"] = set(layer._non_persistent_buffers_set)
    method = _own(layer.quant_method)  # (modules vLLM processes have one; a MoE's is a module)
    (twin._modules if "quant_method" in layer._modules else twin.__dict__)["quant_method"] = method
    info = get_layerwise_info(layer)
    _process(twin, info, buffers, {**layer._parameters, **layer._buffers})
    params, metadata_buffers = info.restore_metadata
    for tensor in [*params.values(), *metadata_buffers.values()]:
        sanitize_layer_refs(tensor, twin)  # (vLLM's reload bound its kept metadata to the twin)
    return twin


def _take_over(live: dict, twin: Mapping, skip: frozenset[str], replaced: list) -> None:
    """Every entry of `twin` that processing set, changed or dropped, the same in `live`; what
    `live` held there is appended to `replaced`."""
    for key in [k for k in live if k not in twin and k not in skip]:
        replaced.append(live.pop(key))
    for key, value in twin.items():
        if key not in skip and live.get(key, _ABSENT) is not value:
            replaced.append(live.get(key))
            live[key] = value


@torch.no_grad()
def install(layer: torch.nn.Module, twin: torch.nn.Module, swap: Collection[str], replaced: list) -> None:
    """Make `prepare`'s results live in `layer`: each processed tensor copied (or, for the
    parameter names in `swap`, swapped: `_adopt`) into its live one (a released one replaced),
    then what processing set on the twin and its `quant_method` taken over by the live ones (the
    kernel holding packed weights), whose objects stay. What they held before is appended to
    `replaced`, for the caller to release (`rl_sync.vllm.release`). vLLM's weight loaders the twin's tensors carry are
    bound to the live layer where its tensors took them, and to vLLM's sentinel on the twin, so
    nothing keeps the twin, and the previous round's memory it holds after a swap, alive."""
    from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs, sanitize_layer_refs

    live_params, live_buffers = dict(layer._parameters), dict(layer._buffers)
    _adopt(live_params, twin, swap)
    _adopt(live_buffers, twin)
    layer._parameters.update(live_params)
    layer._buffers.update(live_buffers)
    method = frozenset({"quant_method"})
    _take_over(layer.__dict__, twin.__dict__, _MODULE_STATE | method, replaced)
    _take_over(layer._modules, twin._modules, method, replaced)
    _take_over(layer.quant_method.__dict__, twin.quant_method.__dict__, frozenset(), replaced)
    for tensor in _tensors(layer):  # (a released tensor the twin's result replaced: its loaders)
        restore_layer_refs(sanitize_layer_refs(tensor, twin), layer)
    for tensor in _tensors(twin):  # (else its tensors' loaders and the twin hold each other)
        sanitize_layer_refs(tensor, twin)


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [t for t in [*module._parameters.values(), *module._buffers.values()] if t is not None]


_ABSENT = object()


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
    attention layers; `owners[name]` lists the modules holding the live parameter a checkpoint
    tensor is written into, in any mode, and the attention layers whose implementation reads it
    (None: unknown, so every attention layer is processed after every round)."""

    model: torch.nn.Module
    dtype: torch.dtype
    model_config: object
    buffers: dict[torch.nn.Module, dict[str, torch.Tensor]]
    modules_of: dict[str, list[torch.nn.Module]]
    fallback_modules: list[torch.nn.Module]
    attention: list[torch.nn.Module]
    owners: Mapping[str, Sequence[torch.nn.Module]] | None = None
    prepared: dict[int, torch.nn.Module] = field(default_factory=dict)
    """`id(module)` -> its twin, processed by `prepare` for the next `after_update`."""
    releaser: Releaser = field(default_factory=Releaser)
    """Releases what a commit replaced, after it returns."""
    _attention_buffered: list[torch.nn.Module] = field(init=False)
    """The reload-mode modules inside attention layers (whose weight a layer may release)."""
    _layers_holding: dict[int, list[torch.nn.Module]] = field(init=False)
    """`id(module)` -> the attention layers holding it (themselves included)."""
    _attention_of: dict[str, list[torch.nn.Module]] = field(init=False)
    """The names whose write reaches an attention layer (per `owners`) -> those layers; worked
    out once, so a round looks up its own names only."""

    def __post_init__(self) -> None:
        inside: dict[int, torch.nn.Module] = {}
        self._layers_holding = {}
        for layer in self.attention:
            for module in layer.modules():
                inside[id(module)] = module
                self._layers_holding.setdefault(id(module), []).append(layer)
        self._attention_buffered = [m for m in inside.values() if m in self.buffers]
        self._attention_of = {}
        for name, modules in (self.owners or {}).items():
            layers = {id(layer): layer for m in modules for layer in self._layers_holding.get(id(m), [])}
            if layers:
                self._attention_of[name] = list(layers.values())

    def _touched(self, names: Collection[str] | None) -> list[torch.nn.Module]:
        """The modules a round of `names` (None: all) makes processing run on. A module an
        attention layer derives from, whose weight that layer released (`_released`), is
        processed whatever changed, and the attention layer holding it after it."""
        touched: dict[int, torch.nn.Module] = {}
        wanted = None if names is None else set(names)
        for name, modules in self.modules_of.items():
            if wanted is None or name in wanted:
                touched.update((id(m), m) for m in modules)
        for module in self._attention_buffered:
            if _holds_released(module, self.buffers[module]):
                touched[id(module)] = module
        return list(touched.values())

    def prepare(self, names: Collection[str] | None, spare: Callable[[torch.Tensor], torch.Tensor | None]) -> int:
        """Before a double-buffered round's commit, on CPUs: process a twin of each module it
        touches from its new values (`spare(buffer)`: where the round put a loader-form buffer's
        next values, None when it has none), for `after_update` to install. Returns modules
        prepared (none off CPUs, where processing may reach the live kernels)."""
        self.releaser.wait()
        self.prepared = {}
        if platform_kind() != "cpu":
            return 0
        for module in self._touched(names):
            spares = {name: spare(buffer) for name, buffer in self.buffers[module].items()}
            if all(s is not None for s in spares.values()):
                self.prepared[id(module)] = prepare(module, cast(dict[str, torch.Tensor], spares))
        return len(self.prepared)

    def after_update(self, names: Collection[str] | None, swap: bool = False) -> int:
        """Process what the round changed (install what `prepare` processed of it, or process it
        now; `swap`ping the memory behind live tensors in where the engine allows: `install`,
        `reprocess`); returns how many modules were processed or installed. The twins and what
        they replaced are released after it returns (`rl_sync.vllm.release`)."""
        self.releaser.wait()
        prepared, self.prepared = self.prepared, {}
        touched = self._touched(names)
        replaced: list[object] = []
        try:
            for module in touched:
                swapped = self.buffers[module].keys() if swap else ()  # (only what rl-sync feeds: `_adopt`)
                if id(module) in prepared:
                    install(module, prepared[id(module)], swapped, replaced)
                else:
                    reprocess(module, self.buffers[module], swapped)
            self.process_attention(self._attention_touched(names, touched))
        finally:
            replaced.extend(prepared.values())
            prepared.clear()
            self.releaser.release(replaced)
        return len(touched)

    def _attention_touched(
        self, names: Collection[str] | None, touched: Sequence[torch.nn.Module]
    ) -> list[torch.nn.Module]:
        """The attention layers a round of `names` (None: all) wrote into: those holding a module
        it wrote or processed (their own scales, MLA's `kv_b_proj`) or whose implementation reads
        a parameter it wrote (GPT-OSS's sinks, kept by the enclosing block). vLLM's own reload
        processes every attention layer because it cannot tell what a load wrote; the others
        derive state only from what the round left as it was. Every layer where `owners` is
        unknown or a fallback module was loaded."""
        if self.owners is None or self.fallback_modules:
            return list(self.attention)
        written = self._attention_of.keys() if names is None else [n for n in names if n in self._attention_of]
        chosen = {id(layer) for name in written for layer in self._attention_of[name]}
        chosen.update(id(layer) for m in touched for layer in self._layers_holding.get(id(m), []))
        return [layer for layer in self.attention if id(layer) in chosen]

    def process_attention(self, layers: Sequence[torch.nn.Module]) -> None:
        """vLLM's processing of attention layers, after every other module's (they may derive
        state from other modules' weights)."""
        for layer in layers:
            # vLLM's attention method: torch types nn.Module.__getattr__ as Tensor | Module
            layer.process_weights_after_loading(self.dtype)  # type: ignore[operator]

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
