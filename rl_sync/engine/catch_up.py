"""A joining engine catches up by relay: a peer replica sends it what it holds.

When an engine joins a live group (`WeightSync.add_engine`), the trainers may have moved on
since the last round, so the version the other engines hold lives only in them. A catch-up
plan copies it: for every tensor, each rank of a peer replica sends the boxes it keeps to
the joining rank at the same position (`rl_sync.planning.elastic.engine_layout`), over the
grown group's transport, before the grown group runs its first round. Only the peer's and
the newcomer's ranks take part; the peer reads its live weights while its engine serves.

Ordering contract: the peer's and the newcomer's ranks run the same catch-up plan; buckets in
schedule order (`runner.run_program`).

Typical use (inside `rl_sync.rank.worker`)::

    schedule = decode(PlanInfo, plan).to_schedule()
    if joins(schedule, session.rank): ...               # a rank of the joining engine
    counters = run_catch_up(session, schedule, live_endpoints, receive_endpoints, round_info)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..planning.schedule import Schedule
from ..wire.messages import RoundInfo
from .endpoint import Endpoint
from .runner import BucketIO, Counters, compile_program, deadline_in, run_program
from .session import RankSession, plan_endpoints


def joins(schedule: Schedule, rank: int) -> bool:
    """Whether group rank `rank` is a rank of the joining engine: one the catch-up `schedule` writes into."""
    return any(s.dst.mesh.index_of(rank) is not None for s in schedule.plan.specs)


def run_catch_up(
    session: RankSession,
    schedule: Schedule,
    sources: Mapping[str, Endpoint],
    dests: Mapping[str, Endpoint],
    round_info: RoundInfo,
) -> Counters:
    """Run this rank's part of the catch-up `schedule` over `session`'s transport (sending from
    `sources`, receiving into `dests`) within `round_info.timeout_s`; returns what it moved."""
    rank = session.rank
    specs = schedule.plan.specs
    src = plan_endpoints(schedule.plan, rank, sources, "source")
    dst = plan_endpoints(schedule.plan, rank, dests, "destination")
    io = BucketIO(lambda _b, t: src[t], lambda _b, t: dst[t], [getattr(torch, s.dtype) for s in specs])
    program = compile_program(schedule.rank_slice(rank).buckets, io, session.device)
    context = f"catch-up to version {round_info.version}"
    deadline = deadline_in(round_info.timeout_s)
    return run_program(program, session.transport, deadline, names=[s.name for s in specs], context=context)
