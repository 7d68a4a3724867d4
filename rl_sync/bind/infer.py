"""Read layouts off what an engine's loader does, instead of off name patterns.

An engine rank that watched its own loader (`rl_sync.vllm.probe`) knows, per
checkpoint tensor, the pieces it keeps: each a box of the checkpoint tensor
and where that box lands in a live parameter. Two pure steps turn that into
what the planner needs:

* `merge_pieces`: the pieces of one tensor on one rank as a single box plus a
  strided view of one parameter (`Geometry`), or `None` when no such view
  exists (then the tensor falls back, or is split first);
* `infer_layout`: the boxes of every rank of an engine as one `Layout`
  (replicated, sharded in `torch.chunk` or fixed-size blocks, with groups of
  ranks holding the same box, or held by a subset of ranks), verified against
  every rank's box, or `None`.

Typical use::

    merged = merge_pieces(pieces)                          # per rank
    layout = infer_layout(shape, [box_of_rank_0, box_of_rank_1])
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..planning.layout import Box, Layout, Mesh, Replicate, Shard


@dataclass(frozen=True)
class Geometry:
    """A strided view of a parameter's storage: `param.as_strided(sizes, strides, offset)`."""

    offset: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]


@dataclass(frozen=True)
class Piece:
    """One copy the loader made: box `src` of the checkpoint tensor into `dst` of a parameter."""

    param: str
    src: Box
    dst: Geometry


@dataclass(frozen=True)
class Merged:
    """A tensor's pieces on one rank as one box and one view of one parameter."""

    param: str
    box: Box
    dst: Geometry


def _grid(boxes: Sequence[Box], bound: Box) -> list[list[tuple[int, int]]] | None:
    """Per dim, the sorted intervals of `boxes` when they tile `bound` exactly (every
    combination of one interval per dim appears once), else `None`."""
    combos = {tuple(zip(b.offsets, b.sizes)) for b in boxes}
    if len(combos) != len(boxes):
        return None
    grid = [sorted({key[d] for key in combos}) for d in range(bound.ndim)]
    for d, intervals in enumerate(grid):
        cursor = bound.offsets[d]
        for start, size in intervals:
            if start != cursor:
                return None
            cursor += size
        if cursor != bound.ends[d]:
            return None
    return grid if len(combos) == math.prod(len(i) for i in grid) else None


def _bound(boxes: Sequence[Box]) -> Box:
    lo = [min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim)]
    hi = [max(b.ends[d] for b in boxes) for d in range(boxes[0].ndim)]
    return Box(tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi)))


def _stride(
    d: int, pieces: Sequence[Piece], grid: list[list[tuple[int, int]]], at: dict[tuple[tuple[int, int], ...], Piece]
) -> int | None:
    """The parameter stride of checkpoint dim `d`: read off a piece spanning it, else from the
    offsets of the two first pieces along it; `None` when they disagree or do not divide."""
    spans = {p.dst.strides[d] for p in pieces if p.src.sizes[d] > 1}
    if spans:
        return spans.pop() if len(spans) == 1 else None
    if len(grid[d]) == 1:
        return 0
    corner = tuple(intervals[0] for intervals in grid)
    step = corner[:d] + (grid[d][1],) + corner[d + 1 :]
    delta, moved = at[step].dst.offset - at[corner].dst.offset, grid[d][1][0] - grid[d][0][0]
    return delta // moved if delta % moved == 0 else None


def merge_pieces(pieces: Sequence[Piece]) -> Merged | None:
    """One box and one affine view covering every piece, or `None`.

    Pieces merge when they all land in one parameter, tile a box of the
    checkpoint tensor, and sit in the parameter at the offsets one set of
    strides predicts (e.g. the gate and up halves of one expert, or the same
    rows of consecutive experts)."""
    pieces = [p for p in pieces if p.src.numel > 0]
    if not pieces or len({p.param for p in pieces}) != 1 or any(p.src.sizes != p.dst.sizes for p in pieces):
        return None
    if len(pieces) == 1:
        return Merged(pieces[0].param, pieces[0].src, pieces[0].dst)
    bound = _bound([p.src for p in pieces])
    grid = _grid([p.src for p in pieces], bound)
    if grid is None:
        return None
    at = {tuple(zip(p.src.offsets, p.src.sizes)): p for p in pieces}
    found = [_stride(d, pieces, grid, at) for d in range(bound.ndim)]
    strides = [s for s in found if s is not None]
    if len(strides) != len(found):
        return None
    base = at[tuple(intervals[0] for intervals in grid)].dst.offset
    for p in pieces:
        if p.dst.offset != base + sum((o - b) * s for o, b, s in zip(p.src.offsets, bound.offsets, strides)):
            return None
    return Merged(pieces[0].param, bound, Geometry(base, bound.sizes, tuple(strides)))


