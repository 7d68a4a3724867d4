"""Mixins that make a user's own Ray actor classes take part in a sync group.

A trainer actor inherits `SyncTrainerMixin` and defines `rl_sync_sources()`
returning `{checkpoint name: DTensor | Sharded | Tensor}`; a worker actor
inherits `SyncWorkerMixin` and defines `rl_sync_destinations()` returning
`{checkpoint name: Destination}`. The coordinator calls the `_rl_sync_*`
methods; users never do. Trainer sources are re-read every round (FSDP may
swap storage between steps); worker destinations are resolved once at init
and must stay the live storage (inference engines keep parameters in place).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from collections.abc import Mapping

import ray
import torch

from rl_sync.engine.sources import trainer_entries, worker_entries
from rl_sync.engine.session import RankSession
from rl_sync.messages import InitInfo, RoundInfo, SideReport
from rl_sync.transport.cuda_ipc import IpcExport, MappedDestinations, WorkerExport, device_uuid
from rl_sync.plan_info import PlanInfo
from rl_sync.transport.nccl import new_unique_id
from rl_sync.wire import decode, encode


class _Participant:
    """State and coordinator-facing methods shared by both sides.

    An actor inheriting both mixins is a trainer and a worker at once (one
    process holding the training shards and the inference weights); it joins
    the group as one rank and its overlap is copied locally."""

    _rl_sync_session: RankSession | None = None
    _rl_sync_sides: dict | None = None

    def _rl_sync_entries(self, side: str):
        method = getattr(self, f"_rl_sync_{side}_entries", None)
        if method is None:
            raise TypeError(f"{type(self).__name__} is asked to be a {side} but does not inherit the {side} mixin")
        rank, size, checkpoint = self._rl_sync_sides[side]
        return method(rank, size, checkpoint) if side == "worker" else method(rank, size)

    def _rl_sync_endpoints(self, side: str) -> dict:
        return self._rl_sync_entries(side)[1] if side in (self._rl_sync_sides or {}) else {}

    def _rl_sync_describe(self, side: str, side_rank: int, side_size: int, checkpoint: dict | None = None) -> bytes:
        """Report this side's tensors; a worker is given the trainers' checkpoint
        (`{name: (dtype name, shape)}`) to bind."""
        if checkpoint is not None:
            checkpoint = {n: (getattr(torch, d), tuple(s)) for n, (d, s) in checkpoint.items()}
        self._rl_sync_sides = dict(self._rl_sync_sides or {}, **{side: (side_rank, side_size, checkpoint)})
        reports, endpoints = self._rl_sync_entries(side)
        devices = {str(e.tensor.device) for e in endpoints.values()}
        if len(devices) > 1:
            raise ValueError(f"rank {side_rank} of {type(self).__name__}: tensors span devices {sorted(devices)}")
        device = devices.pop() if devices else "cpu"
        gpu = ""
        if device.startswith("cuda"):
            gpu = f"{ray.get_runtime_context().get_node_id()}/{device_uuid(torch.device(device))}"
        fallbacks = tuple(self._rl_sync_fallback_names()) if side == "worker" else ()
        if fallbacks and not hasattr(self, "rl_sync_load_fallbacks"):
            raise ValueError(f"worker rank {side_rank}: {len(fallbacks)} tensors fall back ({list(fallbacks)[:8]}) but "
                             f"{type(self).__name__} defines no rl_sync_load_fallbacks(pairs) hook")
        return encode(SideReport(side_rank, device, gpu, tuple(reports), fallbacks), compress=True)

    def _rl_sync_fallback_names(self) -> list[str]:
        return []

    def _rl_sync_nccl_ids(self) -> tuple[list[int], list[int]]:
        return new_unique_id(), new_unique_id()

    def _rl_sync_connect(self, init: bytes, plan: bytes, bind_host: str | None, device: str,
                         ipc: bytes | None = None) -> None:
        info = decode(InitInfo, init)
        host = bind_host or ray.util.get_node_ip_address()
        session = RankSession(info, decode(PlanInfo, plan), bind_host=host, device=torch.device(device))
        self._rl_sync_session = session
        self._rl_sync_mapped = None if ipc is None else MappedDestinations(decode(IpcExport, ipc), torch.device(device))
        if self._rl_sync_mapped is not None:
            self._rl_sync_mapped_dests = session.destination_endpoints(self._rl_sync_mapped.views)

    def _rl_sync_run(self, round_blob: bytes) -> bytes:
        session = self._rl_sync_session
        if session is None:
            raise RuntimeError("rl-sync: this actor has not joined a sync group")
        round_info = decode(RoundInfo, round_blob)
        sources, dests = self._rl_sync_endpoints("trainer"), self._rl_sync_endpoints("worker")
        mapped = getattr(self, "_rl_sync_mapped", None)
        if mapped is None:
            stats = session.run(round_info, sources, dests)
        else:
            mapped.before_writes()
            stats = session.run(round_info, sources, self._rl_sync_mapped_dests)
            mapped.after_writes()
        return encode(replace(stats, fallbacks=self._rl_sync_hand_over(round_info)))

    def _rl_sync_hand_over(self, round_info: RoundInfo) -> int:
        """Give the round's fallback tensors, received whole, to the load hook; how many."""
        names = [n for n in self._rl_sync_fallback_names() if round_info.names is None or n in round_info.names]
        if names:
            views = self._rl_sync_cached[1]
            self.rl_sync_load_fallbacks([(n, views[n].tensor) for n in names])
        return len(names)

    def _rl_sync_ipc_export(self, device: str) -> bytes:
        views = {name: e.tensor for name, e in self._rl_sync_endpoints("worker").items()}
        self._rl_sync_ipc = WorkerExport(views, torch.device(device))
        return encode(self._rl_sync_ipc.export)

    def _rl_sync_ipc_begin(self) -> None:
        self._rl_sync_ipc.begin()

    def _rl_sync_ipc_end(self) -> None:
        self._rl_sync_ipc.end()

    def _rl_sync_close(self, abort: bool = False) -> None:
        session, self._rl_sync_session = self._rl_sync_session, None
        mapped, self._rl_sync_mapped = getattr(self, "_rl_sync_mapped", None), None
        if mapped is not None:
            mapped.close()
        if session is not None and abort:
            session.transport.abort()
        elif session is not None:
            session.close()


