"""The coordinator-facing side of a sync participant, shared by both mixins.

A trainer actor inherits `SyncTrainerMixin` (`actors/trainer_mixin.py`), a worker
actor `SyncWorkerMixin` (`actors/worker_mixin.py`); an actor inheriting both is a
trainer and a worker at once (one process holding the training shards and the
inference weights): it joins the group as one rank and copies its overlap
locally. The coordinator calls the `_rl_sync_*` methods; users never do.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import ray
import torch

from rl_sync.engine.session import RankSession
from rl_sync.messages import InitInfo, RankStats, RoundInfo, SideReport
from rl_sync.plan_info import PlanInfo
from rl_sync.transport.cuda_ipc import IpcExport, MappedDestinations, device_uuid
from rl_sync.transport.nccl import new_unique_id
from rl_sync.wire import decode, encode


_NONE: Mapping = MappingProxyType({})


class Participant:
    """State and coordinator-facing methods; mixins add their side's entries and round hooks."""

    _rl_sync_session: RankSession | None = None
    _rl_sync_sides: dict | None = None
    _rl_sync_mapped: MappedDestinations | None = None

    def _rl_sync_entries(self, side: str):
        method = getattr(self, f"_rl_sync_{side}_entries", None)
        if method is None:
            raise TypeError(f"{type(self).__name__} is asked to be a {side} but does not inherit the {side} mixin")
        return method(*self._rl_sync_sides[side])

    def _rl_sync_endpoints(self, side: str) -> Mapping:
        """This side's endpoints; the same (empty) object every round for a side this actor
        does not play, so the session keeps replaying its compiled round."""
        return self._rl_sync_entries(side)[1] if side in (self._rl_sync_sides or {}) else _NONE

    def _rl_sync_describe(self, side: str, side_rank: int, side_size: int, options: dict | None = None) -> bytes:
        """Report this side's tensors. A worker's `options` carry the trainers' checkpoint
        (`{name: (dtype name, shape)}`) to bind and whether to double-buffer."""
        self._rl_sync_sides = dict(self._rl_sync_sides or {}, **{side: (side_rank, side_size, options or {})})
        reports, endpoints = self._rl_sync_entries(side)
        devices = {str(e.tensor.device) for e in endpoints.values()}
        if len(devices) > 1:
            raise ValueError(f"rank {side_rank} of {type(self).__name__}: tensors span devices {sorted(devices)}")
        device = devices.pop() if devices else "cpu"
        gpu = f"{ray.get_runtime_context().get_node_id()}/{device_uuid(torch.device(device))}" if device.startswith("cuda") else ""
        fallbacks = tuple(self._rl_sync_fallback_names()) if side == "worker" else ()
        return encode(SideReport(side_rank, device, gpu, tuple(reports), fallbacks), compress=True)

    def _rl_sync_fallback_names(self) -> list[str]:
        return []

    def _rl_sync_ping(self) -> None:
        """Answers when the actor is alive (the coordinator checks before re-forming a group)."""

    def _rl_sync_nccl_ids(self) -> tuple[list[int], list[int]]:
        return new_unique_id(), new_unique_id()

    def _rl_sync_connect(self, init: bytes, plan: bytes, bind_host: str | None, device: str,
                         ipc: bytes | None = None) -> None:
        info = decode(InitInfo, init)
        host = bind_host or ray.util.get_node_ip_address()
        self._rl_sync_session = RankSession(info, decode(PlanInfo, plan), bind_host=host, device=torch.device(device))
        if ipc is not None:
            self._rl_sync_mapped = MappedDestinations(decode(IpcExport, ipc), torch.device(device))
            self._rl_sync_mapped_dests = self._rl_sync_session.destination_endpoints(self._rl_sync_mapped.views)

    def _rl_sync_run(self, round_blob: bytes) -> bytes:
        session = self._rl_sync_session
        if session is None:
            raise RuntimeError("rl-sync: this actor has not joined a sync group")
        round_info = decode(RoundInfo, round_blob)
        self._rl_sync_before_round(round_info)
        sources = self._rl_sync_endpoints("trainer")
        mapped = self._rl_sync_mapped
        if mapped is None:
            stats = session.run(round_info, sources, self._rl_sync_endpoints("worker"))
        else:
            mapped.before_writes()
            stats = session.run(round_info, sources, self._rl_sync_mapped_dests)
            mapped.after_writes()
        return encode(self._rl_sync_after_round(round_info, stats))

    def _rl_sync_before_round(self, round_info: RoundInfo) -> None:
        """Hook: a worker marks itself in flight."""

    def _rl_sync_after_round(self, round_info: RoundInfo, stats: RankStats) -> RankStats:
        """Hook: a worker records its version and hands over fallbacks."""
        return stats

    def _rl_sync_close(self, abort: bool = False) -> None:
        session, self._rl_sync_session = self._rl_sync_session, None
        mapped, self._rl_sync_mapped = self._rl_sync_mapped, None
        if mapped is not None:
            mapped.close()
        if session is not None and abort:
            session.transport.abort()
        elif session is not None:
            session.close()
