"""Quantize on the sending side: a trainer rank's FP8 values and block scales for each round.

For every tensor the plan sends as block-quantized FP8 (`rl_sync.planning.quant`), the rank
keeps an FP8 copy of its shard and the scales of the blocks its shard touches, and
hands the round those in place of the bf16 shard: the FP8 copy as the tensor's
source, the scales of the blocks it owns as the scale tensor's source. Each round:

1. the fp32 amax of every block the shard touches (partial where the shard cuts a block);
2. the partial amaxes of cut blocks go to the other ranks holding parts of them, in one
   grouped launch (`rl_sync.planning.quant.amax_exchange`), and each rank takes the maximum;
3. scale = max(amax, 1e-4) / 448 and q = (x * (1 / scale)) cast to float8_e4m3fn: for the
   whole tensor, bit for bit, what vLLM's `per_block_cast_to_fp8` gives on a CPU. (On CUDA
   vLLM divides by 448 as a multiply by float32 1/448, one ulp off in some blocks; rl-sync
   divides exactly on every device.)

CUDA shards run steps 1 and 3 as Triton kernels (`engine.quantize_triton`: one read of the
shard each, one byte written per element), replayed as two CUDA graphs per round; CPU shards
run torch ops.

Ordering contract: every trainer rank runs `QuantStage.run` at the start of every round,
before its first bucket, with the round's tensor subset; the exchange is one `post` with
sends and receives in `amax_exchange` order.

Typical use (what `RankSession` does)::

    stage = QuantStage(plan, plan.blocks, rank)
    endpoints = stage.endpoints(sources)   # FP8 values and owned scales in place of the bf16 shards
    stage.run(sources, transport, deadline, wanted)   # every round, before the first bucket
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from ..planning.layout import Box
from ..planning.plan import ModelPlan
from ..planning.quant import AMAX_FLOOR, FP8_MAX, amax_exchange, grid_shape, scale_name, touched_blocks
from ..transport.base import Transport
from .endpoint import Endpoint

MAX_SUBSETS = 4
"""CUDA graphs kept per stage: the full round's plus recent tensor subsets'."""


def kernels():
    """The Triton kernels for CUDA shards (imported on first use: CPU installs need no Triton)."""
    from . import quantize_triton

    return quantize_triton


def _padded(
    x: torch.Tensor, box: Box, block: tuple[int, int], scratch: torch.Tensor | None = None
) -> tuple[torch.Tensor, tuple[int, int]]:
    """`x` (the global `box`) in fp32, zero-padded to whole blocks of its last two dims, as a
    `[..., rows, bn, cols, bk]` tensor (in `scratch` when given: reusing memory spares the
    page faults of a fresh allocation, which cost more than the arithmetic on a CPU), and
    where `x` starts in it."""
    lead = x.ndim - 2
    (r0, c0), (nr, nc) = box.offsets[lead:], box.sizes[lead:]
    (bn, bk), top, left = block, r0 % block[0], c0 % block[1]
    rows, cols = -(-(top + nr) // bn), -(-(left + nc) // bk)
    shape = tuple(x.shape[:lead]) + (rows * bn, cols * bk)
    padded = (
        torch.empty(shape, dtype=torch.float32, device=x.device)
        if scratch is None
        else scratch[: math.prod(shape)].view(shape)
    )
    if top or left or nr != rows * bn or nc != cols * bk:
        padded.zero_()
    padded[..., top : top + nr, left : left + nc] = x
    return padded.view(tuple(x.shape[:lead]) + (rows, bn, cols, bk)), (top, left)


def padded_numel(box: Box, block: tuple[int, int]) -> int:
    """Elements of `_padded`'s result for a shard at `box`."""
    return math.prod(touched_blocks(box, block).sizes) * block[0] * block[1]