class SyncTrainerMixin(_Participant):
    """Inherit in a trainer actor and define `rl_sync_sources()`.

    `rl_sync_sources()` is called every round. When it returns the same mapping
    holding the same tensor objects as last round, the compiled round is
    replayed as is (no per-tensor work); anything else is resolved afresh. A
    trainer that swaps a tensor's storage in place (`p.data = ...`) must return
    a new mapping so the change is seen."""

    _rl_sync_source_cache: tuple | None = None

    def _rl_sync_trainer_entries(self, rank: int, size: int):
        sources = getattr(self, "rl_sync_sources", None)
        if sources is None:
            raise TypeError(f"{type(self).__name__} must define rl_sync_sources() -> {{name: DTensor | Sharded | Tensor}}")
        tensors: Mapping = sources()
        cache = self._rl_sync_source_cache
        if (cache is not None and cache[0] is tensors and cache[1] == (rank, size) and len(cache[2]) == len(tensors)
                and all(map(operator.is_, tensors.values(), cache[2]))):
            return cache[3]
        entries = trainer_entries(tensors, rank, size)
        self._rl_sync_source_cache = (tensors, (rank, size), list(tensors.values()), entries)
        return entries


class SyncWorkerMixin(_Participant):
    """Inherit in an inference-worker actor and define `rl_sync_destinations()`."""

    _rl_sync_cached: tuple | None = None
    _rl_sync_fallbacks: tuple[str, ...] = ()

    def _rl_sync_worker_entries(self, rank: int, size: int, checkpoint: dict | None):
        if self._rl_sync_cached is None:
            destinations = getattr(self, "rl_sync_destinations", None)
            if destinations is None:
                raise TypeError(f"{type(self).__name__} must define rl_sync_destinations(checkpoint) -> {{name: Destination}}")
            bound = destinations(checkpoint)
            self._rl_sync_fallbacks = tuple(n for n, d in bound.items() if d.fallback)
            self._rl_sync_cached = worker_entries(bound, rank)
        return self._rl_sync_cached

    def _rl_sync_fallback_names(self) -> list[str]:
        return list(self._rl_sync_fallbacks)
