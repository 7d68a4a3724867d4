"""The reshard planner: which rank sends which box of which tensor to which rank.

`plan_reshard` plans one tensor; `plan_model` plans a whole model, grouping
tensors that share a template (`template.py`) so that a 1T-parameter MoE with
tens of thousands of tensors plans in about a second, and reports statistics.

Typical use::

    src = Layout(Mesh((4,)), (Shard(0),))                  # FSDP over ranks 0..3
    dst = Layout(Mesh((2, 2), start_rank=4), (Replicate(), Shard(1)))
    plan = plan_reshard((4096, 4096), src, dst)
    for t in plan.transfers:                               # Transfer(src_rank, dst_rank, offsets, sizes)
        ...

Guarantees (tested property-based): every element of every destination box is
delivered exactly once, by a source rank that holds it; a rank in both meshes
(colocated plans only) is sent nothing it already holds and copies that part
locally instead (`local_copies`); the result is a pure function of the inputs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np

from ..wire.dtypes import CASTABLE, check_cast, itemsize
from .layout import Box, Layout
from .parts import parse_part
from .quant import FP8_DTYPE, SCALE_DTYPE, check_block, dest_scale_layout, grid_shape, scale_name, source_scale_layout
from .template import Template, TemplateKey, build_template, mesh_overlap, sum_by, template_key


@dataclass(frozen=True)
class Transfer:
    """One box of one tensor moved from `src_rank` to `dst_rank` (global coords)."""

    src_rank: int
    dst_rank: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.sizes)

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def _shape_as_tuple(spec) -> None:
    if isinstance(spec.shape, list):
        object.__setattr__(spec, "shape", tuple(spec.shape))


@dataclass(frozen=True)
class SideSpec:
    """What one side reports for a tensor: name, dtype name, global shape, layout, and (a
    destination keeping it block-quantized, `rl_sync.planning.quant`) the quantization block."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: Layout
    block: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _shape_as_tuple(self)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to plan: its name, dtype name (the wire's), global shape and both layouts;
    `block`: the trainers quantize it to FP8 in blocks of this size (`rl_sync.planning.quant`)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    block: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _shape_as_tuple(self)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclass(frozen=True)
class TensorPlan:
    """Every transfer of one tensor, plus local copies on ranks in both meshes."""

    shape: tuple[int, ...]
    src: Layout
    dst: Layout
    transfers: tuple[Transfer, ...]
    local_copies: tuple[Transfer, ...]


MAX_NUMEL = 1 << 48
"""Bound on a tensor's elements and on each of its dims: far above any model's tensor, and low
enough that byte counts and offsets never overflow int64."""


def _check_shape(shape: Sequence[int], what: str) -> tuple[int, ...]:
    if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s >= 0 for s in shape):
        raise ValueError(f"{what}: shape must be a sequence of non-negative ints, got {shape!r}")
    if any(s > MAX_NUMEL for s in shape) or math.prod(shape) > MAX_NUMEL:
        raise ValueError(f"{what}: shape {tuple(shape)} holds more than 2**48 elements (in all or in one dim)")
    return tuple(shape)


def _check_layouts(what: str, shape: tuple[int, ...], src: Layout, dst: Layout, colocated: bool) -> None:
    for side, layout in (("source", src), ("destination", dst)):
        if not isinstance(layout, Layout):
            raise TypeError(f"{what}: {side} layout must be a Layout, got {type(layout).__name__}")
        layout.check_shape(shape, f"{what} {side} layout")
    if not colocated:
        shared = sorted(src.mesh.ranks[s] for s, _ in mesh_overlap(src.mesh, dst.mesh))
        if shared:
            raise ValueError(
                f"{what}: source mesh {src.mesh!r} and destination mesh {dst.mesh!r} "
                f"overlap at ranks {shared[:8]}; trainer and worker ranks must be "
                "disjoint, or pass colocated=True for a rank that holds both sides"
            )