def _holders(boxes: Sequence[Box | None]) -> dict[int, Box]:
    """Each rank that holds a non-empty box, in rank order, with its box."""
    return {r: b for r, b in enumerate(boxes) if b is not None and not b.is_empty()}


def _matches(layout: Layout, shape: tuple[int, ...], boxes: Sequence[Box | None]) -> bool:
    for rank, want in enumerate(boxes):
        got = layout.local_box(shape, rank)
        if (want is None or want.is_empty()) != (got is None or got.is_empty()):
            return False
        if want is not None and not want.is_empty() and got != want:
            return False
    return True


def _sharded_candidates(shape: tuple[int, ...], holders: dict[int, Box]) -> list[Layout]:
    full = Box((0,) * len(shape), shape)
    dims = {
        d
        for box in holders.values()
        for d in range(len(shape))
        if (box.offsets[d], box.sizes[d]) != (full.offsets[d], full.sizes[d])
    }
    if len(dims) != 1:
        return []
    dim = dims.pop()
    groups: dict[tuple[int, int], list[int]] = {}
    for r, box in holders.items():
        groups.setdefault((box.offsets[dim], box.sizes[dim]), []).append(r)
    ordered = [groups[k] for k in sorted(groups)]
    rep = len(ordered[0])
    if any(len(g) != rep for g in ordered):
        return []
    mesh = Mesh.from_ranks(ordered if rep > 1 else [g[0] for g in ordered])
    tail = (Replicate(),) if rep > 1 else ()
    first_size = sorted(groups)[0][1]
    return [Layout(mesh, (Shard(dim, block),) + tail) for block in (0, first_size)]


def infer_layout(shape: Sequence[int], boxes: Sequence[Box | None]) -> Layout | None:
    """The layout over ranks `[0, len(boxes))` giving rank r exactly `boxes[r]` (`None` or
    empty: holds nothing), or `None` when no replicated or one-dim sharded layout does."""
    shape = tuple(shape)
    holders = _holders(boxes)
    if not holders:
        return None
    candidates = [Layout(Mesh.from_ranks(list(holders)), (Replicate(),))] + _sharded_candidates(shape, holders)
    for layout in candidates:
        try:
            if _matches(layout, shape, boxes):
                return layout
        except ValueError:
            continue
    return None


def find_cuts(
    shape: Sequence[int], boxes: Sequence[Sequence[Box]], forbidden: Collection[int] = ()
) -> tuple[int, list[int]] | None:
    """A dim and the fewest cuts along it that leave each rank's boxes (`boxes[r]`) able to form
    one box per part: no box straddles a cut, and a cut lies in every gap a rank leaves along
    that dim (gate and up rows of one TP rank inside a fused gate|up tensor). Where no dim has
    such gaps, a dim cut wherever one of a rank's boxes ends and the next begins (Bloom's q, k
    and v rows of one head, adjacent in the checkpoint, apart in the parameter). Dims in
    `forbidden` are never cut; `None` when no dim works."""
    for touching in (False, True):
        for dim in range(len(shape)):
            cuts = None if dim in forbidden else _cuts_along(dim, boxes, touching)
            if cuts:
                return dim, cuts
    return None


def _cuts_along(dim: int, boxes: Sequence[Sequence[Box]], touching: bool) -> list[int] | None:
    """The fewest cuts along `dim` through every gap between a rank's boxes (and, `touching`,
    every point where one ends and the next begins); None where boxes overlap, straddle a cut, or
    leave a rank more than one box's worth in a part."""
    gaps, overlapping = [], False
    for rank_boxes in boxes:
        bands = sorted({(b.offsets[dim], b.ends[dim]) for b in rank_boxes})
        for (_, end), (start, _) in itertools.pairwise(bands):
            overlapping |= start < end
            if start > end or (touching and start == end):
                gaps.append((end, start))
    if overlapping or not gaps:
        return None
    cuts: list[int] = []
    for lo, hi in sorted(gaps, key=lambda g: g[1]):
        if not cuts or cuts[-1] < lo:
            cuts.append(hi)
    if any(b.offsets[dim] < c < b.ends[dim] for rank_boxes in boxes for b in rank_boxes for c in cuts):
        return None
    bounds = [0, *cuts, max(b.ends[dim] for rank_boxes in boxes for b in rank_boxes)]
    for lo, hi in itertools.pairwise(bounds):
        for rank_boxes in boxes:
            inside = [b for b in rank_boxes if lo <= b.offsets[dim] and b.ends[dim] <= hi]
            if inside and _bound(inside).numel != sum(b.numel for b in inside):
                return None
    return cuts
