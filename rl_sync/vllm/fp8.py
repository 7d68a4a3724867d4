"""vLLM's block-quantized FP8 linear layers as rl-sync destinations.

A vLLM engine started on a block-FP8 checkpoint (`quantization_config` with
`weight_block_size`, DeepSeek-V3's format) keeps each linear layer's `weight`
as float8_e4m3fn and one fp32 scale per block in `weight_scale_inv`. The
trainers hold the bf16 (or fp32) weights; rl-sync's source-side quantizer
(`rl_sync.engine.quantize`) sends each box as FP8 plus the scales of its blocks
(`rl_sync.planning.quant`), exactly what the checkpoint's quantizer writes. The
binding (`rl_sync.vllm.binding`) gives such a weight a destination of dtype
float8_e4m3fn with the layer's block, and its scales (`scale_name(name)`) the
matching blocks of `weight_scale_inv`, both in the loader form vLLM processes
after a round (its kernels may re-lay them out).

Online FP8 (`quantization="fp8"` on a bf16 checkpoint) needs nothing here: its
loaders fill bf16 weights, which vLLM quantizes when it processes the layer.

Typical use::

    block = block_of(owners, live_weight, form)              # (128, 128), or None
    view = scale_view(merged.dst, form, scale_buffer, grid_box, block, "vLLM rank 0: 'q_proj.weight'")
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..bind.infer import Geometry
from ..planning.layout import Box
from .probe import ParamForm, attr_of

FP8 = torch.float8_e4m3fn
SCALE_ATTR = "weight_scale_inv"
"""Where vLLM's block-FP8 linear layers keep their scales (`Fp8LinearMethod.create_weights`)."""


def block_of(owners: Sequence[torch.nn.Module], live: torch.Tensor, form: ParamForm) -> tuple[int, int] | None:
    """The block a parameter is kept FP8-quantized in (its loaders fill float8_e4m3fn and its
    module names `weight_block_size` and holds `weight_scale_inv`), None for a parameter loaded in
    any other dtype; `ValueError` for an FP8 parameter of another scheme (per-tensor scales)."""
    if form.dtype != FP8:
        return None
    for module in owners:
        size = getattr(module, "weight_block_size", None)
        if size is not None and attr_of(module, live) == "weight" and module._parameters.get(SCALE_ATTR) is not None:
            return int(size[0]), int(size[1])
    kinds = sorted({type(getattr(m, "quant_method", None)).__name__ for m in owners})
    raise ValueError(
        f"a parameter of {', '.join(kinds)} is loaded as float8_e4m3fn without a block size: rl-sync quantizes "
        "for block-FP8 checkpoints (quantization_config.weight_block_size) and online FP8 "
        "(quantization='fp8' on a bf16 checkpoint), not for per-tensor FP8 checkpoints"
    )


def scale_param(owners: Sequence[torch.nn.Module]) -> torch.Tensor:
    """The live `weight_scale_inv` of the block-FP8 layer among `owners`."""
    found = [p for m in owners if (p := m._parameters.get(SCALE_ATTR)) is not None]
    assert found, "block_of found this layer's scales"
    return found[0]


def scale_elements(box: Box, block: tuple[int, int]) -> int:
    """Scales of the blocks a box of the last two dims starts (its blocks, the last may be cut)."""
    return math.prod(box.sizes[:-2]) * math.prod(-(-n // b) for n, b in zip(box.sizes[-2:], block))


def scale_view(
    weight: Geometry, form: ParamForm, scales: torch.Tensor, grid: Box, block: tuple[int, int], what: str
) -> torch.Tensor:
    """The blocks of loader-form `scales` that a weight view (`weight`, in a parameter of loader
    form `form`) covers: `grid.sizes` scales from the block holding the view's first element.
    `ValueError` unless the view starts on a block boundary of a row-major 2-D weight."""
    if len(form.shape) != 2 or form.stride[1] != 1 or weight.strides[-1] not in (0, 1):
        raise ValueError(
            f"{what}: block-FP8 weights are rows of a 2-D row-major parameter; the loader fills "
            f"{form.shape} with strides {form.stride}"
        )
    row, col = divmod(weight.offset, form.stride[0])
    if row % block[0] or col % block[1]:
        raise ValueError(
            f"{what}: its slot starts at row {row}, column {col} of the layer's weight, not on a "
            f"{block[0]}x{block[1]} block boundary; every fused slot and shard must hold whole blocks"
        )
    offset = scales.storage_offset() + (row // block[0]) * scales.stride(0) + (col // block[1]) * scales.stride(1)
    return torch.as_strided(scales, grid.sizes, scales.stride(), offset)
