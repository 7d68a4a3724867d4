"""Colocated rounds on the coordinator: trainers writing into the workers that share their GPUs.

In a colocated group (`Coordinator.ipc`) only the trainers form the group;
each writes its worker's live weights through CUDA IPC
(`rl_sync.transport.cuda_ipc`), and the workers take part around the
trainers' round. Every colocated round carries a ticket (`RoundInfo.ticket`,
`next_ticket`), larger than any before it, on which each pair meets on its
shared page (`rl_sync.transport.doorbell`).

* `paired_round`: one step. Each worker's whole side of the round
  (`_rl_sync_ipc_round`: check its bindings, open, wait for its trainer's word,
  end) runs at the same time as the trainers' round, so a round costs one Ray
  call on each rank. The trainers write only once every worker is ready
  (`rl_sync.rank.pairing`); a worker whose memory moved answers a new export
  and every trainer skips the round: the coordinator has each trainer of such
  a worker map the new export, and runs the round again, full.
* `begin` / `end`: the same sides one call at a time, before and after the
  trainers' round: for engine services (whose ranks are reached through
  vLLM's calls, one at a time) and for staged rounds (`actors.staging`, ended
  at their commit).

Typical use (inside the coordinator)::

    results = paired_round(c, round_)          # None: memory moved, mapped anew; run it again
    moved = begin(c, version, ticket, writes_all, what)    # ... trainers' round ...; end(c, ...)
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from rl_sync.config.sync import writes_every_element
from rl_sync.wire.codec import decode
from rl_sync.wire.messages import RankStats, RoundInfo

from .members import ActorMember, gather

if TYPE_CHECKING:
    from .coordinator import Coordinator
    from .staging import OpenRound


def next_ticket(c: Coordinator) -> int:
    """A colocated round's ticket: larger than every earlier round's of this coordinator (0 outside
    a colocated group)."""
    if not c.ipc:
        return 0
    c.tickets += 1
    return c.tickets


def one_step(c: Coordinator) -> bool:
    """Whether every worker takes a colocated round in one call (`paired_round`): Ray actors do;
    engine services take its steps one at a time (`begin`, `end`)."""
    return c.ipc and all(isinstance(m, ActorMember) for m in c.workers)


def paired_round(c: Coordinator, round_: OpenRound) -> list[RankStats] | None:
    """Run `round_` on the trainers and every worker's side of it at once; the ranks' statistics,
    or None when a worker's memory moved (no trainer wrote; the new exports are mapped)."""
    info = decode(RoundInfo, round_.blob)
    step = c.config.round_timeout_s + 5
    trainers = set(map(id, c.ranks))
    writes_all = writes_every_element(round_.mode, round_.names)

    def call(m):
        if id(m) in trainers:
            return m.run(round_.blob, round_.version, c.reply)
        return m.ipc_round(round_.version, round_.names, info.ticket, info.timeout_s, writes_all)

    answers = gather(c.ranks + c.workers, call, c.budget.left(step), round_.what)
    world = sum(m.size for m in c.ranks)
    if _remapped(c, answers[world:], round_.what):
        return None
    return with_workers(c, [decode(RankStats, a) for a in answers[:world]])


def begin(c: Coordinator, version: int, ticket: int, writes_all: bool, what: str, staged: bool) -> bool:
    """Open round `version` (`ticket`; it `writes_all`: `writes_every_element`) on every colocated
    worker (`staged`: in its control group, beside its generation, `rl_sync.rank.steps`); a worker
    whose memory moved since its export answers a new one, which its trainer maps before any
    write. True if any moved."""
    step = c.config.round_timeout_s + 5
    call = lambda m: m.ipc_begin(version, ticket, writes_all, c.reply, staged)  # noqa: E731
    try:
        opened = gather(c.workers, call, c.budget.left(step), what)
        return _remapped(c, opened, what)
    except Exception:  # (a worker's refusal too: others may have opened it)
        c.broken = what
        raise


def end(
    c: Coordinator, version: int, names: tuple[str, ...] | None, results: list[RankStats], what: str, staged: bool
) -> list[RankStats]:
    """Close a colocated round on every worker once its trainers wrote it (`staged`: as `begin`);
    `results` (the trainers') with each worker's statistics added (`with_workers`)."""
    step = c.config.round_timeout_s + 5
    gather(c.workers, lambda m: m.ipc_end(version, names, c.reply, staged), c.budget.left(step), what)
    return with_workers(c, results)


def with_workers(c: Coordinator, results: list[RankStats]) -> list[RankStats]:
    """The trainers' `results` and each worker's statistics: what its trainer wrote into it."""
    return results + [
        replace(
            results[r],
            rank=r,
            role="worker",
            sent_bytes=0,
            received_bytes=results[r].received_bytes + results[r].local_bytes,
        )
        for r in c.worker_ranks
    ]


def _remapped(c: Coordinator, answers: list[bytes | None], what: str) -> bool:
    """Each trainer whose worker answered a new export (`answers`: one per worker rank, None where
    its memory stayed) maps it; whether any did."""
    fresh = {rank: export for rank, export in zip(c.worker_ranks, answers) if export is not None}
    if not fresh:
        return False
    step = c.config.round_timeout_s + 5
    firsts = c._rank_firsts()
    owner = {firsts[id(m)]: m for m in c.ranks}
    gather(
        [owner[r] for r in fresh],
        lambda m: m.ipc_remap(fresh[firsts[id(m)]]),
        c.budget.left(step),
        f"{what}: mapping moved worker memory",
    )
    return True
