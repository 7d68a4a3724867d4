"""Layout algebra: device meshes, placements and the global boxes ranks hold.

Semantics follow DTensor exactly: a `Shard(dim)` placement splits a tensor
dimension into `torch.chunk` pieces (chunk = ceil(n / k), trailing pieces
smaller or empty), and several mesh axes sharding one dimension split it from
axis 0 to the last.

Typical use::

    mesh = Mesh((2, 4))                       # ranks 0..7, row-major
    layout = Layout(mesh, (Replicate(), Shard(0)))
    layout.local_box((1000, 64), rank=5)      # Box(offsets=(250, 0), sizes=(250, 64))

Everything here is pure data: frozen, hashable, no torch, no communication.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Shard:
    """Split tensor dimension `dim` across one mesh axis.

    `block=0` (the default, DTensor's semantics): `torch.chunk` sizes. `block=b`:
    position i holds `[i * b, (i + 1) * b)` clipped to the dim, the layout of a
    vocab-parallel embedding whose rows are padded to `b * axis size`.

    `grid=n` (with `block=b`): this dim indexes the `b`-element blocks of a dim of
    `n` elements that `Shard(dim)` splits, and position i holds the blocks whose
    first element its `torch.chunk` piece holds: the scales of a block-quantized
    tensor laid out like its data (`rl_sync.planning.quant`).

    `shift=s` (with `block=b`): positions count from `s` elements before the dim's
    start, so position i holds `[i * b - s, (i + 1) * b - s)` clipped to the dim: the
    elements `[s, s + n)` of a dim sharded in blocks of b, renumbered from 0 (a part of
    a fused tensor cut along a dim its senders shard, `rl_sync.planning.parts`)."""

    dim: int
    block: int = 0
    grid: int = 0
    shift: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool) or self.dim < 0:
            raise ValueError(
                f"Shard dim must be a non-negative int, got {self.dim!r}; "
                "normalise negative dims against the tensor's rank first"
            )
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 0:
            raise ValueError(f"Shard block must be a non-negative int (0: torch.chunk sizes), got {self.block!r}")
        if (
            not isinstance(self.grid, int)
            or isinstance(self.grid, bool)
            or self.grid < 0
            or (self.grid and not self.block)
        ):
            raise ValueError(
                f"Shard grid must be a non-negative int, and needs a block size, got grid={self.grid!r} "
                f"with block={self.block!r}"
            )
        if (
            not isinstance(self.shift, int)
            or isinstance(self.shift, bool)
            or self.shift < 0
            or (self.shift and (not self.block or self.grid))
        ):
            raise ValueError(
                f"Shard shift must be a non-negative int, and needs a block size and no grid, got "
                f"shift={self.shift!r} with block={self.block!r}, grid={self.grid!r}"
            )

    def __str__(self) -> str:
        if self.grid:
            return f"S({self.dim}, grid={self.grid}/{self.block})"
        if self.shift:
            return f"S({self.dim}, block={self.block}, shift={self.shift})"
        return f"S({self.dim})" if not self.block else f"S({self.dim}, block={self.block})"

    def piece(self, length: int, parts: int, index: int) -> tuple[int, int]:
        """`(start, size)` of position `index` of `parts` along a dim of `length`."""
        if self.grid:
            start, size = chunk_at(self.grid, parts, index)
            first, end = -(-start // self.block), -(-(start + size) // self.block)
            return min(first, length), max(0, min(end, length) - min(first, length))
        if self.block:
            return block_at(length, self.block, index, self.shift)
        return chunk_at(length, parts, index)


@dataclass(frozen=True)
class Replicate:
    """Every rank along this mesh axis holds the same data."""

    def __str__(self) -> str:
        return "R"


Placement = Shard | Replicate


@dataclass(frozen=True)
class Box:
    """A rectangular region of a global tensor: `offsets` and `sizes` per dim."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.sizes))

    def is_empty(self) -> bool:
        return any(s == 0 for s in self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common region of two boxes, or `None` when it is empty."""
        offsets, sizes = [], []
        for a0, a1, b0, b1 in zip(self.offsets, self.ends, other.offsets, other.ends):
            lo, hi = max(a0, b0), min(a1, b1)
            if hi <= lo:
                return None
            offsets.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offsets), tuple(sizes))

    def minus(self, other: Box) -> list[Box]:
        """Disjoint boxes covering `self` outside `other` (at most 2 per dim)."""
        if self.intersect(other) is None:
            return [] if self.is_empty() else [self]
        pieces: list[Box] = []
        offsets, sizes = list(self.offsets), list(self.sizes)
        for dim, (b0, b1) in enumerate(zip(other.offsets, other.ends)):
            lo, hi = offsets[dim], offsets[dim] + sizes[dim]
            for start, stop in ((lo, max(lo, b0)), (min(hi, b1), hi)):
                if stop > start:
                    cut_off, cut_sz = list(offsets), list(sizes)
                    cut_off[dim], cut_sz[dim] = start, stop - start
                    pieces.append(Box(tuple(cut_off), tuple(cut_sz)))
            offsets[dim], sizes[dim] = max(lo, b0), min(hi, b1) - max(lo, b0)
        return pieces

    def split_rows(self, parts: int) -> list[Box]:
        """Split along the first dim of size > 1 into at most `parts` chunks."""
        dim = next((d for d, s in enumerate(self.sizes) if s > 1), None)
        if dim is None or parts <= 1:
            return [self]
        return [
            Box(
                self.offsets[:dim] + (self.offsets[dim] + start,) + self.offsets[dim + 1 :],
                self.sizes[:dim] + (size,) + self.sizes[dim + 1 :],
            )
            for start, size in chunk_bounds(self.sizes[dim], parts)
            if size > 0
        ]

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(self.offsets, self.sizes)) + "]"


def chunk_at(length: int, parts: int, index: int) -> tuple[int, int]:
    """`(start, size)` of piece `index` of `torch.chunk(length, parts)` (maybe empty)."""
    chunk = -(-length // parts)
    start = min(length, chunk * index)
    return start, max(0, min(length, start + chunk) - start)


def block_at(length: int, block: int, index: int, shift: int = 0) -> tuple[int, int]:
    """`(start, size)` of fixed-size block `index` of `length`, blocks starting `shift` elements
    before the dim (clipped, maybe empty)."""
    start = min(length, max(0, block * index - shift))
    return start, max(0, min(length, block * (index + 1) - shift) - start)


def chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """`(start, size)` of each of `parts` `torch.chunk` pieces of `length`."""
    return [chunk_at(length, parts, index) for index in range(parts)]


MAX_MESH_RANKS = 1 << 20
"""Bound on a mesh's size and on rank numbers (a million ranks)."""


class Mesh:
    """An N-D grid of ranks, row-major.

    `Mesh((2, 4), start_rank=8)` covers ranks 8..15; `Mesh.from_ranks([[0, 2],
    [1, 3]])` takes an explicit array (DeviceMesh-style), for pipeline stages
    and expert groups whose ranks are not contiguous.
    """

    __slots__ = ("_hash", "_index", "ranks", "shape")
    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    _index: dict[int, int] | None
    _hash: int

    def __init__(self, shape: Sequence[int], start_rank: int = 0, *, ranks: Sequence[int] | None = None):
        shape = tuple(shape)
        if not shape or any(not isinstance(s, int) or isinstance(s, bool) or s <= 0 for s in shape):
            raise ValueError(f"mesh shape must be non-empty positive ints, got {shape!r}")
        size = math.prod(shape)
        if size > MAX_MESH_RANKS:
            raise ValueError(f"mesh shape {shape} holds {size} ranks, more than the {MAX_MESH_RANKS} a mesh may hold")
        if ranks is None:
            if not isinstance(start_rank, int) or start_rank < 0:
                raise ValueError(f"mesh start_rank must be a non-negative int, got {start_rank!r}")
            ranks = range(start_rank, start_rank + size)
        ranks = tuple(ranks)
        if len(ranks) != size:
            raise ValueError(f"mesh shape {shape} needs {size} ranks, got {len(ranks)}")
        if any(not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < MAX_MESH_RANKS for r in ranks):
            raise ValueError(f"mesh ranks must be ints in [0, {MAX_MESH_RANKS}), got {ranks!r:.200}")
        if len(set(ranks)) != size:
            raise ValueError(f"mesh ranks must be distinct, got {ranks!r}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "ranks", ranks)
        object.__setattr__(self, "_index", None)
        object.__setattr__(self, "_hash", hash((shape, ranks)))

    @classmethod
    def from_ranks(cls, array: Any) -> Mesh:
        """Build from a nested list (or anything with `.tolist()`) of ranks."""
        nested = array.tolist() if hasattr(array, "tolist") else array
        shape = _nested_shape(nested)
        flat: list[int] = []
        _flatten(nested, flat)
        return cls(shape, ranks=flat)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Mesh is immutable")

    def __reduce__(self) -> tuple:
        return (_mesh, (self.shape, self.ranks))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.shape == other.shape and self.ranks == other.ranks

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        if self.ranks == tuple(range(self.ranks[0], self.ranks[0] + self.size)):
            return f"Mesh({self.shape}, start_rank={self.ranks[0]})"
        return f"Mesh({self.shape}, ranks={list(self.ranks)})"

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def index_of(self, rank: int) -> int | None:
        """Row-major position of `rank` in this mesh, or `None`."""
        index = self._index
        if index is None:
            index = {r: i for i, r in enumerate(self.ranks)}
            object.__setattr__(self, "_index", index)
        return index.get(rank)

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        """Mesh coordinate of `rank`, or `None` when it is not in the mesh."""
        index = self.index_of(rank)
        if index is None:
            return None
        coord = []
        for extent in reversed(self.shape):
            coord.append(index % extent)
            index //= extent
        return tuple(reversed(coord))


def _mesh(shape: tuple[int, ...], ranks: tuple[int, ...]) -> Mesh:
    return Mesh(shape, ranks=ranks)


def _nested_shape(nested: Any) -> tuple[int, ...]:
    if isinstance(nested, int):
        return ()
    if not isinstance(nested, (list, tuple)) or not nested:
        raise ValueError(f"mesh rank array must be a non-empty nested list of ints, got {nested!r}")
    return (len(nested),) + _nested_shape(nested[0])


def _flatten(nested: Any, out: list[int]) -> None:
    if isinstance(nested, (list, tuple)):
        for item in nested:
            _flatten(item, out)
    else:
        out.append(nested)


@dataclass(frozen=True)
class Layout:
    """A mesh plus one placement per mesh axis."""

    mesh: Mesh
    placements: tuple[Placement, ...]
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "placements", tuple(self.placements))
        object.__setattr__(self, "_hash", hash((self.mesh, self.placements)))
        if len(self.placements) != self.mesh.ndim:
            raise ValueError(
                f"layout needs one placement per mesh axis: mesh {self.mesh.shape} has "
                f"{self.mesh.ndim} axes, got {len(self.placements)} placements"
            )
        for placement in self.placements:
            if not isinstance(placement, (Shard, Replicate)):
                raise TypeError(f"placements must be Shard or Replicate, got {placement!r}")

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{self.mesh!r}[{', '.join(map(str, self.placements))}]"

    @classmethod
    def replicated(cls, mesh: Mesh) -> Layout:
        return cls(mesh, (Replicate(),) * mesh.ndim)

    def remapped(self, ranks: Sequence[int] | Mapping[int, int]) -> Layout:
        """The same layout with mesh rank `r` renamed `ranks[r]` (side ranks to group ranks, or with
        a mapping group ranks back to side ranks)."""
        try:
            new = tuple(ranks[r] for r in self.mesh.ranks)
        except (IndexError, KeyError):
            raise ValueError(f"layout {self} names a rank outside the {len(ranks)} ranks of its side") from None
        return Layout(Mesh(self.mesh.shape, ranks=new), self.placements)

    def check_shape(self, shape: Sequence[int], what: str = "tensor") -> None:
        """Raise `ValueError` if a placement shards a dim the tensor lacks, a blocked shard does
        not cover its dim, a grid shard's dim is not the block count of its length, or either
        shares its dim with another axis."""
        for axis, placement in enumerate(self.placements):
            if not isinstance(placement, Shard):
                continue
            if placement.dim >= len(shape):
                raise ValueError(
                    f"{what}: Shard({placement.dim}) on mesh axis {axis} is past the "
                    f"tensor's rank {len(shape)} (shape {tuple(shape)}); expected a dim "
                    f"in [0, {len(shape)})"
                )
            sharing = [p for p in self.placements if isinstance(p, Shard) and p.dim == placement.dim]
            if placement.grid and (len(sharing) > 1 or -(-placement.grid // placement.block) != shape[placement.dim]):
                raise ValueError(
                    f"{what}: {placement} on mesh axis {axis} must be the only axis sharding dim {placement.dim}, "
                    f"whose size {shape[placement.dim]} must be the {-(-placement.grid // placement.block)} blocks "
                    f"of {placement.block} in {placement.grid}"
                )
            if (
                placement.block
                and not placement.grid
                and (
                    len(sharing) > 1 or placement.block * self.mesh.shape[axis] - placement.shift < shape[placement.dim]
                )
            ):
                raise ValueError(
                    f"{what}: {placement} on mesh axis {axis} must be the only axis sharding dim "
                    f"{placement.dim} and cover its {shape[placement.dim]} rows (block x axis size - shift >= size)"
                )

    def local_box(self, shape: Sequence[int], rank: int) -> Box | None:
        """The global box `rank` holds (DTensor semantics), `None` outside the mesh."""
        coord = self.mesh.coordinate(rank)
        if coord is None:
            return None
        return self.box_at(tuple(shape), coord)

    def box_at(self, shape: tuple[int, ...], coord: tuple[int, ...]) -> Box:
        """The global box held at mesh coordinate `coord`."""
        self.check_shape(shape)
        offsets, sizes = [0] * len(shape), list(shape)
        for axis, placement in enumerate(self.placements):
            if isinstance(placement, Replicate):
                continue
            dim = placement.dim
            start, size = placement.piece(sizes[dim], self.mesh.shape[axis], coord[axis])
            sizes[dim] = size
            offsets[dim] = offsets[dim] + start if size else shape[dim]
        return Box(tuple(offsets), tuple(sizes))

    def all_boxes(self, shape: Sequence[int]) -> list[Box]:
        """The box of every mesh position, in row-major order."""
        shape = tuple(shape)
        return [self.box_at(shape, coord) for coord in _coords(self.mesh.shape)]

    @classmethod
    def from_dtensor(cls, tensor: Any, start_rank: int = 0) -> Layout:
        """Read a DTensor's mesh shape and placements.

        The mesh ranks are the DTensor mesh's own ranks shifted by `start_rank`
        (its position in the rl-sync collective group). Partial and strided
        sharding cannot be expressed and are refused.
        """
        spec = getattr(tensor, "_spec", None)
        if spec is None:
            raise TypeError(f"expected a DTensor, got {type(tensor).__name__}")
        mesh_ranks = spec.mesh.mesh.tolist()
        placements = tuple(_placement_from_torch(p, tensor.ndim) for p in spec.placements)
        nested = _shift(mesh_ranks, start_rank)
        return cls(Mesh.from_ranks(nested), placements)


def _placement_from_torch(placement: Any, ndim: int) -> Placement:
    kind = type(placement).__name__
    if kind == "Replicate":
        return Replicate()
    if kind == "Shard":
        return Shard(placement.dim % ndim if ndim else placement.dim)
    raise ValueError(
        f"cannot express DTensor placement {placement!r} ({kind}); rl-sync layouts take "
        "Shard(dim) and Replicate() only: redistribute Partial and strided-shard "
        "tensors to Shard/Replicate first"
    )


def _shift(nested: Any, offset: int) -> Any:
    if isinstance(nested, list):
        return [_shift(item, offset) for item in nested]
    return nested + offset


def _coords(shape: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    if not shape:
        yield ()
        return
    for head in range(shape[0]):
        for tail in _coords(shape[1:]):
            yield (head,) + tail
