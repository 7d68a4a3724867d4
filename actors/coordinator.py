"""The Coordinator actor: plans once, forms the group, orders every round.

Init: gather what every trainer and worker reports, check the workers agree,
plan and schedule, host the rendezvous store (or relay NCCL ids), and connect
every rank. Round: start `send` on trainers and `receive` on workers together,
wait for all within the round timeout, and record the version only when every
rank finished. Any failure becomes a `SyncError` naming the ranks, the round and
(from the ranks' own errors) the bucket and tensors.
"""

from __future__ import annotations

import socket
import time
import uuid
from dataclasses import replace
from datetime import timedelta

import ray
import torch.distributed as dist

from rl_sync.messages import InitInfo, RankStats, RoundInfo, SideReport
from rl_sync.plan import SideSpec, join_specs, plan_model
from rl_sync.plan_info import PlanInfo
from rl_sync.schedule import build_schedule
from rl_sync.stats import RoundStats
from rl_sync.sync_config import SyncConfig
from rl_sync.wire import decode, encode

from .agreement import check_agreement, merge_sources
from .calls import SyncError, call_all


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


class Coordinator:
    """Runs as a Ray actor (`ray.remote(Coordinator)`); driven by `WeightSync`."""

    def __init__(self, trainers: list, workers: list, config: SyncConfig):
        if not trainers or not workers:
            raise ValueError(f"a sync group needs trainers and workers, got {len(trainers)} and {len(workers)}")
        self.trainers, self.workers, self.config = list(trainers), list(workers), config
        self.ranks = self.trainers + self.workers
        self.labels = [f"trainer {i} (rank {i})" for i in range(len(trainers))] + [
            f"worker {j} (rank {len(trainers) + j})" for j in range(len(workers))]
        self.version = 0
        self.broken: str | None = None
        self._store = self._socket = None

    def setup(self) -> dict:
        """Describe, plan, rendezvous and connect; returns a summary of the plan."""
        start, cfg = time.perf_counter(), self.config
        T, N = len(self.trainers), len(self.workers)
        blobs = call_all(self.ranks, "_rl_sync_describe",
                         [(i, T) for i in range(T)] + [(j, N) for j in range(N)], cfg.init_timeout_s,
                         self.labels, "init (describe)")
        reports = [decode(SideReport, b) for b in blobs]
        check_agreement(reports[T:], offset=T)
        sources = merge_sources(reports[:T])
        destinations = [SideSpec(t.name, t.dtype, t.shape, t.layout.to_layout().shifted(T)) for t in reports[T].tensors]
        self.schedule = build_schedule(plan_model(join_specs(sources, destinations)), cfg.bucket_bytes, cfg.coalesce_bytes)
        self.names = set(self.schedule.plan.index)
        info = self._init_info([r.device for r in reports])
        plan_ref = ray.put(encode(PlanInfo.from_schedule(self.schedule), compress=True))
        devices = [r.device for r in reports]
        call_all(self.ranks, "_rl_sync_connect",
                 [(encode(replace(info, rank=i)), plan_ref, cfg.bind_host, devices[i]) for i in range(T + N)],
                 cfg.init_timeout_s, self.labels, "init (connect)")
        stats = self.schedule.plan.stats
        return {
            "tensors": len(self.schedule.plan), "buckets": self.schedule.num_buckets, "transport": info.transport,
            "world_size": T + N, "plan_bytes": stats.total_bytes, "broadcast_bytes": stats.broadcast_bytes,
            "fallbacks": sorted({n for r in reports[T:] for n in r.fallbacks}),
            "seconds": time.perf_counter() - start,
        }

    def _init_info(self, devices: list[str]) -> InitInfo:
        cfg, T = self.config, len(self.trainers)
        on_cuda = all(d.startswith("cuda") for d in devices)
        ids = self._nccl_ids() if cfg.transport == "nccl" or (cfg.transport == "auto" and on_cuda) else None
        if cfg.transport == "nccl" and ids is None:
            raise SyncError("transport 'nccl' was asked for, but trainer 0 cannot create an NCCL id (is CuPy installed?)")
        transport = "nccl" if ids is not None else "gloo"
        host = cfg.rendezvous_host or ray.util.get_node_ip_address()
        port = 0
        if transport == "gloo":
            self._socket = _listen(host, cfg.rendezvous_port)
            port = self._socket.getsockname()[1]
            self._store = dist.TCPStore(host, port, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=cfg.init_timeout_s),
                                        master_listen_fd=self._socket.fileno())
        ids = ids or ((), ())
        return InitInfo(rank=0, world_size=T + len(self.workers), num_trainers=T, transport=transport,
                        store_host=host, store_port=port, prefix=f"rl-sync-{uuid.uuid4().hex[:12]}",
                        nccl_id=ids[0], nccl_broadcast_id=ids[1], timeout_s=cfg.round_timeout_s)

    def _nccl_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Two fresh NCCL ids from trainer 0 (p2p group, broadcast group), or None without NCCL."""
        try:
            ids = ray.get(self.trainers[0]._rl_sync_nccl_ids.remote(), timeout=self.config.init_timeout_s)
        except ray.exceptions.RayError:
            return None
        return tuple(ids[0]), tuple(ids[1])

    def push(self, version: int | None, names: list[str] | None, mode: str | None) -> RoundStats:
        """Run one round on every rank; see the module docstring."""
        if self.broken is not None:
            raise SyncError(f"the sync group is broken by an earlier failure ({self.broken}); close it and create a new WeightSync")
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise ValueError(f"push: version {version} is not newer than the last applied version {self.version}")
        if names is not None:
            unknown = [n for n in names if n not in self.names]
            if unknown:
                raise ValueError(f"push: tensors {unknown[:5]} were not declared at init; the round may carry only "
                                 f"names the trainers declared ({len(self.names)} of them)")
        mode = mode or self.config.mode
        if mode not in ("m2n", "broadcast"):
            raise ValueError(f"push: mode must be 'm2n' or 'broadcast', got {mode!r}")
        blob = encode(RoundInfo(version, mode, None if names is None else tuple(names), self.config.round_timeout_s))
        start = time.perf_counter()
        try:
            results = call_all(self.ranks, "_rl_sync_run", [(blob,)] * len(self.ranks),
                               self.config.round_timeout_s + 5, self.labels, f"round {version} ({mode})")
        except SyncError as exc:
            self.broken = f"round {version}"
            raise exc
        seconds = time.perf_counter() - start
        self.version = version
        return RoundStats(version, mode, seconds, tuple(decode(RankStats, r) for r in results))

    def close(self) -> None:
        """Release every rank's transport and the rendezvous store."""
        refs = [h._rl_sync_close.remote(self.broken is not None) for h in self.ranks]
        ray.wait(refs, num_returns=len(refs), timeout=self.config.init_timeout_s)
        self._store = None
        if self._socket is not None:
            self._socket.close()
            self._socket = None
