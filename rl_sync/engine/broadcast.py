"""Broadcast mode: the classic baseline, behind the same API as M2N.

Trainer rank 0 gathers each full tensor from the trainers (a reshard to a
single-rank replicated layout, planned and bucketed like any other), then
broadcasts each packed bucket to every worker; each worker copies out the box
it keeps. Every worker receives the whole model; M2N exists to avoid that.

Ordering contract: all ranks walk the gather schedule's buckets in order; in
each, trainers run the gather, then rank 0 and every worker join the
broadcast of that bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..planning.layout import Box, Layout, Mesh
from ..planning.plan import ModelPlan, TensorSpec
from ..planning.schedule import ALIGN, Schedule
from ..transport.base import Transport
from .endpoint import Endpoint
from .runner import BucketIO, Counters, compile_bucket, complete_bucket, staging_need, start_bucket

ROOT = 0


class BroadcastStaging:
    """Slot 0: packed gather messages; slot 1: the broadcast bucket. Grown on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self.buffers[slot] = None
            buf = self.buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)


def gather_schedule(plan: ModelPlan, bucket_bytes: int, coalesce_bytes: int) -> Schedule:
    """Every tensor from its trainer layout to rank 0, whole."""
    root = Layout.replicated(Mesh((1,), ranks=(ROOT,)))
    specs = [TensorSpec(s.name, s.dtype, s.shape, s.src, root) for s in plan.specs]
    return Schedule(ModelPlan(specs, colocated=True), bucket_bytes, coalesce_bytes)


@dataclass(frozen=True)
class _Region:
    start: int
    lo: int
    hi: int


def _regions(schedule: Schedule, bucket: int, wanted: Collection[int] | None) -> tuple[dict[int, _Region], int]:
    """Byte layout of one broadcast bucket: each tensor's rows `[lo, hi)` packed in turn."""
    rows: dict[int, list[int]] = {}
    for tensor, band in schedule.bucket_slabs(bucket):
        if wanted is None or tensor in wanted:
            b = schedule.bands[tensor][band]
            span = rows.setdefault(tensor, [b.lo, b.hi])
            span[0], span[1] = min(span[0], b.lo), max(span[1], b.hi)
    regions, cursor = {}, 0
    for tensor, (lo, hi) in rows.items():
        regions[tensor] = _Region(cursor, lo, hi)
        shape = schedule.plan.specs[tensor].shape
        row_bytes = int(schedule.plan.itemsizes[tensor]) * (int(torch.Size(shape[1:]).numel()) if shape else 1)
        cursor = -(-(cursor + (hi - lo) * row_bytes) // ALIGN) * ALIGN
    return regions, cursor


def _region_endpoint(buf: torch.Tensor, region: _Region, shape: tuple[int, ...], dtype: torch.dtype) -> Endpoint:
    if not shape:
        return Endpoint(buf[region.start : region.start + dtype.itemsize].view(dtype).view(()), ())
    rows = (region.hi - region.lo,) + tuple(shape[1:])
    numel = int(torch.Size(rows).numel())
    view = buf[region.start : region.start + numel * dtype.itemsize].view(dtype).view(rows)
    return Endpoint(view, (region.lo,) + (0,) * (len(shape) - 1))


def _per_tensor(endpoints: Mapping[int, Endpoint]) -> Callable[[int, int], Endpoint]:
    """A `BucketIO` lookup that finds each tensor's endpoint in `endpoints`, whatever the bucket."""
    return lambda _bucket, t: endpoints[t]


def run_broadcast(
    schedule: Schedule,
    plan: ModelPlan,
    rank: int,
    sources: Mapping[int, Endpoint],
    dests: Mapping[int, Endpoint],
    dtypes: Sequence[torch.dtype],
    transport: Transport,
    staging: BroadcastStaging,
    deadline: float,
    wanted: Collection[int] | None,
) -> Counters:
    """One broadcast-mode round on `rank` (see the module docstring)."""
    counters = Counters()
    mine = {b.index: b for b in schedule.rank_slice(rank, wanted).buckets}
    is_worker = any(rank in s.dst.mesh.ranks for s in plan.specs)
    for index in range(schedule.num_buckets):
        regions, nbytes = _regions(schedule, index, wanted)
        if not regions:
            continue
        buf = staging.get(1, nbytes) if rank == ROOT or is_worker else None
        views = (
            {t: _region_endpoint(buf, r, plan.specs[t].shape, dtypes[t]) for t, r in regions.items()}
            if buf is not None
            else {}
        )
        if index in mine:
            io = BucketIO(_per_tensor(sources), _per_tensor(views), dtypes)
            ops = compile_bucket(mine[index], io, staging.get(0, staging_need(mine[index], io)))
            ops.label = f"gather bucket {index}"
            start_bucket(ops, transport)
            complete_bucket(ops, deadline)
            transport.complete(deadline)
            counters.add(ops.counters)
        if buf is not None:  # the root and the workers
            transport.broadcast(buf[:nbytes], ROOT, deadline)
            counters.buckets += index not in mine
        if is_worker:
            counters.received_bytes += nbytes
            _unpack(plan, rank, regions, views, dests)
        elif rank == ROOT:
            counters.sent_bytes += nbytes
    transport.finish(deadline)  # the gathers' digests, checked once
    return counters


def _unpack(plan: ModelPlan, rank: int, regions, views, dests: Mapping[int, Endpoint]) -> None:
    for tensor, region in regions.items():
        spec = plan.specs[tensor]
        box = spec.dst.local_box(spec.shape, rank)
        if box is None or tensor not in dests:
            continue
        rows = Box((region.lo,) + (0,) * (len(spec.shape) - 1), (region.hi - region.lo,) + spec.shape[1:])
        band = box.intersect(rows) if spec.shape else box
        if band is not None:
            dests[tensor].view(band.offsets, band.sizes).copy_(views[tensor].view(band.offsets, band.sizes))