def _tensor_plan(shape, src: Layout, dst: Layout, template: Template) -> TensorPlan:
    def expand(src_pos, dst_pos, offsets, sizes) -> tuple[Transfer, ...]:
        return tuple(
            Transfer(src.mesh.ranks[s], dst.mesh.ranks[d], tuple(o), tuple(z))
            for s, d, o, z in zip(src_pos.tolist(), dst_pos.tolist(), offsets.tolist(), sizes.tolist())
        )

    t = template
    return TensorPlan(
        shape,
        src,
        dst,
        expand(t.src, t.dst, t.offsets, t.sizes),
        expand(t.local_src, t.local_dst, t.local_offsets, t.local_sizes),
    )


@lru_cache(maxsize=1024)
def _plan_reshard(shape: tuple[int, ...], src: Layout, dst: Layout) -> TensorPlan:
    return _tensor_plan(shape, src, dst, build_template(template_key(shape, src, dst)))


def plan_reshard(shape: Sequence[int], src: Layout, dst: Layout, *, colocated: bool = False) -> TensorPlan:
    """Plan one tensor of global `shape` from layout `src` to layout `dst`.

    Meshes must not share ranks unless `colocated=True`, in which case a rank
    in both copies its own overlap locally (`local_copies`) instead of being
    sent it.
    """
    shape = _check_shape(shape, "plan_reshard")
    _check_layouts("plan_reshard", shape, src, dst, colocated)
    return _plan_reshard(shape, src, dst)


def join_specs(sources: Sequence[SideSpec], destinations: Sequence[SideSpec]) -> list[TensorSpec]:
    """Pair what trainers and workers reported, in source order.

    The wire carries the destination's dtype: a floating-point source of another
    width is cast on the sending side (`rl_sync.wire.dtypes.check_cast`), and a destination
    that keeps a tensor block-quantized gets it as FP8 plus its scale grid, planned as a
    second tensor (`rl_sync.planning.quant`). Raises `ValueError` for duplicate names, a name on
    one side only, a shape on which the sides disagree, or a dtype pair that is neither.
    """
    dst_by_name: dict[str, SideSpec] = {}
    for spec in destinations:
        if spec.name in dst_by_name:
            raise ValueError(f"tensor {spec.name!r}: declared twice by the destination")
        dst_by_name[spec.name] = spec
    joined, seen = [], set()
    for spec in sources:
        if spec.name in seen:
            raise ValueError(f"tensor {spec.name!r}: declared twice by the source")
        seen.add(spec.name)
        other = dst_by_name.get(spec.name)
        if other is None:
            raise ValueError(f"tensor {spec.name!r}: the source declares it but no destination binds it")
        if tuple(spec.shape) != tuple(other.shape):
            raise ValueError(
                f"tensor {spec.name!r}: source shape {tuple(spec.shape)!r} and destination shape "
                f"{tuple(other.shape)!r} disagree"
            )
        if other.block:
            joined.extend(quantized_specs(spec, other, dst_by_name.get(scale_name(spec.name))))
            seen.add(scale_name(spec.name))
            continue
        check_cast(spec.name, spec.dtype, other.dtype)
        joined.append(TensorSpec(spec.name, other.dtype, tuple(spec.shape), spec.layout, other.layout))
    extra = sorted(set(dst_by_name) - seen)
    if extra:
        raise ValueError(f"tensors {extra[:8]}: bound by the destination but the source does not declare them")
    return joined


