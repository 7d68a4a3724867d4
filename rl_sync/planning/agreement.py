"""Init-time checks on what ranks report (workers agree, trainers are consistent) and the
group's schedule planned from those reports.

Typical use (inside a coordinator, or the trainer that leads a group without Ray)::

    sources = merge_sources(trainer_reports)
    checkpoint, sharded = checkpoint_of(sources)          # what workers bind against
    schedule = plan_group(sources, worker_reports, worker_ranks, len(trainer_reports), config)
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import cast

from ..config.sync import Integrity, SyncConfig
from ..wire.messages import InitInfo, RankReport, TensorReport, WriteMode
from ..wire.stats import SyncSummary
from .parts import check_parts, parse_part, part_layout, part_name, part_shape, uncuttable_dims
from .plan import SideSpec, join_specs, plan_model
from .schedule import Schedule, build_schedule


def _describe(t: TensorReport) -> str:
    return f"dtype {t.dtype}, shape {t.shape}, layout {t.layout.to_layout()}"


def check_agreement(workers: Sequence[RankReport], ranks: Sequence[int]) -> None:
    """Every worker must resolve the same (name, dtype, shape, layout) list as worker 0.

    Raises `ValueError` naming the first worker and tensor that differ.
    """
    first = workers[0].tensors
    by_name = {t.name: t for t in first}
    for report in workers[1:]:
        mine = {t.name: t for t in report.tensors}
        rank = ranks[report.rank]
        for name in list(by_name) + [n for n in mine if n not in by_name]:
            a, b = by_name.get(name), mine.get(name)
            if a != b:
                theirs = "does not bind it" if b is None else f"resolved {_describe(b)}"
                ours = "does not bind it" if a is None else f"resolved {_describe(a)}"
                raise ValueError(
                    f"inference workers disagree on tensor {name!r}: worker rank {rank} {theirs}, but worker rank "
                    f"{ranks[workers[0].rank]} {ours}; all workers must run the same model and parallel config"
                )


def merge_sources(trainers: Sequence[RankReport]) -> list[SideSpec]:
    """Union of the trainers' tensors in first-seen order; conflicting reports are refused."""
    seen: dict[str, tuple[TensorReport, int]] = {}
    for report in trainers:
        for t in report.tensors:
            if max(t.layout.ranks) >= len(trainers):
                raise ValueError(
                    f"trainer rank {report.rank}: tensor {t.name!r} is laid out over ranks "
                    f"{list(t.layout.ranks)[:8]}, past the {len(trainers)} trainers passed to WeightSync"
                )
            if t.name in seen and seen[t.name][0] != t:
                first, rank = seen[t.name]
                raise ValueError(
                    f"trainers disagree on tensor {t.name!r}: rank {report.rank} reports {_describe(t)}, rank {rank} "
                    f"reports {_describe(first)}"
                )
            seen.setdefault(t.name, (t, report.rank))
    return [SideSpec(t.name, t.dtype, t.shape, t.layout.to_layout()) for t, _ in seen.values()]


def colocated_mates(trainers: Sequence[RankReport], workers: Sequence[RankReport]) -> list[int] | None:
    """The trainer rank sharing each worker's GPU, or None unless every worker has exactly one
    and no trainer has two."""
    if not workers or not all(w.gpu for w in workers):
        return None
    by_gpu: dict[str, list[int]] = {}
    for t in trainers:
        if t.gpu:
            by_gpu.setdefault(t.gpu, []).append(t.rank)
    mates = [by_gpu.get(w.gpu, []) for w in workers]
    if any(len(m) != 1 for m in mates):
        return None
    ranks = [m[0] for m in mates]
    return ranks if len(set(ranks)) == len(ranks) else None


def split_sources(sources: Sequence[SideSpec], worker_names: Sequence[str]) -> list[SideSpec]:
    """Sources with every tensor the workers bind in parts (`rl_sync.planning.parts`) replaced by those
    parts, each with the trainers' layout of the whole cut to it (`part_layout`); refused when the
    parts do not tile the tensor or cut a dim the trainers' layout cannot be cut along."""
    parts: dict[str, list[tuple[int, int, int]]] = {}
    for name in worker_names:
        found = parse_part(name)
        if found is not None:
            parts.setdefault(found[0], []).append(found[1:])
    out = []
    for spec in sources:
        if spec.name not in parts:
            out.append(spec)
            continue
        check_parts(spec.name, spec.shape, spec.layout, parts[spec.name])
        for dim, start, stop in sorted(parts[spec.name], key=lambda p: p[1]):
            out.append(
                SideSpec(
                    part_name(spec.name, dim, start, stop),
                    spec.dtype,
                    part_shape(spec.shape, dim, start, stop),
                    part_layout(spec.layout, spec.shape, dim, start, stop),
                )
            )
    return out


