"""Which vLLM parameters may be written in place, and which need vLLM's post-load processing.

vLLM transforms some parameters after loading (`process_weights_after_loading`
of a layer's `quant_method`): on CPU it repacks linear weights for oneDNN,
keeps a packed copy of the vocabulary head and permutes MoE experts into its
grouped-GEMM layout; quantized layers quantize or shuffle. Writing new values
into such a parameter in place would leave the kernel reading stale or
misinterpreted data. A parameter is *direct* only when every module holding it
runs no processing, or one this module knows keeps parameters as stored on the
current platform, and the live parameter still has the shape, strides and
dtype the loaders fill; everything else is *reload*: it is received into a
buffer of that loader form and the owning modules are processed again.

Typical use::

    mode, reason = param_mode(owners, live_param, form)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..wire.messages import WriteMode as Mode
from .probe import ParamForm

_AS_STORED_OFF_CPU = frozenset({"UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"})
"""Processing that leaves parameters as loaded everywhere except on CPU (and XPU), where
vLLM's `process_weights_after_loading` repacks them (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py)."""


def platform_kind() -> str:
    """`cpu`, `xpu` or `gpu`: where this vLLM process runs its model."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "xpu" if current_platform.is_xpu() else "gpu"


def processing_of(module: torch.nn.Module) -> str | None:
    """The class name of the post-load processing `module` runs, or None when it runs none
    that touches its parameters."""
    method = getattr(module, "quant_method", None)
    if method is None or not callable(getattr(method, "process_weights_after_loading", None)):
        return None
    name = type(method).__name__
    if name in _AS_STORED_OFF_CPU and platform_kind() == "gpu":
        return None
    return name


def param_mode(owners: Sequence[torch.nn.Module], live: torch.Tensor, form: ParamForm) -> tuple[Mode, str]:
    """`direct` or `reload` for one live parameter, with the reason in words."""
    processing = sorted({p for p in map(processing_of, owners) if p is not None})
    if processing:
        return "reload", f"vLLM processes it after loading ({', '.join(processing)} on {platform_kind()})"
    if (tuple(live.shape), tuple(live.stride()), live.dtype) != (form.shape, form.stride, form.dtype):
        return "reload", (
            f"live parameter is {tuple(live.shape)} {live.dtype}, the loader fills {form.shape} {form.dtype}"
        )
    return "direct", "used as stored"