def quantized_specs(src: SideSpec, dst: SideSpec, scales: SideSpec | None) -> list[TensorSpec]:
    """The FP8 values and the scale grid of a tensor a destination keeps block-quantized."""
    what, shape = f"tensor {src.name!r}", tuple(src.shape)
    block = check_block(tuple(dst.block), what)
    if parse_part(src.name) is not None:
        raise ValueError(
            f"{what}: the destination binds a part of a tensor block-quantized; FP8 destinations "
            "take whole checkpoint tensors"
        )
    if src.dtype not in CASTABLE:
        raise ValueError(
            f"{what}: the destination keeps it as block-quantized {FP8_DTYPE}, which needs a "
            f"floating-point source ({', '.join(sorted(CASTABLE))}); the trainers hold {src.dtype}"
        )
    if dst.dtype != FP8_DTYPE:
        raise ValueError(f"{what}: a block-quantized destination must be {FP8_DTYPE}, got {dst.dtype}")
    grid = grid_shape(shape, block, what)
    if scales is None or tuple(scales.shape) != grid or scales.dtype != SCALE_DTYPE:
        seen = "nothing" if scales is None else f"{scales.dtype} {tuple(scales.shape)}"
        raise ValueError(
            f"{what}: the destination keeps it block-quantized in {block} blocks, so it must bind "
            f"{scale_name(src.name)!r} as {SCALE_DTYPE} {grid}; it binds {seen}"
        )
    expected = dest_scale_layout(dst.layout, shape, block, what)
    if scales.layout != expected:
        raise ValueError(
            f"{what}: the destination lays its scales out as {scales.layout}; its values' layout "
            f"{dst.layout} gives {expected}"
        )
    return [
        TensorSpec(src.name, FP8_DTYPE, shape, src.layout, dst.layout, block),
        TensorSpec(scales.name, SCALE_DTYPE, grid, source_scale_layout(src.layout, shape, block, what), expected),
    ]


@dataclass(frozen=True)
class PlanStats:
    """What a model plan moves, per rank and in total (bytes)."""

    num_tensors: int
    num_templates: int
    num_transfers: int
    total_bytes: int
    local_copy_bytes: int
    send_bytes: dict[int, int]
    recv_bytes: dict[int, int]
    send_counts: dict[int, int]
    recv_counts: dict[int, int]
    busiest_source_bytes: int
    busiest_source_lower_bound: int
    broadcast_bytes: int
    """Broadcast baseline: every full tensor from one rank to every worker."""
    broadcast_recv_bytes: int
    """What each worker receives under broadcast (the whole model)."""

    @property
    def busiest_over_bound(self) -> float:
        return self.busiest_source_bytes / max(1, self.busiest_source_lower_bound)


class ModelPlan:
    """The plan of a whole model: one template per distinct key, shared by tensors.

    `tensor_plan(i)` materialises one tensor's transfers in global ranks;
    `stats` totals everything without materialising a transfer.
    """

    def __init__(self, specs: Sequence[TensorSpec], colocated: bool = False):
        self.specs = tuple(specs)
        self.colocated = colocated
        self.index = _validate_specs(self.specs, colocated)
        meshes: dict = {}
        self.mesh_ids = {
            side: np.array([meshes.setdefault(getattr(s, side).mesh, len(meshes)) for s in self.specs], dtype=np.int64)
            for side in ("src", "dst")
        }
        self._mesh_ranks = [np.array(mesh.ranks, dtype=np.int64) for mesh in meshes]
        keys: dict[TemplateKey, int] = {}
        self.tensor_template = np.array(
            [keys.setdefault(template_key(s.shape, s.src, s.dst), len(keys)) for s in self.specs], dtype=np.int64
        )
        self.templates: tuple[Template, ...] = tuple(build_template(key) for key in keys)
        self.itemsizes = np.array([itemsize(s.dtype) for s in self.specs], dtype=np.int64)
        self.blocks = {i: (s.block[0], s.block[1]) for i, s in enumerate(self.specs) if s.block}
        """Tensors the trainers quantize, by index: their quantization block."""

    def __len__(self) -> int:
        return len(self.specs)

    def tensor_plan(self, i: int) -> TensorPlan:
        spec = self.specs[i]
        return _tensor_plan(spec.shape, spec.src, spec.dst, self.templates[self.tensor_template[i]])

    def groups(self) -> list[tuple[Template, np.ndarray]]:
        """(template, indices of the tensors that use it), in template order."""
        order = np.argsort(self.tensor_template, kind="stable")
        bounds = np.searchsorted(self.tensor_template[order], np.arange(len(self.templates) + 1))
        return [(t, order[bounds[i] : bounds[i + 1]]) for i, t in enumerate(self.templates)]

    def rank_table(self, tensors: np.ndarray, side: str) -> np.ndarray:
        """`(len(tensors), mesh size)` global ranks of each tensor's `side` mesh.

        The tensors must share a template (so their meshes have one size)."""
        unique, inverse = np.unique(self.mesh_ids[side][tensors], return_inverse=True)
        return np.stack([self._mesh_ranks[m] for m in unique.tolist()])[inverse]

    @cached_property
    def stats(self) -> PlanStats:
        return _model_stats(self)