def checkpoint_of(
    sources: Sequence[SideSpec],
) -> tuple[dict[str, tuple[str, tuple[int, ...]]], dict[str, tuple[int, ...]]]:
    """What workers bind against: `{name: (dtype name, shape)}` and the dims no part of each
    tensor may be cut along, given the trainers' layout (`DescribeOptions.checkpoint` and
    `.sharded`; `rl_sync.planning.parts.uncuttable_dims`)."""
    checkpoint = {s.name: (s.dtype, tuple(s.shape)) for s in sources}
    return checkpoint, {s.name: tuple(sorted(uncuttable_dims(s.layout))) for s in sources}


def plan_group(
    sources: Sequence[SideSpec],
    workers: Sequence[RankReport],
    worker_ranks: Sequence[int],
    trainers: int,
    config: SyncConfig,
) -> Schedule:
    """The group's schedule: the workers (at group ranks `worker_ranks`, after `trainers`
    trainers) agree, sources are split into the parts workers bind, every tensor is planned
    and cut into `config`'s buckets. Bad input raises `ValueError` naming the tensor."""
    check_agreement(workers, ranks=worker_ranks)
    sources = split_sources(sources, [t.name for t in workers[0].tensors])
    destinations = [
        SideSpec(t.name, t.dtype, t.shape, t.layout.to_layout().remapped(worker_ranks), t.block)
        for t in workers[0].tensors
    ]
    plan = plan_model(join_specs(sources, destinations), colocated=any(r < trainers for r in worker_ranks))
    return build_schedule(plan, config.bucket_bytes, config.coalesce_bytes, config.relay)


def _write_modes(workers: Sequence[RankReport]) -> dict[str, WriteMode]:
    """Each name's write mode across the workers: `reload` (or `fallback`) where any worker says
    so, `direct` where all do."""
    modes: dict[str, WriteMode] = {}
    for report in workers:
        for name, mode in report.modes.items():
            if modes.get(name) in (None, "direct"):
                modes[name] = mode
    return modes


def _by_reason(fallbacks: tuple[str, ...], workers: Sequence[RankReport]) -> dict[str, tuple[str, ...]]:
    """`fallbacks` (sorted) grouped by why they fall back: the first worker's reason that is given."""
    grouped: dict[str, tuple[str, ...]] = {}
    for name in fallbacks:
        reason = next((r.reasons[name] for r in workers if r.reasons.get(name)), "no reason given")
        grouped[reason] = (*grouped.get(reason, ()), name)
    return grouped


def summarize(
    schedule: Schedule,
    workers: Sequence[RankReport],
    transport: str,
    cuda_ipc: bool,
    world_size: int,
    colocated: bool,
    seconds: float,
) -> SyncSummary:
    """What forming a group decided, from its schedule and its workers' reports."""
    plan, modes = schedule.plan, _write_modes(workers)
    fallbacks = tuple(sorted(n for n, m in modes.items() if m == "fallback"))
    return SyncSummary(
        tensors=len(plan),
        buckets=schedule.num_buckets,
        transport=transport,
        cuda_ipc=cuda_ipc,
        world_size=world_size,
        colocated=colocated,
        relay=schedule.relay_choice,
        plan_bytes=plan.stats.total_bytes,
        local_copy_bytes=plan.stats.local_copy_bytes,
        broadcast_bytes=plan.stats.broadcast_bytes,
        fallbacks=fallbacks,
        fallback_reasons=_by_reason(fallbacks, workers),
        modes=modes,
        kept_bytes=tuple(r.kept_bytes for r in workers),
        swap_bytes=tuple(0 if cuda_ipc else r.swap_bytes for r in workers),
        seconds=seconds,
    )


def join_bound(wait_s: float) -> float:
    """How long each rank may take to join a group whose joining the coordinator waits `wait_s`
    seconds for: a quarter of the wait, at most 5 s, is left for the ranks to answer, so one whose
    peer never joined says so before the coordinator stops listening."""
    return wait_s - min(5.0, wait_s / 4)


def group_init(
    config: SyncConfig,
    world_size: int,
    trainers: int,
    worker_ranks: Sequence[int],
    transport: str,
    rendezvous: bytes,
    secret: bytes,
) -> InitInfo:
    """Rank 0's `InitInfo` (every rank's differs only in `rank`): the group's shape, transport
    and rendezvous message, and `config`'s round settings."""
    return InitInfo(
        rank=0,
        world_size=world_size,
        num_trainers=trainers,
        worker_ranks=tuple(worker_ranks),
        transport=transport,
        rendezvous=rendezvous,
        prefix=f"rl-sync-{uuid.uuid4().hex[:12]}",
        timeout_s=config.round_timeout_s,
        join_timeout_s=join_bound(config.init_timeout_s),
        sparse_baseline=config.sparse_baseline,
        integrity=cast(Integrity, config.integrity),  # one of them: SyncConfig.__post_init__ checked
        interface=config.interface or "",
        secret=secret,
    )