def partial_amax(
    x: torch.Tensor, box: Box, block: tuple[int, int], scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """fp32 max of |x| over each block `box` touches (over its part of a block it cuts): the
    larger of the block's maximum and its negated minimum (reduced along columns, then rows:
    no |x| copy, contiguous reductions first)."""
    blocks, _ = _padded(x, box, block, scratch)
    return torch.maximum(blocks.amax(dim=-1).amax(dim=-2), blocks.amin(dim=-1).amin(dim=-2).neg_())


def scales_from(amax: torch.Tensor) -> torch.Tensor:
    """Block scales from block amaxes (vLLM's rule: amax floored at 1e-4, over 448), divided
    exactly on every device (CUDA divides by a host scalar as a multiply by its reciprocal,
    one ulp off in some blocks, so the divisor is a tensor)."""
    return amax.clamp(min=AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)


def quantize_into(
    out: torch.Tensor,
    x: torch.Tensor,
    box: Box,
    block: tuple[int, int],
    scales: torch.Tensor,
    scratch: torch.Tensor | None = None,
) -> None:
    """Write FP8 `x * (1 / scale)` into `out`; `scales` covers the blocks `box` touches."""
    blocks, (top, left) = _padded(x, box, block, scratch)
    blocks.mul_((1.0 / scales)[..., :, None, :, None])
    q = blocks.view(
        tuple(blocks.shape[:-4]) + (blocks.shape[-4] * blocks.shape[-3], blocks.shape[-2] * blocks.shape[-1])
    )
    out.copy_(q[..., top : top + out.shape[-2], left : left + out.shape[-1]])


@dataclass
class _Quantized:
    """One tensor this rank quantizes: its box, blocks, and the buffers the round sends from."""

    tensor: int
    name: str
    box: Box
    block: tuple[int, int]
    touched: Box
    owned: Box
    values: torch.Tensor = field(init=False)
    """The FP8 copy of the shard (made by `QuantStage.endpoints`, as is `amax`)."""
    amax: torch.Tensor = field(init=False)
    """The amax of each block this rank touches, then its scale: a view of the round's grid."""
    start: int = 0
    """Where `amax` starts in the round's grid buffer."""


def _captured(step) -> torch.cuda.CUDAGraph:
    """`step`'s launches as a CUDA graph (run once first, off the graph, to compile and allocate)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):  # other threads may use the device
        step()
    return graph


def _grid_view(amax: torch.Tensor, touched: Box, box: Box) -> torch.Tensor:
    """The part of a rank's amax grid (over `touched`) at grid box `box`."""
    return Endpoint(amax, touched.offsets).view(box.offsets, box.sizes)


class QuantStage:
    """One trainer rank's quantization of every block-quantized tensor it holds (see the module
    docstring)."""

    def __init__(self, plan: ModelPlan, blocks: Mapping[int, tuple[int, int]], rank: int):
        self.rank, self.items = rank, []
        self.exchange: list[tuple[int, int, int, Box]] = []
        """(tensor, peer, +1 send / -1 receive, grid box), in `amax_exchange` order."""
        for i, block in sorted(blocks.items()):
            spec = plan.specs[i]
            scale = plan.specs[plan.index[scale_name(spec.name)]]
            for part in amax_exchange(spec.shape, spec.src, block):
                if rank in (part.sender, part.receiver):
                    peer, way = (part.receiver, 1) if part.sender == rank else (part.sender, -1)
                    self.exchange.append((i, peer, way, part.box))
            box = spec.src.local_box(spec.shape, rank)
            if box is not None and not box.is_empty():
                owned = scale.src.local_box(grid_shape(spec.shape, block), rank)
                assert owned is not None  # the scales' source layout has the values' mesh
                self.items.append(_Quantized(i, spec.name, box, block, touched_blocks(box, block), owned))
        self._sources: Mapping | None = None
        self._endpoints: dict[str, Endpoint] = {}
        self._grid: torch.Tensor
        """Every tensor's amax grid, then its scales, in one buffer (`_Quantized.amax` are views;
        made by `endpoints`)."""
        self._launches: dict[tuple[int, ...] | None, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self._room: torch.Tensor | None = None

    def endpoints(self, sources: Mapping[str, Endpoint]) -> Mapping[str, Endpoint]:
        """`sources` with each quantized tensor's shard replaced by its FP8 copy, plus the scales
        this rank owns; the same mapping object for the same `sources` (compiled rounds replay)."""
        if not self.items or sources is self._sources:
            return self._endpoints if self.items else sources
        out = dict(sources)
        device = sources[self.items[0].name].tensor.device
        sizes = [item.touched.numel for item in self.items]
        self._grid = torch.zeros(sum(sizes), dtype=torch.float32, device=device)
        start = 0
        for item, grid in zip(self.items, self._grid.split(sizes)):
            item.start, start = start, start + grid.numel()
            shard = sources[item.name].tensor
            item.values = torch.empty(shard.shape, dtype=torch.float8_e4m3fn, device=shard.device)
            item.amax = grid.view(item.touched.sizes)
            out[item.name] = Endpoint(item.values, item.box.offsets)
            out[scale_name(item.name)] = Endpoint(_grid_view(item.amax, item.touched, item.owned), item.owned.offsets)
        self._sources, self._endpoints, self._launches = sources, out, {}
        self._graphs(sources, None)
        return out

    def run(
        self, sources: Mapping[str, Endpoint], transport: Transport, deadline: float, wanted: Collection[int] | None
    ) -> None:
        """Quantize this round's tensors into the buffers `endpoints(sources)` handed out."""
        items = self._items(wanted)
        if not items:
            return  # nothing here to quantize, so nothing to trade either (traders hold parts)
        graphs = self._graphs(sources, wanted)
        if graphs is not None:
            graphs[0].replay()
        else:
            scratch = self._scratch(items)
            for item in items.values():
                item.amax.copy_(partial_amax(sources[item.name].tensor, item.box, item.block, scratch))
        self._trade(items, transport, deadline, wanted)
        if graphs is not None:
            graphs[1].replay()
        else:
            self._scales(items, wanted)
            for item in items.values():
                quantize_into(item.values, sources[item.name].tensor, item.box, item.block, item.amax, scratch)

    def _items(self, wanted: Collection[int] | None) -> dict[int, _Quantized]:
        """This rank's quantized tensors in the round, by plan index (plan order)."""
        return {item.tensor: item for item in self.items if wanted is None or item.tensor in wanted}

    def _scratch(self, items: Mapping[int, _Quantized]) -> torch.Tensor:
        """fp32 room for the largest padded shard of a CPU round, kept across rounds."""
        need = max(padded_numel(item.box, item.block) for item in items.values()) if items else 0
        if self._room is None or self._room.numel() < need:
            self._room = torch.empty(need, dtype=torch.float32)
        return self._room

    def _scales(self, items: Mapping[int, _Quantized], wanted: Collection[int] | None) -> None:
        if wanted is None:  # every grid at once: a few launches, not a few per tensor
            self._grid.copy_(scales_from(self._grid))
        else:
            for item in items.values():
                item.amax.copy_(scales_from(item.amax))

    def _graphs(
        self, sources: Mapping[str, Endpoint], wanted: Collection[int] | None
    ) -> tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph] | None:
        """CUDA graphs of the two device steps (block maxima; scales and FP8 values), captured
        once per tensor subset while the shards stay the same (the full round's when the
        endpoints are made): one launch each per round, however many tensors (per-tensor
        launches cost more than the kernels). None on CPU."""
        items = self._items(wanted)
        if not items or not sources[next(iter(items.values())).name].tensor.is_cuda:
            return None
        key = None if wanted is None else tuple(items)
        if key not in self._launches:
            if len(self._launches) >= MAX_SUBSETS:
                self._launches.pop(next(iter(self._launches)))
            triton = kernels()

            def maxima() -> None:
                for item in items.values():
                    triton.block_amax(sources[item.name].tensor, item.box.offsets[-2:], item.block, item.amax)

            def quantize() -> None:
                self._scales(items, wanted)
                inverse = 1.0 / self._grid
                for item in items.values():
                    cells = inverse[item.start : item.start + item.touched.numel].view(item.touched.sizes)
                    triton.quantize_blocks(
                        sources[item.name].tensor, item.box.offsets[-2:], item.block, cells, item.values
                    )

            self._launches[key] = (_captured(maxima), _captured(quantize))
        return self._launches[key]

    def _trade(
        self, items: Mapping[int, _Quantized], transport: Transport, deadline: float, wanted: Collection[int] | None
    ) -> None:
        """Send partial amaxes of cut blocks and keep the maximum of what arrives."""
        sends: dict[int, list[torch.Tensor]] = {}
        recvs: dict[int, list[tuple[torch.Tensor, int]]] = {}
        for tensor, peer, way, box in self.exchange:
            if wanted is not None and tensor not in wanted:
                continue
            view = _grid_view(items[tensor].amax, items[tensor].touched, box)
            if way > 0:
                sends.setdefault(peer, []).append(view.reshape(-1))
            else:
                recvs.setdefault(peer, []).append((view, view.numel()))
        if not sends and not recvs:
            return
        out = [(peer, torch.cat(parts).view(torch.uint8)) for peer, parts in sorted(sends.items())]
        into = {
            peer: torch.empty(sum(n for _, n in parts), dtype=torch.float32, device=transport.device)
            for peer, parts in sorted(recvs.items())
        }
        pending = transport.post(
            out, [(peer, buf.view(torch.uint8)) for peer, buf in into.items()], label="amax exchange (FP8 block scales)"
        )
        pending.wait(deadline)
        transport.complete(deadline)
        for peer, parts in recvs.items():
            for (view, _), arrived in zip(parts, into[peer].split([n for _, n in parts])):
                view.copy_(torch.maximum(view, arrived.view(view.shape)))
