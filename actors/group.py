"""Who is in a sync group and where each rank sits.

Trainers take group ranks `[0, T)` in the order given. Workers follow in the
order given, each member with as many consecutive ranks as it holds (one for
an actor, the engine's ranks for a vLLM service); an actor passed as both a
trainer and a worker (one process training and serving) keeps its trainer
rank and copies its overlap locally. Actors are told apart by their handles
(Ray compares actor ids), never by private attributes.

Typical use (inside the coordinator)::

    group = Membership.of(trainer_handles, worker_handles_or_services)
    group.worker_ranks      # group rank of each worker-side rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ray.actor import ActorHandle

from .hooks import check_hooks
from .members import ActorMember, Member, ServiceMember
from .service import VllmService


def _check_entries(handles: Sequence, side: Literal["trainer", "worker"]) -> None:
    """Every entry is an actor handle (or, for workers, a `VllmService`), each actor once, and
    each actor has the side's mixin and hooks (`actors.hooks`)."""
    seen: dict = {}
    for i, handle in enumerate(handles):
        if isinstance(handle, VllmService) and side == "worker":
            continue
        if not isinstance(handle, ActorHandle):
            kinds = "a Ray actor handle or a VllmService" if side == "worker" else "a Ray actor handle"
            raise TypeError(f"{side} {i} must be {kinds}, got {type(handle).__name__} {handle!r:.60}")
        if handle in seen:
            raise ValueError(f"{side}s {seen[handle]} and {i} are the same actor; pass each {side} once")
        check_hooks(handle, side, f"{side} {i}")
        seen[handle] = i


def _span(first: int, size: int) -> str:
    return f"{first}" if size == 1 else f"{first}-{first + size - 1}"


@dataclass
class Membership:
    """Trainer and worker members and the group rank of every worker-side rank."""

    trainers: list[ActorMember]
    workers: list[Member]
    worker_ranks: tuple[int, ...]
    ranks: list[Member]
    """The members that run rounds, in group-rank order (hybrid actors once, as trainers)."""

    @classmethod
    def of(cls, trainers: Sequence, workers: Sequence) -> Membership:
        """Ranks for `trainers` and `workers`; refuses an empty side, entries that are not actors
        (or, for workers, `VllmService`s), an actor passed twice on one side, and one lacking its
        side's mixin or hooks (`actors.hooks`)."""
        if not trainers or not workers:
            raise ValueError(
                f"a sync group needs at least one trainer and one worker, got {len(trainers)} trainers "
                f"and {len(workers)} workers"
            )
        _check_entries(trainers, "trainer")
        _check_entries(workers, "worker")
        trainer_members = [ActorMember(h, f"trainer {i} (rank {i})") for i, h in enumerate(trainers)]
        trainer_rank = {h: i for i, h in enumerate(trainers)}
        worker_members: list[Member] = []
        worker_ranks: list[int] = []
        running: list[Member] = list(trainer_members)
        next_rank, side = len(trainers), 0
        for j, entry in enumerate(workers):
            member: Member
            if isinstance(entry, VllmService):
                member = ServiceMember(
                    entry,
                    f"vLLM service {j} (workers {_span(side, entry.ranks)}, ranks {_span(next_rank, entry.ranks)})",
                )
                ranks = list(range(next_rank, next_rank + entry.ranks))
            elif entry in trainer_rank:
                member = ActorMember(entry, f"worker {side} (rank {trainer_rank[entry]})")
                ranks = [trainer_rank[entry]]
            else:
                member = ActorMember(entry, f"worker {side} (rank {next_rank})")
                ranks = [next_rank]
            if ranks[0] >= len(trainers):
                running.append(member)
                next_rank += len(ranks)
            worker_members.append(member)
            worker_ranks.extend(ranks)
            side += len(ranks)
        return cls(trainer_members, worker_members, tuple(worker_ranks), running)

    @property
    def num_workers(self) -> int:
        """Worker-side ranks (an engine service counts each of its ranks)."""
        return len(self.worker_ranks)

    def worker_firsts(self) -> list[int]:
        """The first worker-side rank of each worker member."""
        firsts, side = [], 0
        for member in self.workers:
            firsts.append(side)
            side += member.size
        return firsts
