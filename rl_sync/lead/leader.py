"""Trainer rank 0 leading a sync group in process: plan, connect, run rounds (no Ray).

`Leader` does for a framework's processes what the Coordinator actor does for
Ray actors (see `rl_sync.lead`): it hosts the rendezvous store, has every
rank describe itself (its own trainer rank in process, the other trainer
ranks and any worker ranks through `ServiceDriver`s), plans with
`rl_sync.planning.agreement.plan_group`, connects everyone at once, and runs
each round on every rank at once, choosing its mode with the same refresh and
`auto` policies. A failed round leaves the group broken: the leader tells the
other ranks (a `close` with abort) and every later call raises; forming a new
group (the framework's init again) is the way back.

Ordering contract: every call here is matched, on every other rank, by the
framework's call on that rank (`rl_sync.lead.follower`), in the same order.

Typical use::

    leader = Leader(rank, config, secret=new_secret())
    summary = leader.form(trainers=2, workers=ServiceDriver(control, ranks=2))
    stats = leader.push()
    leader.close()
"""

from __future__ import annotations

import contextlib
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from typing import TypeVar

from ..config.push_args import check_mode
from ..config.sync import Mode, SyncConfig
from ..planning.agreement import checkpoint_of, group_init, merge_sources, plan_group, summarize
from ..rank.address import interface_address
from ..rank.side import DescribeOptions
from ..rank.trainer import TrainerRank
from ..rendezvous import MemberStore, StoreServer
from ..sparse.auto import AutoPolicy
from ..sparse.refresh import RefreshPolicy
from ..transport.gloo import GlooRendezvous
from ..transport.nccl import NcclRendezvous
from ..vllm.driver import ServiceDriver
from ..vllm.service import CloseRequest, ConnectRequest, DescribeRequest, Rendezvous, RoundRequest
from ..wire.codec import decode, encode
from ..wire.messages import RankReport, RankStats, RoundInfo
from ..wire.plan_info import PlanInfo
from ..wire.stats import RoundStats, SyncSummary
from .board import BoardControl

T = TypeVar("T")
ABORT_S = 5.0
"""How long the other ranks get to answer a close after a failure (those still waiting for a
call answer at once; those that failed or died never do)."""
REPORT_S = 5.0
"""How much longer than the round timeout the leader waits for a rank's answer."""


def store_host(config: SyncConfig) -> str:
    """Where the leader's store listens: `rendezvous_host`, else `interface`'s address, else
    this host's name's address."""
    if config.rendezvous_host:
        return config.rendezvous_host
    return interface_address(config.interface) if config.interface else socket.gethostbyname(socket.gethostname())


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"rl-sync: trainer rank 0 cannot host the rendezvous store on {host}:{port} "
            f"({exc.strerror or exc}); set SyncConfig.rendezvous_host / rendezvous_port to an address of its host"
        ) from None
    sock.listen(1024)
    return sock


def together(mine: Callable[[], T], others: Sequence[Callable[[], object]]) -> tuple[T, list]:
    """`mine()` here while every call of `others` runs on a thread of its own: its result and
    theirs, in order, once all are done; the first failure (this rank's first) is raised."""
    with ThreadPoolExecutor(max(1, len(others)), thread_name_prefix="rl-sync-lead") as pool:
        futures = [pool.submit(call) for call in others]
        try:
            result = mine()
        finally:
            errors = [f.exception() for f in futures]
    failure = next((e for e in errors if e is not None), None)
    if failure is not None:
        raise failure
    return result, [f.result() for f in futures]


