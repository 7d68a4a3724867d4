"""Block-quantized FP8 destinations: the format, scale names, scale layouts, the amax exchange.

A destination may keep a checkpoint tensor `X` (bf16 or fp32 on the trainers) as
float8_e4m3fn values plus one fp32 scale per `bn x bk` block of its last two dims:
the layout of vLLM's block-quantized FP8 linear and fused-MoE layers (`weight` and
`weight_scale_inv` of shape `[..., ceil(N / bn), ceil(K / bk)]`, DeepSeek-V3's
checkpoint format). The values are those of vLLM's `per_block_cast_to_fp8`::

    amax = max(|x| over the block, in fp32, at least 1e-4);  scale = amax / 448
    q = (x * (1 / scale)) cast to float8_e4m3fn

The plan carries two tensors for it: `X` itself in float8_e4m3fn, laid out as the
trainers lay out the bf16 tensor, and `scale_name(X)`, the scale grid. On the trainers
each rank holds the scales of the blocks whose first element it holds
(`source_scale_layout`); on the workers each TP shard holds whole blocks
(`dest_scale_layout`, which refuses a layout where it would not, as vLLM does). Trainers
quantize before they send (`rl_sync.engine.quantize`); a block their shards cut needs the
amax of every part, so the ranks holding parts of it first trade partial amaxes
(`amax_exchange`): one float per cut block.

Typical use::

    dest_scale_layout(Layout(Mesh((2,)), (Shard(0),)), (1024, 512), (128, 128), "w")
    # Layout(Mesh((2,), start_rank=0)[S(0, grid=1024/128)]): 4 scale rows per TP rank
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .layout import Box, Layout, Replicate, Shard

FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
FP8_MAX = 448.0
"""Largest finite float8_e4m3fn value."""
AMAX_FLOOR = 1e-4
"""Smallest block amax (vLLM's `per_block_cast_to_fp8`): an all-zero block gets scale 1e-4 / 448."""
_SUFFIX = "::scale_inv"
LIVE_SCALE_SUFFIX = "_scale_inv"
"""An engine keeps the scales of block-quantized live weight `p` in `p + LIVE_SCALE_SUFFIX`
(vLLM's `weight_scale_inv`, `w13_weight_scale_inv`)."""


def scale_name(name: str) -> str:
    """The plan name of tensor `name`'s block scales."""
    return name + _SUFFIX


def is_scale_name(name: str) -> bool:
    return name.endswith(_SUFFIX)


def scaled_name(name: str) -> str:
    """The tensor whose scales plan name `name` holds (`name` itself when it holds none)."""
    return name.removesuffix(_SUFFIX)


def check_block(block: tuple[int, ...], what: str) -> tuple[int, int]:
    if len(block) != 2 or not all(type(b) is int and b > 0 for b in block):
        raise ValueError(f"{what}: quantization block must be two positive ints (rows, cols), got {block!r}")
    return block[0], block[1]


def grid_shape(shape: tuple[int, ...], block: tuple[int, int], what: str = "tensor") -> tuple[int, ...]:
    """Shape of the scale grid of a tensor of `shape` (blocks over its last two dims)."""
    if len(shape) < 2:
        raise ValueError(f"{what}: block quantization needs a tensor of at least 2 dims, got shape {tuple(shape)}")
    return tuple(shape[:-2]) + tuple(-(-n // b) for n, b in zip(shape[-2:], block))


def _block_of(shape: tuple[int, ...], block: tuple[int, int], dim: int) -> int:
    """The block size along `dim` (1 for the leading dims, which are not blocked)."""
    lead = len(shape) - 2
    return block[dim - lead] if dim >= lead else 1


def _check_single_axis(layout: Layout, dim: int, what: str) -> None:
    axes = [p for p in layout.placements if isinstance(p, Shard) and p.dim == dim]
    if len(axes) > 1:
        raise ValueError(
            f"{what}: {layout} shards quantized dim {dim} over {len(axes)} mesh axes; block "
            "quantization takes one axis per dim"
        )


def source_scale_layout(layout: Layout, shape: tuple[int, ...], block: tuple[int, int], what: str) -> Layout:
    """The scales' layout on the trainers: each position holds the blocks whose first element it
    holds (so every block has exactly one owner, however the data shards cut blocks)."""
    placements = []
    for p in layout.placements:
        b = _block_of(shape, block, p.dim) if isinstance(p, Shard) else 1
        if isinstance(p, Replicate) or b == 1:
            placements.append(p)
            continue
        if p.block or p.grid:
            raise ValueError(
                f"{what}: the trainers shard quantized dim {p.dim} as {p}; quantized tensors take "
                "torch.chunk shards (Shard(dim)) or replicas"
            )
        _check_single_axis(layout, p.dim, what)
        placements.append(Shard(p.dim, b, shape[p.dim]))
    return Layout(layout.mesh, tuple(placements))


def dest_scale_layout(layout: Layout, shape: tuple[int, ...], block: tuple[int, int], what: str) -> Layout:
    """The scales' layout on the workers; `ValueError` unless every shard of a quantized dim is
    whole blocks (the last may end at the tensor's edge), the rule vLLM checks at load."""
    placements = []
    for axis, p in enumerate(layout.placements):
        b = _block_of(shape, block, p.dim) if isinstance(p, Shard) else 1
        if isinstance(p, Replicate) or b == 1:
            placements.append(p)
            continue
        _check_single_axis(layout, p.dim, what)
        parts, n = layout.mesh.shape[axis], shape[p.dim]
        if p.grid:
            raise ValueError(f"{what}: the destination lays dim {p.dim} out as {p}, a scale grid; expected its data")
        piece = p.block or -(-n // parts)
        if (p.block and piece % b) or (not p.block and piece % b and parts > 1 and piece < n):
            raise ValueError(
                f"{what}: the destination splits dim {p.dim} (size {n}) into shards of {piece} over "
                f"{parts} ranks, which is not a multiple of the quantization block {b}; expected shards "
                f"of whole {b}-blocks (choose a block size that divides {piece}, or another TP size)"
            )
        placements.append(Shard(p.dim, b, n) if not p.block else Shard(p.dim, p.block // b))
    return Layout(layout.mesh, tuple(placements))


def touched_blocks(box: Box, block: tuple[int, int]) -> Box:
    """The grid box of every block `box` holds an element of."""
    lead = box.ndim - 2
    offsets, sizes = list(box.offsets[:lead]), list(box.sizes[:lead])
    for o, s, b in zip(box.offsets[lead:], box.sizes[lead:], block):
        first = o // b
        offsets.append(first)
        sizes.append(-(-(o + s) // b) - first if s else 0)
    return Box(tuple(offsets), tuple(sizes))


@dataclass(frozen=True)
class AmaxPart:
    """Rank `sender` sends rank `receiver` its partial amax over grid box `box` of one tensor."""

    sender: int
    receiver: int
    box: Box


@lru_cache(maxsize=4096)
def amax_exchange(shape: tuple[int, ...], layout: Layout, block: tuple[int, int]) -> tuple[AmaxPart, ...]:
    """Who sends whom which partial amaxes of a tensor of `shape` laid out by `layout`: every
    rank holding part of a block gets, from one holder of each other part, that part's amax
    (holder chosen by the receiver's replica index, to spread replicas' load). Deterministic:
    the same list, in the same order, on every rank."""
    cells: dict[Box, list[int]] = {}
    for rank, box in zip(layout.mesh.ranks, layout.all_boxes(shape)):
        if not box.is_empty():
            cells.setdefault(box, []).append(rank)
    touched = {cell: touched_blocks(cell, block) for cell in cells}
    parts = []
    for cell, holders in cells.items():
        for other, senders in cells.items():
            common = touched[cell].intersect(touched[other]) if other is not cell else None
            if common is None:
                continue
            for index, receiver in enumerate(holders):
                parts.append(AmaxPart(senders[index % len(senders)], receiver, common))
    return tuple(parts)
