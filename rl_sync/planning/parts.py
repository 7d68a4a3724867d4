"""Parts: a checkpoint tensor planned as slices along one dim.

An engine may keep a fused checkpoint tensor in pieces no single box per
rank describes: transformers 5 stores MoE experts as one `(E, 2I, H)`
gate|up tensor, and a tensor-parallel vLLM rank keeps rows `[r*I/tp, ...)` of
the gate half and the same rows of the up half. Cut along dim 1 at `I`, each
part is one box per rank again. A worker then binds the parts (named
`part_name(base, dim, start, stop)`) instead of the whole tensor; the
coordinator plans each part with the trainers' layout of the whole (which must
not shard the cut dim), and trainers send each part from a view of their
shard. Nothing else changes: parts are ordinary tensors of the plan.

Typical use::

    name = part_name("model.layers.0.mlp.experts.gate_up_proj", 1, 0, 64)
    parse_part(name)            # ("model.layers.0.mlp.experts.gate_up_proj", 1, 0, 64)
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .layout import Layout, Shard, chunk_at

_PART = re.compile(r"(?P<base>.+)@(?P<dim>\d+):(?P<start>\d+):(?P<stop>\d+)")


def part_name(base: str, dim: int, start: int, stop: int) -> str:
    """The plan name of rows `[start, stop)` along `dim` of checkpoint tensor `base`."""
    return f"{base}@{dim}:{start}:{stop}"


def parse_part(name: str) -> tuple[str, int, int, int] | None:
    """`(base, dim, start, stop)` of a part name, or None for a whole tensor."""
    found = _PART.fullmatch(name)
    if found is None:
        return None
    return found["base"], int(found["dim"]), int(found["start"]), int(found["stop"])


def _shards(layout: Layout) -> list[tuple[int, Shard]]:
    return [(axis, p) for axis, p in enumerate(layout.placements) if isinstance(p, Shard)]


def uncuttable_dims(layout: Layout) -> set[int]:
    """Dims no part may be cut along: one several mesh axes shard, or a scale grid."""
    dims = [p.dim for _, p in _shards(layout)]
    return {p.dim for _, p in _shards(layout) if p.grid or dims.count(p.dim) > 1}


def part_layout(layout: Layout, shape: Sequence[int], dim: int, start: int, stop: int) -> Layout:
    """The layout of part `[start, stop)` along `dim` of a tensor of `shape` laid out as `layout`:
    the same where `dim` is whole; the mesh axis sharding `dim` in shifted blocks otherwise."""
    placements = []
    for axis, p in enumerate(layout.placements):
        if isinstance(p, Shard) and p.dim == dim:
            if dim in uncuttable_dims(layout):
                raise ValueError(f"layout {layout} shards dim {dim} in a way no part can be cut from")
            p = Shard(dim, p.block or chunk_at(shape[dim], layout.mesh.shape[axis], 0)[1], 0, p.shift + start)
        placements.append(p)
    return Layout(layout.mesh, tuple(placements))


def part_shape(shape: Sequence[int], dim: int, start: int, stop: int) -> tuple[int, ...]:
    return tuple(stop - start if d == dim else n for d, n in enumerate(shape))


def check_parts(base: str, shape: Sequence[int], layout: Layout, parts: Iterable[tuple[int, int, int]]) -> None:
    """`ValueError` unless `parts` tile `base` along one dim the source layout can be cut along."""
    parts = sorted(set(parts), key=lambda p: p[1])
    dims = {dim for dim, _, _ in parts}
    if len(dims) != 1:
        raise ValueError(f"tensor {base!r}: workers cut it along several dims {sorted(dims)}; expected one")
    dim = dims.pop()
    if not 0 <= dim < len(shape):
        raise ValueError(f"tensor {base!r}: cut along dim {dim}, past its shape {tuple(shape)}")
    if dim in uncuttable_dims(layout):
        raise ValueError(
            f"tensor {base!r}: workers cut it along dim {dim}, which the trainers shard over several mesh "
            f"axes or as a scale grid ({layout}); send it from a layout that shards that dim over one axis"
        )
    cursor = 0
    for _, start, stop in parts:
        if start != cursor or stop <= start:
            raise ValueError(
                f"tensor {base!r}: parts {[p[1:] for p in parts]} along dim {dim} do not tile [0, {shape[dim]})"
            )
        cursor = stop
    if cursor != shape[dim]:
        raise ValueError(f"tensor {base!r}: parts along dim {dim} end at {cursor}, the tensor at {shape[dim]}")
