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

from .layout import Layout, Shard

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


def sharded_dims(layout: Layout) -> set[int]:
    return {p.dim for p in layout.placements if isinstance(p, Shard)}


def part_shape(shape: Sequence[int], dim: int, start: int, stop: int) -> tuple[int, ...]:
    return tuple(stop - start if d == dim else n for d, n in enumerate(shape))


def check_parts(base: str, shape: Sequence[int], layout: Layout, parts: Iterable[tuple[int, int, int]]) -> None:
    """`ValueError` unless `parts` tile `base` along one dim the source layout does not shard."""
    parts = sorted(set(parts), key=lambda p: p[1])
    dims = {dim for dim, _, _ in parts}
    if len(dims) != 1:
        raise ValueError(f"tensor {base!r}: workers cut it along several dims {sorted(dims)}; expected one")
    dim = dims.pop()
    if not 0 <= dim < len(shape):
        raise ValueError(f"tensor {base!r}: cut along dim {dim}, past its shape {tuple(shape)}")
    if dim in sharded_dims(layout):
        raise ValueError(
            f"tensor {base!r}: workers cut it along dim {dim}, which the trainers shard ({layout}); "
            "send it from a layout that keeps that dim whole"
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
