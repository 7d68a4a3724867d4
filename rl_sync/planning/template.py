"""Reshard templates: the transfers of one tensor in mesh-local coordinates.

A template depends only on the tensor shape, the two meshes' shapes and
placements, and which source positions are also destination positions
(colocated plans). Every tensor of a model that shares those (all experts of
a MoE layer, the same projection in every layer) shares one template, so a
1T-parameter model with tens of thousands of tensors plans a few dozen of
them. Ranks are mesh positions here (`src` indexes the source mesh's ranks in
row-major order, `dst` the destination mesh's); `plan.py` maps them to ranks.

Choosing among replicas is deterministic: destinations are visited in mesh
order and each source cell counts how many times it has been asked for (its
turn t):

* a piece held by k > 1 replicas and at least `SPLIT_MIN_ELEMENTS` per
  replica is split into k row bands, band j sent by replica (j + t) mod k;
* a smaller piece goes whole to replica t mod k.

Turns spread replicated destinations (engine replicas) over source replicas;
splitting spreads a single large piece.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .layout import Box, Layout, Mesh, Placement

SPLIT_MIN_ELEMENTS = 1 << 16


@dataclass(frozen=True)
class TemplateKey:
    """Everything a template depends on; hashable, so templates are cached."""

    shape: tuple[int, ...]
    src_shape: tuple[int, ...]
    src_placements: tuple[Placement, ...]
    dst_shape: tuple[int, ...]
    dst_placements: tuple[Placement, ...]
    overlap: tuple[tuple[int, int], ...]
    """(source position, destination position) pairs that are the same rank."""

    @classmethod
    def of(cls, shape: tuple[int, ...], src: Layout, dst: Layout) -> TemplateKey:
        overlap = mesh_overlap(src.mesh, dst.mesh)
        return cls(shape, src.mesh.shape, src.placements, dst.mesh.shape, dst.placements, overlap)


@lru_cache(maxsize=65536)
def template_key(shape: tuple[int, ...], src: Layout, dst: Layout) -> TemplateKey:
    """The (cached) `TemplateKey` of a tensor of `shape` from `src` to `dst`."""
    return TemplateKey.of(shape, src, dst)


@lru_cache(maxsize=65536)
def mesh_overlap(src: Mesh, dst: Mesh) -> tuple[tuple[int, int], ...]:
    """(source position, destination position) of every rank in both meshes."""
    return tuple(
        (src_pos, dst_pos) for dst_pos, rank in enumerate(dst.ranks) if (src_pos := src.index_of(rank)) is not None
    )


@dataclass(frozen=True, eq=False)
class Template:
    """Transfers and local copies of one tensor, by mesh position.

    Arrays are read-only; `offsets`/`sizes` are `(m, ndim)` global boxes.
    `send_numel[p]` / `recv_numel[p]` total the elements position p sends /
    receives; `forced_numel[p]` counts those only p holds (a lower bound on
    what p must send).
    """

    key: TemplateKey
    src: np.ndarray
    dst: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    numel: np.ndarray
    local_src: np.ndarray
    local_dst: np.ndarray
    local_offsets: np.ndarray
    local_sizes: np.ndarray
    send_numel: np.ndarray
    recv_numel: np.ndarray
    forced_numel: np.ndarray

    @property
    def num_transfers(self) -> int:
        return len(self.src)


class _SourceGrid:
    """The source boxes as a grid of cells, each with its holder positions."""

    def __init__(self, shape: tuple[int, ...], layout: Layout):
        self.holders: dict[tuple[int, ...], list[int]] = {}
        self.cells: dict[tuple[int, ...], Box] = {}
        starts: list[set[int]] = [set() for _ in shape]
        for pos, box in enumerate(layout.all_boxes(shape)):
            if box.is_empty():
                continue
            self.holders.setdefault(box.offsets, []).append(pos)
            self.cells[box.offsets] = box
            for dim, offset in enumerate(box.offsets):
                starts[dim].add(offset)
        self.starts = [sorted(s) for s in starts]
        self.ordinal = {offsets: i for i, offsets in enumerate(sorted(self.cells))}

    def overlapping(self, region: Box) -> list[tuple[int, ...]]:
        """Offsets of the cells that intersect `region`, in row-major order."""
        per_dim = []
        for starts, lo, size in zip(self.starts, region.offsets, region.sizes):
            first = bisect.bisect_right(starts, lo) - 1
            last = bisect.bisect_left(starts, lo + size)
            per_dim.append(starts[max(first, 0) : last])
        return list(itertools.product(*per_dim))


def _assign(piece: Box, holders: list[int], turn: int) -> list[tuple[int, Box]]:
    """Which replica sends which part of `piece` (see module docstring)."""
    k = len(holders)
    if k == 1:
        return [(holders[0], piece)]
    if piece.numel >= k * SPLIT_MIN_ELEMENTS:
        parts = piece.split_rows(k)
        return [(holders[(j + turn) % k], part) for j, part in enumerate(parts)]
    return [(holders[turn % k], piece)]


def _pieces(grid: _SourceGrid, region: Box) -> list[tuple[Box, list[int], int]]:
    """(piece, holder positions, cell ordinal) of every cell `region` overlaps."""
    out = []
    for offsets in grid.overlapping(region):
        piece = region.intersect(grid.cells[offsets])
        if piece is not None:
            out.append((piece, grid.holders[offsets], grid.ordinal[offsets]))
    return out


@dataclass(frozen=True, eq=False)
class _Needed:
    """What one destination box needs: single-holder pieces as columns, replicated ones as a list."""

    src: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    replicated: list[tuple[Box, list[int], int]]

    @classmethod
    def of(cls, grid: _SourceGrid, regions: list[Box], ndim: int) -> _Needed:
        pieces = [p for region in regions for p in _pieces(grid, region)]
        single = [(holders[0], 0, piece) for piece, holders, _ in pieces if len(holders) == 1]
        src, _, offsets, sizes = _columns(single, ndim)
        return cls(src, offsets, sizes, [p for p in pieces if len(p[1]) > 1])


@lru_cache(maxsize=4096)
def build_template(key: TemplateKey) -> Template:
    """Compute (once per key) every transfer of a tensor with this key.

    The source layout's boxes form a grid of cells (`_SourceGrid`): each distinct box is a
    cell, held by every source position whose box it is (several when a mesh axis
    replicates). For each destination position, in mesh order:

    1. If the destination rank also holds a source box (colocated), the overlap is a local
       copy, and only `box.minus(held)` (at most 2 * ndim boxes) is needed from peers.
    2. The needed regions are intersected with the cells they overlap (one bisect per dim
       per region). A piece of a cell with one holder is a fixed transfer; destinations with
       the same (box, held) pair reuse these columns (`needed_of`).
    3. A piece of a replicated cell is assigned by `_assign` from the cell's turn, which then
       advances, so successive destinations asking for one cell rotate over its holders.

    Transfers are kept as columns (src, dst, offsets, sizes), concatenated per destination.
    """
    src_layout = Layout(Mesh(key.src_shape), key.src_placements)
    dst_layout = Layout(Mesh(key.dst_shape), key.dst_placements)
    grid, ndim = _SourceGrid(key.shape, src_layout), len(key.shape)
    src_boxes = src_layout.all_boxes(key.shape)
    overlap = {d: s for s, d in key.overlap}
    blocks: list[tuple[np.ndarray, ...]] = []
    local: list[tuple[int, int, Box]] = []
    needed_of: dict[tuple[Box, Box | None], _Needed] = {}
    turns: dict[int, int] = {}
    for dst_pos, box in enumerate(dst_layout.all_boxes(key.shape)):
        if box.is_empty():
            continue
        held_pos = overlap.get(dst_pos)
        held = None
        if held_pos is not None:
            held = src_boxes[held_pos]
            if (own := box.intersect(held)) is not None:
                local.append((held_pos, dst_pos, own))
        if (box, held) not in needed_of:
            needed_of[(box, held)] = _Needed.of(grid, box.minus(held) if held is not None else [box], ndim)
        needed = needed_of[(box, held)]
        blocks.append((needed.src, np.full(len(needed.src), dst_pos), needed.offsets, needed.sizes))
        rotated: list[tuple[int, int, Box]] = []
        for piece, holders, cell in needed.replicated:
            rotated.extend((s, dst_pos, part) for s, part in _assign(piece, holders, turns.get(cell, 0)))
            turns[cell] = turns.get(cell, 0) + 1
        blocks.append(_columns(rotated, ndim))
    columns = tuple(np.concatenate([b[i] for b in blocks]) if blocks else _columns([], ndim)[i] for i in range(4))
    sole = np.zeros(len(src_boxes), dtype=np.int64)
    for holders in grid.holders.values():
        sole[holders] = len(holders) == 1
    return _freeze(key, columns, _columns(local, ndim), sole, dst_layout.mesh.size)


def _columns(entries: list[tuple[int, int, Box]], ndim: int) -> tuple[np.ndarray, ...]:
    src = np.fromiter((e[0] for e in entries), dtype=np.int64, count=len(entries))
    dst = np.fromiter((e[1] for e in entries), dtype=np.int64, count=len(entries))
    offsets = np.array([e[2].offsets for e in entries], dtype=np.int64).reshape(len(entries), ndim)
    sizes = np.array([e[2].sizes for e in entries], dtype=np.int64).reshape(len(entries), ndim)
    return src, dst, offsets, sizes


def sum_by(index: np.ndarray, values: np.ndarray, length: int) -> np.ndarray:
    """Exact int64 totals of `values` grouped by `index` (0 <= index < length)."""
    out = np.zeros(length, dtype=np.int64)
    np.add.at(out, index, values)
    return out


def _freeze(key, columns, local_cols, sole: np.ndarray, num_dst: int) -> Template:
    num_src = len(sole)
    src, dst, offsets, sizes = columns
    numel = sizes.prod(axis=1)
    forced = sum_by(src, numel * sole[src], num_src)
    arrays = dict(
        src=src,
        dst=dst,
        offsets=offsets,
        sizes=sizes,
        numel=numel,
        local_src=local_cols[0],
        local_dst=local_cols[1],
        local_offsets=local_cols[2],
        local_sizes=local_cols[3],
        send_numel=sum_by(src, numel, num_src),
        recv_numel=sum_by(dst, numel, num_dst),
        forced_numel=forced,
    )
    for array in arrays.values():
        array.flags.writeable = False
    return Template(key=key, **arrays)
