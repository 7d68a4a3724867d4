"""Engines that join and leave a live group (`WeightSync.add_engine` / `remove_engine`).

No rank that stays restarts or binds anew. Adding an engine: its ranks bind for the grown
worker count, and the layouts they report must leave every existing worker its boxes
(`rl_sync.planning.elastic`); the plan and schedule grow; every rank joins the grown group's
transport beside its current one (`_rl_sync_regroup`, on the store the group formed on); a
peer replica holding the group's version sends the newcomer what it holds (catch-up by relay,
`rl_sync.engine.catch_up`), or, when the caller chose `next_push` or with no peer laid out
alike or holding that version (its engine replaced or moved a weight since:
`rl_sync.rank.watch`), the next round carries every tensor to every worker dense; then,
unless the driver gave up on the call (its fence, `actors.fence`, claimed here), every rank
switches to the grown group (`_rl_sync_switch`), trainers keeping their sparse baselines (unless
the next round carries every tensor), and the joining ranks record the version they caught up
to. Removing one: the layouts shrink, the ranks that stay regroup and switch, and the
engine's ranks leave. A join or leave that fails before the switch leaves the group as it
was (a joining engine released), unless a rank of the group itself failed: then, as after
any failure, the next push repairs it. An engine may leave a broken group (one whose ranks
died, say): the group is then formed again without it, as a repair would.

Only engines whose ranks are Ray actors (`VllmEngine`, your mixin actors) join or leave, in
groups without CUDA IPC or engine services, between rounds.

Typical use (inside the coordinator)::

    summary = add_engine(coordinator, [rank0, rank1], fence)     # one engine's ranks, in TP order
    summary = add_engine(coordinator, [rank0, rank1], fence, "next_push")   # caught up by the next push
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal, get_args

import ray

from rl_sync.planning.agreement import check_agreement, join_bound, split_sources
from rl_sync.planning.elastic import check_grown, engine_layout, shrunk
from rl_sync.planning.layout import Layout
from rl_sync.planning.plan import SideSpec, TensorSpec, join_specs, plan_model
from rl_sync.planning.schedule import Schedule, build_schedule
from rl_sync.rank.side import DescribeOptions
from rl_sync.wire.codec import decode, encode
from rl_sync.wire.messages import InitInfo, RankReport, RoundInfo
from rl_sync.wire.plan_info import PlanInfo
from rl_sync.wire.stats import SyncSummary

from .fence import Fence
from .group import Membership
from .members import Member, ServiceMember, collect, failed, gather, note_controls

if TYPE_CHECKING:
    from .coordinator import Coordinator


SWITCH_AT_LEAST_S = 5.0
"""What the switch gets once the fence is claimed (the join or leave decided), however little of
the call's budget the catch-up left: each rank only makes the group it joined current."""

CatchUp = Literal["relay", "next_push"]
"""How a joining engine gets the group's weights (`WeightSync.add_engine`)."""
CATCH_UPS: tuple[CatchUp, ...] = get_args(CatchUp)


@dataclass(frozen=True)
class Formed:
    """What forming the group found, kept for engines that join or leave."""

    sources: list[SideSpec]
    """The trainers' tensors, whole (`rl_sync.planning.agreement.merge_sources`)."""
    workers: list[RankReport]
    """Each worker-side rank's report, as it bound."""
    devices: list[str]
    """Each group rank's device."""
    options: DescribeOptions
    """What workers are told when they bind."""
    info: InitInfo
    """The group's `InitInfo` (rank 0's)."""
    layouts: dict[str, Layout] | None = None
    """Each tensor's destination layout over the worker-side ranks now; None: worker 0's report's."""

    @property
    def destination_layouts(self) -> dict[str, Layout]:
        if self.layouts is not None:
            return self.layouts
        return {t.name: t.layout.to_layout() for t in self.workers[0].tensors}