class Leader:
    """Trainer rank 0 of a led group (see the module docstring)."""

    def __init__(self, rank: TrainerRank, config: SyncConfig, secret: bytes):
        self.rank, self.config, self.secret, self.trainers = rank, config, secret, 1
        host = store_host(config)
        self.store = StoreServer(_listen(host, config.rendezvous_port), secret)
        self.reply = Rendezvous(
            host, self.store.port, f"rl-sync-{uuid.uuid4().hex[:12]}", config.init_timeout_s, secret
        )
        self.followers: ServiceDriver | None = None
        self.workers: ServiceDriver | None = None
        self.refresh, self.auto = RefreshPolicy(config.dense_refresh_every), AutoPolicy()
        self.version, self.broken, self.closes = 0, "", 0
        self.summary: SyncSummary | None = None

    @property
    def address(self) -> tuple[str, int]:
        """Where the store listens: what the other ranks connect to."""
        return self.reply.host, self.reply.port

    def board(self, name: str, ranks: int, rank_name: Callable[[int], str], first: int = 0) -> ServiceDriver:
        """A driver for `ranks` ranks in processes of their own that follow posts under
        `self.reply.prefix + "/" + name` (`rl_sync.lead.board`); `rank_name(first + i)` names
        the i-th in errors."""
        store = MemberStore(*self.address, self.secret, timeout_s=self.config.init_timeout_s)
        control = BoardControl(store, f"{self.reply.prefix}/{name}")
        return ServiceDriver(control, ranks, f"rl-sync {name}", lambda i: rank_name(first + i))

    def _drivers(self) -> list[ServiceDriver]:
        return [d for d in (self.followers, self.workers) if d is not None and d.ranks]

    def _reply(self, driver: ServiceDriver, timeout_s: float | None = None) -> Rendezvous:
        """Where `driver`'s ranks answer: a prefix of its own (each numbers its ranks from 0)."""
        side = "trainers" if driver is self.followers else "workers"
        return replace(self.reply, prefix=f"{self.reply.prefix}/{side}", timeout_s=timeout_s or self.reply.timeout_s)

    def form(self, trainers: int, workers: ServiceDriver) -> SyncSummary:
        """Describe, plan and connect `trainers` trainer ranks (this one and the others, which
        follow posts under `trainers`) and `workers`' ranks, within the config's init timeouts;
        on failure the other ranks are told to leave and the error is raised here."""
        self.trainers, self.workers = trainers, workers
        self.followers = self.board("trainers", trainers - 1, "trainer rank {}".format, first=1)
        try:
            self.summary = self._form()
        except BaseException as exc:
            self._give_up(f"init: {type(exc).__name__}")
            raise
        return self.summary

    def _form(self) -> SyncSummary:
        start, cfg, T = time.perf_counter(), self.config, self.trainers
        assert self.workers is not None and self.followers is not None  # set by form
        mine = self.rank._rl_sync_describe("trainer", 0, T, DescribeOptions())
        theirs = (
            self.followers.describe(DescribeRequest(1, T, {}, {}, False, self._reply(self.followers), node=""))
            if T > 1
            else []
        )
        trainers = [decode(RankReport, b) for b in [mine, *theirs]]
        sources = merge_sources(trainers)
        checkpoint, sharded = checkpoint_of(sources)
        asked = DescribeRequest(
            0, self.workers.ranks, checkpoint, sharded, cfg.double_buffer, self._reply(self.workers), node=""
        )  # (node unknown here: no colocated CUDA IPC through a framework's client)
        workers = [decode(RankReport, b) for b in self.workers.describe(asked)]
        world = T + len(workers)
        schedule = plan_group(sources, workers, range(T, world), T, cfg)
        devices = [r.device for r in trainers + workers]
        transport, rendezvous = self._rendezvous(devices)
        info = group_init(cfg, world, T, range(T, world), transport, encode(rendezvous), self.secret)
        inits = [encode(replace(info, rank=i)) for i in range(world)]
        plan = encode(PlanInfo.from_schedule(schedule), compress=True)
        connects = [
            (self.followers, ConnectRequest(tuple(inits[1:T]), plan, cfg.bind_host, self._reply(self.followers))),
            (self.workers, ConnectRequest(tuple(inits[T:]), plan, cfg.bind_host, self._reply(self.workers))),
        ]
        together(
            lambda: self.rank._rl_sync_connect(inits[0], plan, cfg.bind_host, trainers[0].device),
            [partial(d.connect, r) for d, r in connects if d.ranks],
        )
        self.schedule = schedule
        return summarize(schedule, workers, transport, False, world, False, time.perf_counter() - start)

    def _rendezvous(self, devices: list[str]) -> tuple[str, GlooRendezvous | NcclRendezvous]:
        """NCCL ids made here when asked for, or with every rank on CUDA (`auto`) and CuPy here;
        Gloo over the leader's store otherwise."""
        transport = self.config.transport
        if transport == "nccl" or (transport == "auto" and all(d.startswith("cuda") for d in devices)):
            try:
                ids = self.rank._rl_sync_nccl_ids()
                return "nccl", NcclRendezvous(tuple(ids[0]), tuple(ids[1]))
            except ImportError:
                if transport == "nccl":
                    raise ValueError("SyncConfig.transport 'nccl' needs CuPy on trainer rank 0") from None
        return "gloo", GlooRendezvous(*self.address)

    def push(self, mode: str | None = None) -> RoundStats:
        """One round of every tensor, at the next version, on every rank at once; `mode` (None:
        the config's) as the refresh and `auto` policies allow."""
        if self.broken:
            raise RuntimeError(
                f"rl-sync: the group is broken by an earlier failure ({self.broken}); shut the weight "
                "transfer down and initialize it again"
            )
        if self.summary is None:
            raise RuntimeError("rl-sync: push before the group was formed; form() it first")
        version, dense = self.version + 1, self.schedule.plan.stats.total_bytes
        asked: Mode = check_mode(mode) or self.config.mode
        ran, reason = self.refresh.round_mode(asked)
        ran, reason = self.refresh.full_round(ran) or (ran, reason)
        if ran == "auto":
            choice = self.auto.choose(dense)
            ran, reason = ("auto" if choice.engine == "sparse" else "m2n"), f"auto: {choice.reason}"
        start = time.perf_counter()
        try:
            ranks = self._round(RoundInfo(version, ran, None, self.config.round_timeout_s, self.refresh.baselines))
        except BaseException as exc:
            self._give_up(f"round {version}: {type(exc).__name__}")
            raise
        self.version = version
        stats = RoundStats(version, ran, time.perf_counter() - start, tuple(ranks), reason)
        if not self.refresh.finished(ran, every_tensor=True):
            self.auto.learn(stats, dense)
        return stats

    def _round(self, info: RoundInfo) -> list[RankStats]:
        blob = encode(info)
        requests = {
            id(d): RoundRequest(blob, info.version, self._reply(d, info.timeout_s + REPORT_S)) for d in self._drivers()
        }
        mine, answers = together(
            lambda: self.rank._rl_sync_run(blob), [partial(d.run, requests[id(d)]) for d in self._drivers()]
        )
        if self.config.double_buffer:
            assert self.workers is not None  # set by form
            self.workers.commit(requests[id(self.workers)])
        return [decode(RankStats, b) for b in [mine, *(b for a in answers for b in a)]]

    def _give_up(self, why: str) -> None:
        """Mark the group broken and have every other rank leave it (aborting what it waits in);
        bounded, and quiet: the failure that led here is what is raised."""
        self.broken = why
        with contextlib.suppress(Exception):  # ranks that failed already, or never answer: the caller's error says why
            self._close(abort=True)

    def close(self) -> None:
        """Every rank leaves the group; the store closes."""
        try:
            if not self.broken:
                self._close(abort=False)
        finally:
            self.rank._rl_sync_close()
            self.store.close()

    def _close(self, abort: bool) -> None:
        """Every rank leaves; after a failure (`abort`) the others get `ABORT_S` to answer."""
        self.closes += 1
        timeout = min(ABORT_S, self.reply.timeout_s) if abort else None
        self.rank._rl_sync_close(abort=abort)
        closes = [partial(d.close, CloseRequest(abort, self.closes, self._reply(d, timeout))) for d in self._drivers()]
        together(lambda: None, closes)
