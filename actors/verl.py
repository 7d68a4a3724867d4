"""rl-sync as a verl checkpoint engine (verl 0.9): `checkpoint_engine.backend: rl_sync`.

verl picks the engine that moves weights from its actor workers to its rollout
workers by configuration (`CheckpointEngineRegistry`); this module registers
rl-sync there when it is imported, which verl does on every worker given
`custom_backend_module`::

    actor_rollout_ref:
      rollout:
        checkpoint_engine:
          backend: rl_sync
          custom_backend_module: actors.verl
          update_weights_bucket_megabytes: 256        # rl-sync's bucket_bytes
          engine_kwargs:
            rl_sync: {mode: auto, bind_host: 10.0.0.5}   # any SyncConfig field

How verl drives it, every update (`CheckpointEngineManager.update_weights`):
`prepare` on every worker (actor rank 0 hosts the group's rendezvous store
once and answers its address and secret, which travel through Ray like the
coordinator's), `build_topology` (trainers are the actor ranks, workers the
rollout ranks), `init_process_group`, then the actors' `send_weights` and the
rollout workers' `receive_weights` at once, and `finalize`. The first update
plans and connects the group (actor rank 0 leads it in process,
`rl_sync.lead`); every later one replays the plan: each actor rank sends
its part of what its weight generator yields (a DTensor's own shard, or a
share of a whole tensor every rank holds) straight to every rollout rank,
M2N or only what changed (`mode: sparse | auto`). Each rollout rank keeps a
whole copy of every tensor (rl-sync's destination and sparse rounds'
baseline) and yields them all to verl's server adapter, which loads them
into its engine.

Not supported: changing the topology after the first update (elastic
replicas: restart with a new engine), LoRA adapter syncs, verl's `naive`
colocated path (rl-sync's own `WeightSync` covers colocated CUDA IPC).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Generator
from typing import Any, Literal

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from rl_sync.config.sync import SyncConfig
from rl_sync.lead.board import Posts
from rl_sync.lead.follower import Follower
from rl_sync.lead.handler import RankHandler
from rl_sync.lead.leader import Leader
from rl_sync.lead.ranks import HeldSources, WholeCopies
from rl_sync.rendezvous import MemberStore, new_secret

BACKEND = "rl_sync"


@CheckpointEngineRegistry.register(BACKEND)
class RlSyncCheckpointEngine(CheckpointEngine):
    """verl's checkpoint-engine interface over an rl-sync group (see the module docstring).
    `bucket_size` is rl-sync's `bucket_bytes`; `sync` takes any other `SyncConfig` field."""

    def __init__(self, bucket_size: int, is_master: bool = False, **sync: Any) -> None:
        self.config = SyncConfig(**{"bucket_bytes": bucket_size, **sync})
        self.is_master = is_master
        self.leader: Leader | None = None
        self.follower: Follower | None = None
        self.rank: HeldSources | WholeCopies | None = None
        self.topology: tuple | None = None
        self.formed = False

    def prepare(self) -> dict[str, Any]:
        """Actor rank 0 opens the group's store (once) and answers where it is and its secret."""
        if not self.is_master:
            return {}
        if self.leader is None:
            self.rank = HeldSources()
            self.leader = Leader(self.rank, self.config, new_secret())
        host, port = self.leader.address
        return {"host": host, "port": port, "prefix": self.leader.reply.prefix, "secret": self.leader.secret}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Trainers: the actor ranks in order; workers: the rollout ranks in order."""
        master = metadata[0] if metadata else {}
        if "secret" not in master:
            raise ValueError(
                "rl_sync checkpoint engine: actor rank 0's prepare() answered no store address; the actor "
                "ranks' engines must be built with is_master=True on rank 0 (verl's actor workers do)"
            )
        sizes = {"trainers": actor_wg_world_size, "workers": rollout_world_size, "master": master}
        actors: dict[str, list[Any]]
        rollout: dict[str, list[Any]]
        actors = {"side": ["trainer"] * actor_wg_world_size, "rank": list(range(actor_wg_world_size))}
        rollout = {"side": ["worker"] * rollout_world_size, "rank": list(range(rollout_world_size))}
        for key, value in sizes.items():
            actors[key], rollout[key] = [value] * actor_wg_world_size, [value] * rollout_world_size
        return actors, rollout

    def init_process_group(self, **topology: Any) -> None:
        """Join the topology of the first update (`build_topology`'s keyword arguments for this
        rank); a later one must be the same."""
        self._join(**topology)

    def _join(self, side: Literal["trainer", "worker"], rank: int, trainers: int, workers: int, master: dict) -> None:
        topology = (side, rank, trainers, workers, master["host"], master["port"], master["prefix"])
        if self.topology is not None:
            if topology != self.topology:
                raise ValueError(
                    f"rl_sync checkpoint engine: this rank joined as {self.topology[:4]} (side, rank, actor "
                    f"ranks, rollout ranks) and is now asked {topology[:4]}; changing the topology is not "
                    "supported: restart the workers"
                )
            return
        self.topology = topology
        if side == "trainer" and rank == 0:
            return
        self.rank = HeldSources() if side == "trainer" else WholeCopies(workers)
        board, index = ("trainers", rank - 1) if side == "trainer" else ("workers", rank)
        store = MemberStore(master["host"], master["port"], master["secret"], timeout_s=self.config.init_timeout_s)
        posts = Posts(store, f"{master['prefix']}/{board}", master["secret"])
        self.follower = Follower(RankHandler(self.rank, side, index), posts, self.config.init_budget_s)

    async def send_weights(
        self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None
    ) -> dict[str, float]:
        """One round from this actor rank; on actor rank 0, the round's figures for verl's metrics."""
        return await asyncio.to_thread(self._send, weights)

    def _send(self, weights) -> dict[str, float]:
        assert isinstance(self.rank, HeldSources), "rl_sync checkpoint engine: send_weights on a rollout rank"
        self.rank.tensors = dict(weights)  # every actor rank walks verl's generator (it may gather)
        if self.leader is None:
            self._follow("run")
            return {}
        if not self.formed:
            assert self.topology is not None, "rl_sync checkpoint engine: init_process_group first"
            rollout = self.leader.board("workers", self.topology[3], "rollout rank {}".format)
            self.leader.form(self.topology[2], rollout)
            self.formed = True
        stats = self.leader.push()
        sent = sum(r.sent_bytes for r in stats.ranks if r.role != "worker")
        return {"rl_sync/version": stats.version, "rl_sync/seconds": stats.seconds, "rl_sync/sent_bytes": sent}

    def _follow(self, last: str) -> None:
        assert self.follower is not None, "rl_sync checkpoint engine: init_process_group first"
        if not self.formed:
            self.follower.until("connect")
            self.formed, self.follower.timeout_s = True, self.config.round_timeout_s
        self.follower.until(last)  # type: ignore[arg-type]  # "run" or "commit"

    def receive_weights(self, global_steps: int | None = None) -> Any:
        """An async generator (what verl's server adapters iterate): one round into this rollout
        rank's copies, then every tensor, by name."""
        return self._receive()

    async def _receive(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        assert isinstance(self.rank, WholeCopies), "rl_sync checkpoint engine: receive_weights on an actor rank"
        await asyncio.to_thread(self._follow, "commit" if self.config.double_buffer else "run")
        for name, tensor in self.rank.copies.items():
            yield name, tensor

    def finalize(self) -> None:
        """The group and the rollout copies stay for the next update: it replays the plan."""

    def close(self) -> None:
        """Leave the group (every rank, as verl has no such step: at the end of a job)."""
        if self.leader is not None:
            self.leader.close()
        elif self.follower is not None and self.formed:
            self.follower.until("close")
        self.leader = self.follower = None