def _check_live(c: Coordinator, what: str, handles: Sequence) -> None:
    """Refuse what an engine cannot join or leave (see the module docstring), naming it; a broken
    group takes no engine."""
    c._check_unstaged(what)
    c.settled()
    if c.broken is not None and what == "add_engine":
        raise ValueError(f"{what}: the group is broken by an earlier failure ({c.broken}); push() repairs it first")
    if c.ipc:
        raise ValueError(f"{what}: not available while trainers write into colocated workers (CUDA IPC)")
    if any(isinstance(m, ServiceMember) for m in c.workers) or not all(
        isinstance(h, ray.actor.ActorHandle) for h in handles
    ):
        raise ValueError(
            f"{what}: engine services cannot join or leave a live group (their ranks are reached only "
            "through vLLM's calls); use engines whose ranks are Ray actors (VllmEngine), or a new WeightSync"
        )
    held = _first_in(handles, c.worker_entries) if what == "add_engine" else None
    if held is not None:
        raise ValueError(
            f"{what}: rank {held[0]} of the engine is worker {held[1]} of the group already; pass the rank "
            "actors of an engine outside the group"
        )
    if any(h in c.trainer_handles for h in handles) or any(r < len(c.trainers) for r in c.worker_ranks):
        raise ValueError(f"{what}: not available in groups whose trainers serve as well (hybrid actors)")


def _first_in(handles: Sequence, entries: Sequence) -> tuple[int, int] | None:
    """The first of `handles` that is in `entries`: its index in each; None when none is."""
    return next(((i, list(entries).index(h)) for i, h in enumerate(handles) if h in entries), None)


def _step(
    c: Coordinator,
    members: Sequence[Member],
    call,
    what: str,
    staying: Sequence[Member],
    step_s: float,
    at_least: float | None = None,
) -> list:
    """`call` on every member (`gather`), within `step_s` cut to the call's budget (or `at_least`,
    for a step that must run once the join is decided). A rank in `staying` (the group's own)
    that died or did not answer marks the group broken before the failure is raised; one that
    raised (its peer in the new group died, say) is alive and still in the group it was in."""
    timeout = c.budget.left(step_s, at_least)
    results, failures = collect(members, call, timeout)
    if failures:
        lost = [m for m, e in failures if not isinstance(e, ray.exceptions.RayTaskError)]
        if any(m is s for m in lost for s in staying):
            c.broken = "an engine joining or leaving"
        raise failed(what, failures, len(members), timeout)
    return results


def _release(c: Coordinator, members: Sequence[Member]) -> None:
    """Joining ranks that will not join: they leave the group (bounded; dead ones skipped)."""
    collect(members, lambda m: m.close(True, c.reply, c.tag.token), c.budget.left(c.config.init_timeout_s, 1.0))


def _undo(c: Coordinator, members: Sequence[Member]) -> None:
    """Every rank drops the grown or shrunk group it joined (bounded; dead ones skipped)."""
    collect(members, lambda m: m.switch(False), c.budget.left(c.config.init_timeout_s, 1.0))


def _schedule(c: Coordinator, layouts: dict[str, Layout], workers: list[RankReport], group: Membership) -> Schedule:
    ranks = group.worker_ranks
    destinations = [
        SideSpec(t.name, t.dtype, t.shape, layouts[t.name].remapped(ranks), t.block) for t in workers[0].tensors
    ]
    sources = split_sources(c.formed.sources, [t.name for t in workers[0].tensors])
    plan = plan_model(join_specs(sources, destinations))  # (no hybrid actors: `_check_live`)
    return build_schedule(plan, c.config.bucket_bytes, c.config.coalesce_bytes, c.config.relay)


def _regroup(
    c: Coordinator, group: Membership, schedule: Schedule, devices: list[str], staying: Sequence[Member]
) -> InitInfo:
    """Every rank of `group` joins its transport beside its current one; returns its `InitInfo`."""
    world = sum(m.size for m in group.ranks)
    transport, rendezvous = c._rendezvous(world, all(d.startswith("cuda") for d in devices))
    wait = c.budget.left(c.config.init_timeout_s)
    info = replace(
        c.formed.info,
        join_timeout_s=join_bound(wait),
        world_size=world,
        worker_ranks=group.worker_ranks,
        transport=transport,
        rendezvous=encode(rendezvous),
        prefix=f"rl-sync-{uuid.uuid4().hex[:12]}",
    )
    plan = ray.put(encode(PlanInfo.from_schedule(schedule), compress=True))
    ranks = {id(m): i for i, m in enumerate(group.ranks)}

    def regroup(m: Member):
        return m.regroup(encode(replace(info, rank=ranks[id(m)])), plan, c.config.bind_host, devices[ranks[id(m)]])

    _step(c, group.ranks, regroup, "regroup (join the new group)", staying, wait)
    return info


