"""The step a tensor-parallel engine's ranks commit before, agreed by the coordinator.

A staged round's commit lands between two of an engine's steps
(`rl_sync.rank.steps`); the ranks of a tensor-parallel engine must all switch
before the same one. Before the commit, the coordinator arms every rank of each
such engine at once (each holds at its next step boundary and answers its
number), then commits each engine's ranks before the largest number they
answered. Ranks are listed engine by engine, each engine's in tensor-parallel
order, so an engine is `engine_ranks` consecutive members (`RankReport`).

Typical use (the coordinator's commit)::

    steps = agreed_steps(workers, version, timeout_s, "round 3 commit")
    gather(workers, lambda m: m.commit(version, wait_s, reply, steps.get(id(m))), ...)
"""

from __future__ import annotations

from collections.abc import Sequence

from .calls import SyncError
from .members import ActorMember, Member, collect, failed

ANSWER_S = 30.0
"""How long the coordinator waits for every rank's arming answer (each answers at once)."""
HOLD_S = ANSWER_S + 30.0
"""How long an armed rank holds at most: past the answers' wait, with room for the commit to
reach it (a rank that gave up refuses the commit, and the group breaks)."""
RELEASE_S = 10.0
"""How long the coordinator waits for armed ranks to be released when the agreement failed."""


def lockstep_engines(workers: Sequence[Member]) -> list[list[ActorMember]]:
    """The members of each tensor-parallel engine whose commits land between two of its steps."""
    engines: list[list[ActorMember]] = []
    at = 0
    while at < len(workers):
        member = workers[at]
        if not isinstance(member, ActorMember) or not member.control or member.engine_ranks == 1:
            at += 1
            continue
        engine = list(workers[at : at + member.engine_ranks])
        if not _one_engine(member, engine):
            raise SyncError(
                f"{member.label} reports an engine of {member.engine_ranks} tensor-parallel ranks, but it and the "
                f"workers after it ({', '.join(m.label for m in engine)}) are not one engine's ranks; list the "
                "workers engine by engine"
            )
        engines.append(engine)  # type: ignore[arg-type]
        at += member.engine_ranks
    return engines


def _one_engine(first: ActorMember, engine: list[Member]) -> bool:
    """Whether `engine` is `first`'s engine's ranks: as many as it reported, each of its name."""
    return len(engine) == first.engine_ranks and all(
        isinstance(m, ActorMember) and (m.engine_ranks, m.engine) == (first.engine_ranks, first.engine) for m in engine
    )


def agreed_steps(workers: Sequence[Member], version: int, timeout_s: float, what: str) -> dict[int, int]:
    """Arm every rank of each tensor-parallel engine for `version`'s commit (held at most
    `HOLD_S`), answering within `timeout_s` (at most `ANSWER_S`): `{id(member): step}` with the
    largest step its engine's ranks answered. Where a rank fails, the others are released (no
    commit comes) and the failure raised (`SyncError`)."""
    engines = lockstep_engines(workers)
    members = [m for engine in engines for m in engine]
    if not members:
        return {}
    answer_s = min(timeout_s, ANSWER_S)
    steps, failures = collect(members, lambda m: m.arm(version, HOLD_S), answer_s)
    if failures:
        collect(members, lambda m: m.disarm(version), RELEASE_S)
        raise failed(f"{what} (agreeing on a step of each tensor-parallel engine)", failures, len(members), answer_s)
    agreed, at = {}, 0
    for engine in engines:
        step = max(steps[at : at + len(engine)])
        at += len(engine)
        agreed.update({id(m): step for m in engine})
    return agreed