def _validate_specs(specs: tuple[TensorSpec, ...], colocated: bool) -> dict[str, int]:
    index: dict[str, int] = {}
    checked: set[tuple] = set()
    for i, spec in enumerate(specs):
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"plan_model expects TensorSpec entries, got {type(spec).__name__} at {i}")
        what = f"tensor {spec.name!r}"
        if spec.name in index:
            raise ValueError(f"{what}: duplicate tensor name (also at position {index[spec.name]})")
        index[spec.name] = i
        itemsize(spec.dtype, what)
        layouts = (_check_shape(spec.shape, what), spec.src, spec.dst)
        if layouts not in checked:
            _check_layouts(what, *layouts, colocated)
            checked.add(layouts)
    return index


def plan_model(specs: Sequence[TensorSpec], *, colocated: bool = False) -> ModelPlan:
    """Plan every tensor of a model; each tensor may use its own (sub-)meshes."""
    return ModelPlan(specs, colocated)


def _per_rank(totals: dict[int, int], ranks: np.ndarray, amounts: np.ndarray) -> None:
    """Add `amounts` (broadcast to `ranks`' shape) into `totals[rank]`."""
    flat_ranks = ranks.ravel()
    flat = np.broadcast_to(amounts, ranks.shape).ravel()
    keep = flat != 0
    if not keep.any():
        return
    acc = np.zeros(int(flat_ranks.max()) + 1, dtype=np.int64)
    np.add.at(acc, flat_ranks[keep], flat[keep])
    for rank in np.nonzero(acc)[0].tolist():
        totals[rank] = totals.get(rank, 0) + int(acc[rank])


def _model_stats(plan: ModelPlan) -> PlanStats:
    send: dict[int, int] = {}
    recv: dict[int, int] = {}
    send_n: dict[int, int] = {}
    recv_n: dict[int, int] = {}
    forced: dict[int, int] = {}
    local_bytes = transfers = 0
    sources: set[int] = set()
    workers: set[int] = set()
    for template, tensors in plan.groups():
        sizes = plan.itemsizes[tensors][:, None]
        src_ranks, dst_ranks = plan.rank_table(tensors, "src"), plan.rank_table(tensors, "dst")
        sources.update(np.unique(src_ranks).tolist())
        workers.update(np.unique(dst_ranks).tolist())
        _per_rank(send, src_ranks, template.send_numel[None, :] * sizes)
        _per_rank(recv, dst_ranks, template.recv_numel[None, :] * sizes)
        _per_rank(forced, src_ranks, template.forced_numel[None, :] * sizes)
        _per_rank(send_n, src_ranks, sum_by(template.src, np.ones_like(template.src), src_ranks.shape[1]))
        _per_rank(recv_n, dst_ranks, sum_by(template.dst, np.ones_like(template.dst), dst_ranks.shape[1]))
        local_bytes += int(template.local_sizes.prod(axis=1).sum()) * int(sizes.sum())
        transfers += template.num_transfers * len(tensors)
    total = sum(send.values())
    model_bytes = sum(spec.nbytes for spec in plan.specs)
    bound = max([-(-total // max(1, len(sources)))] + list(forced.values()))
    return PlanStats(
        num_tensors=len(plan.specs),
        num_templates=len(plan.templates),
        num_transfers=transfers,
        total_bytes=total,
        local_copy_bytes=local_bytes,
        send_bytes=send,
        recv_bytes=recv,
        send_counts=send_n,
        recv_counts=recv_n,
        busiest_source_bytes=max(send.values(), default=0),
        busiest_source_lower_bound=bound,
        broadcast_bytes=model_bytes * len(workers),
        broadcast_recv_bytes=model_bytes,
    )