def _catch_up_plan(c: Coordinator, layouts: dict[str, Layout], workers: list[RankReport], group: Membership, n: int):
    """The plan by which the first replica sends the joining one what it holds, or None when some
    tensor is not laid out by replicas (or nothing was synced yet: the first round is full)."""
    ranks = group.worker_ranks
    peer, newcomer = ranks[:n], ranks[-n:]
    specs = []
    for t in workers[0].tensors:
        grown = layouts[t.name].remapped(ranks)
        src, dst = engine_layout(grown, peer), engine_layout(grown, newcomer)
        if src is None or dst is None or c.version == 0:
            return None
        specs.append(TensorSpec(t.name, t.dtype, t.shape, src, dst))
    schedule = build_schedule(plan_model(specs), c.config.bucket_bytes, c.config.coalesce_bytes)
    return encode(PlanInfo.from_schedule(schedule), compress=True)


def add_engine(c: Coordinator, handles: Sequence, fence: Fence | None, catch_up: CatchUp = "relay") -> SyncSummary:
    """Grow the group by one engine (see the module docstring), caught up by relay or by the next
    push (`catch_up`), unless the driver gave up on the call (`fence`, claimed before the switch);
    returns its new summary."""
    start, what = time.perf_counter(), "add_engine"
    _check_live(c, what, handles)
    N, n = len(c.worker_ranks), len(handles)
    group = Membership.of(c.trainer_handles, list(c.worker_entries) + list(handles))
    joining = group.workers[len(c.workers) :]
    try:
        options = replace(c.formed.options, next_writes_all=True)  # (a catch-up, or the full round after)
        blobs = gather(
            joining,
            lambda m: m.describe("worker", N + joining.index(m), N + n, options, c.reply),
            c.budget.left(c.config.init_timeout_s),
            f"{what} (bind the joining engine)",
        )
        reports = [decode(RankReport, b) for b in blobs]
        note_controls(joining, reports, c.controls)
        layouts = _grown(c, reports, group, N)
        schedule = _schedule(c, layouts, reports, group)
        relay = _catch_up_plan(c, layouts, reports, group, n) if catch_up == "relay" else None
        devices = c.formed.devices + [r.device for r in reports]
    except BaseException:
        _release(c, joining)
        raise
    info, caught_up = _switch(c, group, schedule, devices, joining, relay, fence, what)
    c.formed = replace(c.formed, workers=c.formed.workers + reports, devices=devices, info=info, layouts=layouts)
    if not caught_up:
        c.refresh.regrouped()  # the joining engine holds what its engine loaded: the next round carries all
    c.worker_entries = list(c.worker_entries) + list(handles)
    c._assign_ranks()
    if caught_up:
        c.record_on(joining, c.version)
    return c._summary(info, False, c.formed.workers, time.perf_counter() - start)


def _grown(c: Coordinator, reports: list[RankReport], group: Membership, N: int) -> dict[str, Layout]:
    """The grown layouts the joining ranks report, once they agree among themselves and with the
    group's tensors and leave every existing worker its boxes."""
    check_agreement(reports, ranks=group.worker_ranks)
    old, layouts = c.formed.destination_layouts, {t.name: t.layout.to_layout() for t in reports[0].tensors}
    ours = {t.name: (t.dtype, t.shape, t.block) for t in c.formed.workers[0].tensors}
    theirs = {t.name: (t.dtype, t.shape, t.block) for t in reports[0].tensors}
    if ours != theirs:
        differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
        raise ValueError(
            f"add_engine: the joining engine binds tensors {differ[:4]} otherwise than the group's workers "
            f"(name, dtype, shape: {[theirs.get(k) for k in differ[:4]]} against {[ours.get(k) for k in differ[:4]]})"
            "; engines of a group run the same model"
        )
    for t in reports[0].tensors:
        check_grown(t.name, t.shape, old[t.name], layouts[t.name], N)
    return layouts


