"""The plan as the coordinator ships it: one compact message for every rank.

Why ship the plan's inputs and not per-rank slices: a model plan is a few
dozen templates shared by tens of thousands of tensors, so its inputs (names,
interned dtypes, shapes and layouts, and the bucket cuts) are O(tensors)
while its transfers are O(tensors x ranks): 4.4 million for a Kimi-K2-shaped
model from 256 to 128 ranks. Shipping per-rank slices would make the
coordinator expand all of them; shipping the inputs lets it encode once, put
one object in Ray's object store for every rank, and lets each rank rebuild
the deterministic templates and expand only its own part
(`Schedule.rank_slice`). The cuts travel because they are a whole-model
computation nobody needs to repeat. `rl-sync plan` prints this message's size.

Typical use::

    blob = encode(PlanInfo.from_schedule(schedule))        # coordinator, once
    mine = decode(PlanInfo, blob).to_schedule().rank_slice(rank)   # each rank
"""

from __future__ import annotations

from dataclasses import dataclass

from ..planning.layout import Layout, Mesh, Replicate, Shard
from ..planning.plan import ModelPlan, TensorSpec
from ..planning.schedule import Schedule


@dataclass(frozen=True)
class LayoutInfo:
    """A layout on the wire: mesh shape, flat ranks, placements (-1 = Replicate), and
    each Shard's block size (0: torch.chunk sizes), grid length (0: none) and shift."""

    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[int, ...]
    blocks: tuple[int, ...]
    grids: tuple[int, ...]
    shifts: tuple[int, ...]

    @classmethod
    def of(cls, layout: Layout) -> LayoutInfo:
        codes = tuple(p.dim if isinstance(p, Shard) else -1 for p in layout.placements)
        blocks = tuple(p.block if isinstance(p, Shard) else 0 for p in layout.placements)
        grids = tuple(p.grid if isinstance(p, Shard) else 0 for p in layout.placements)
        shifts = tuple(p.shift if isinstance(p, Shard) else 0 for p in layout.placements)
        return cls(layout.mesh.shape, layout.mesh.ranks, codes, blocks, grids, shifts)

    def to_layout(self) -> Layout:
        n = len(self.placements)
        if (
            any(code < -1 for code in self.placements)
            or not len(self.blocks) == len(self.grids) == len(self.shifts) == n
        ):
            raise ValueError(
                f"placement codes must be -1 (Replicate) or a dim >= 0, one block, grid and shift each, "
                f"got {self.placements}, {self.blocks}, {self.grids} and {self.shifts}"
            )
        placements = tuple(
            Replicate() if code == -1 else Shard(code, block, grid, shift)
            for code, block, grid, shift in zip(self.placements, self.blocks, self.grids, self.shifts)
        )
        return Layout(Mesh(self.mesh_shape, ranks=self.ranks), placements)


@dataclass(frozen=True)
class PlanInfo:
    """Everything a rank needs to rebuild the schedule (tables are interned)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    dtype_index: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    shape_index: tuple[int, ...]
    layouts: tuple[LayoutInfo, ...]
    src_index: tuple[int, ...]
    dst_index: tuple[int, ...]
    colocated: bool
    bucket_bytes: int
    coalesce_bytes: int
    cuts: tuple[int, ...]
    blocks: tuple[tuple[int, int, int], ...]
    """(tensor, block rows, block cols) of each tensor the trainers quantize (`rl_sync.planning.quant`)."""
    relay: bool = False
    """Replicated boxes relayed among engine replicas (`rl_sync.planning.relay`)."""

    def __post_init__(self) -> None:
        n = len(self.names)
        for field, table in (
            ("dtype_index", self.dtypes),
            ("shape_index", self.shapes),
            ("src_index", self.layouts),
            ("dst_index", self.layouts),
        ):
            index = getattr(self, field)
            if len(index) != n:
                raise ValueError(f"PlanInfo.{field} has {len(index)} entries for {n} tensors")
            if index and not 0 <= min(index) <= max(index) < len(table):
                raise ValueError(f"PlanInfo.{field} holds an index outside [0, {len(table)})")
        if any(len(b) != 3 or not 0 <= b[0] < n for b in self.blocks):
            raise ValueError(f"PlanInfo.blocks must be (tensor index < {n}, rows, cols) entries")

    @classmethod
    def from_schedule(cls, schedule: Schedule) -> PlanInfo:
        specs = schedule.plan.specs
        dtypes, shapes, layouts = _Interner(), _Interner(), _Interner()
        return cls(
            names=tuple(s.name for s in specs),
            dtype_index=tuple(dtypes.add(s.dtype) for s in specs),
            shape_index=tuple(shapes.add(s.shape) for s in specs),
            src_index=tuple(layouts.add(s.src) for s in specs),
            dst_index=tuple(layouts.add(s.dst) for s in specs),
            dtypes=tuple(dtypes.items),
            shapes=tuple(shapes.items),
            layouts=tuple(LayoutInfo.of(layout) for layout in layouts.items),
            colocated=schedule.plan.colocated,
            bucket_bytes=schedule.bucket_bytes,
            coalesce_bytes=schedule.coalesce_bytes,
            cuts=schedule.cuts,
            blocks=tuple((i, *block) for i, block in sorted(schedule.plan.blocks.items())),
            relay=schedule.relay is not None,
        )

    def to_schedule(self) -> Schedule:
        """Rebuild (and so re-validate) the plan and schedule this info describes."""
        layouts = [info.to_layout() for info in self.layouts]
        blocks = {i: (rows, cols) for i, rows, cols in self.blocks}
        specs = [
            TensorSpec(name, self.dtypes[d], self.shapes[s], layouts[src], layouts[dst], blocks.get(i, ()))
            for i, (name, d, s, src, dst) in enumerate(
                zip(self.names, self.dtype_index, self.shape_index, self.src_index, self.dst_index)
            )
        ]
        return Schedule(ModelPlan(specs, self.colocated), self.bucket_bytes, self.coalesce_bytes, self.cuts, self.relay)


class _Interner:
    def __init__(self) -> None:
        self.items: list = []
        self._index: dict = {}

    def add(self, item) -> int:
        if item not in self._index:
            self._index[item] = len(self.items)
            self.items.append(item)
        return self._index[item]