def _switch(
    c: Coordinator,
    group: Membership,
    schedule: Schedule,
    devices: list[str],
    joining: Sequence[Member],
    catch_up: bytes | None,
    fence: Fence | None,
    what: str,
) -> tuple[InitInfo, bool]:
    """Regroup every rank of `group`, run the catch-up (if any), claim the call's `fence`, then
    switch every rank; on a failure before the switch (the driver gave up first included), undo
    it and release `joining` (the group is broken only if one of its own ranks failed); on one
    during the switch, release `joining` and mark the group broken (the next push repairs it as
    it was). Returns the new group's `InitInfo` and whether the joining engine caught up."""
    staying = [m for m in group.ranks if all(m is not j for j in joining)]
    try:
        info = _regroup(c, group, schedule, devices, staying)
        caught_up = catch_up is not None and _catch_up(c, group, catch_up, len(joining), staying)
        c.claim(fence, f"{what} finished after the driver gave up on it; the group is as it was")
    except BaseException:
        _undo(c, group.ranks)
        _release(c, joining)
        raise
    try:
        switch = lambda m: m.switch(True)  # noqa: E731
        _step(c, group.ranks, switch, "regroup (switch)", group.ranks, c.config.init_timeout_s, SWITCH_AT_LEAST_S)
    except Exception:
        c.broken = c.broken or "an engine joining or leaving (some ranks switched)"
        _release(c, joining)
        raise
    c.schedule = schedule
    return info, caught_up


def _catch_up(c: Coordinator, group: Membership, plan: bytes, n: int, staying: Sequence[Member]) -> bool:
    """The first replica sends the joining one what it holds, at the group's version; False (and
    nothing sent) when its ranks do not all hold that version (a weight its engine replaced or
    moved since, a round not recorded): the next round then carries every tensor."""
    workers = group.ranks[len(c.trainers) :]
    peers, joining = workers[:n], workers[-n:]
    held = _step(c, peers, lambda m: m.versions(), "add_engine (versions)", staying, c.config.init_timeout_s)
    if held != [c.version] * n:
        return False
    round_blob = encode(RoundInfo(c.version, "m2n", None, c.budget.left(c.config.round_timeout_s), False))
    what = f"add_engine (catch-up to version {c.version})"
    _step(c, peers + joining, lambda m: m.catch_up(plan, round_blob), what, staying, c.config.round_timeout_s + 5)
    return True


def remove_engine(c: Coordinator, handles: Sequence, fence: Fence | None) -> SyncSummary:
    """Shrink the group by one engine (see the module docstring), unless the driver gave up on the
    call (`fence`, claimed before the switch); returns its new summary."""
    start, what = time.perf_counter(), "remove_engine"
    _check_live(c, what, handles)
    entries = list(c.worker_entries)
    missing = [i for i, h in enumerate(handles) if h not in entries]
    if missing:
        raise ValueError(f"{what}: ranks {missing} of the engine are not workers of this group")
    gone = {entries.index(h) for h in handles}
    staying = [h for i, h in enumerate(entries) if i not in gone]
    if not staying:
        raise ValueError(f"{what}: the group would keep no worker; close it instead")
    layouts = {}
    for name, layout in c.formed.destination_layouts.items():
        left = shrunk(layout, gone, len(entries))
        if left is None:
            raise ValueError(
                f"{what}: tensor {name!r} is laid out as {layout}, in which workers {sorted(gone)} are not one "
                "whole replica (replicas lie along mesh axis 0); only a whole engine leaves a live group"
            )
        layouts[name] = left
    if c.broken is not None:
        return _remove_from_broken(c, staying, fence, what)
    group = Membership.of(c.trainer_handles, staying)
    workers = [r for i, r in enumerate(c.formed.workers) if i not in gone]
    leaving = [m for i, m in enumerate(c.workers) if i in gone]
    T = len(c.trainers)
    devices = [d for r, d in enumerate(c.formed.devices) if r < T or r - T not in gone]
    info, _ = _switch(c, group, _schedule(c, layouts, workers, group), devices, [], None, fence, what)
    _release(c, leaving)
    c.formed = replace(c.formed, workers=workers, devices=devices, info=info, layouts=layouts)
    c.worker_entries = staying
    c._assign_ranks()
    return c._summary(info, False, workers, time.perf_counter() - start)


def _remove_from_broken(c: Coordinator, staying: list, fence: Fence | None, what: str) -> SyncSummary:
    """A broken group (a rank of the engine died, say) cannot switch: unless the driver gave up on
    the call, every member leaves it, and it is formed again without the engine (a repair: the
    others bind anew, and the next round carries every tensor)."""
    c.claim(fence, f"{what}: the driver gave up on the call before it started; the group is as it was")
    c._close_ranks(abort=True)
    c.worker_entries = staying
    c._assign_ranks()
    return c._repair()
