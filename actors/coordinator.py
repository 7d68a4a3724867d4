"""The Coordinator actor: plans once, forms the group, orders every round.

Init: gather what every trainer and worker reports, check the workers agree,
plan and schedule, choose the transport and build its rendezvous message
(host the Gloo store, or relay NCCL ids), and connect every rank. When every
worker shares its GPU with a trainer (fractional GPUs in one placement-group
bundle), the workers instead export their live memory through CUDA IPC and
only the trainers form a group: each joins `cuda_ipc` with its mate's export
and writes its mate's destinations itself (`rl_sync.transport.cuda_ipc`); the
workers, outside the group, open and close each round around the trainers'.

Round: start the ranks together, wait for all within the round timeout, and
record the version only when every rank finished (double buffering: and
switched its live weights) and the driver still waits for the answer: the
coordinator claims the call's fence (`actors.fence`) and only then tells the
workers to record it, so no version is recorded anywhere else or later; it
answers the driver first and does both on a thread of its own, whose outcome
every later call reads before anything else (`actors.records`). A colocated
round runs on every trainer and every worker at once (`actors.colocated`). Each
driver call gives the coordinator a time budget (`actors.calls.Budget`) that
bounds all its waits together. Any failure becomes a `SyncError` naming the
ranks, the round and (from the ranks' own errors) the bucket and tensors.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace

import ray
import torch

from rl_sync.config.lora import LoraSpec
from rl_sync.config.push_args import check_mode, repeated_names
from rl_sync.config.sync import Mode, SyncConfig, writes_every_element
from rl_sync.planning.agreement import checkpoint_of, colocated_mates, group_init, merge_sources, plan_group, summarize
from rl_sync.planning.parts import parse_part
from rl_sync.planning.quant import scale_name, scaled_name
from rl_sync.rank.address import interface_address
from rl_sync.rank.claim import GroupTag
from rl_sync.rank.side import DescribeOptions
from rl_sync.rendezvous import StoreServer, new_secret
from rl_sync.sparse.auto import AutoPolicy
from rl_sync.sparse.patches import check_patch, route_patch
from rl_sync.sparse.refresh import RefreshPolicy
from rl_sync.transport.cuda_ipc import IpcExport, IpcRendezvous
from rl_sync.transport.gloo import GlooRendezvous
from rl_sync.transport.local import LocalRendezvous
from rl_sync.transport.nccl import NcclRendezvous
from rl_sync.vllm.service import Rendezvous
from rl_sync.wire.codec import decode, encode
from rl_sync.wire.messages import InitInfo, RankReport, RankStats, RoundInfo
from rl_sync.wire.plan_info import PlanInfo
from rl_sync.wire.stats import RoundStats, SyncSummary

from . import colocated
from .calls import Budget, SyncError
from .elastic import CatchUp, Formed, add_engine, remove_engine
from .fence import Fence
from .group import Membership
from .members import Member, ServiceMember, collect, failed, gather, give_controls, leave, note_controls
from .metrics import RoundMetrics
from .records import Recording
from .staging import OpenRound, Staged, commit, stage, unstage
from .steps import agreed_steps


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock


def _colocated(info: InitInfo, export: bytes) -> InitInfo:
    """`info` for a trainer whose worker shares its GPU: `cuda_ipc`, with the worker's export,
    over the transport the trainers' group uses."""
    return replace(
        info,
        transport="cuda_ipc",
        rendezvous=encode(IpcRendezvous(decode(IpcExport, export), info.transport, info.rendezvous)),
    )


class Coordinator:
    """Runs as a Ray actor (`ray.remote(Coordinator)`); driven by `WeightSync`. `workers` are
    actor handles and `VllmService`s (see `actors.group` for how ranks are assigned)."""

    def __init__(
        self, trainers: list, workers: list, config: SyncConfig, token: str | None = None, lora: LoraSpec | None = None
    ):
        self.trainer_handles, self.worker_entries, self.config = list(trainers), list(workers), config
        self.lora = lora
        """The adapter a LoRA group binds to the engines' LoRA slots (`WeightSync.create`)."""
        self.controls: dict = {}
        """Each worker actor's control group, as it reported (`actors.members.note_controls`)."""
        self._assign_ranks()
        self.metrics = RoundMetrics(config.name)
        self.repairs = 0
        self.refresh = RefreshPolicy(config.dense_refresh_every)
        """Which rounds run dense and carry every tensor, whatever was asked."""
        self.auto = AutoPolicy()
        """What `auto` rounds have learned of this group's costs (kept across repairs)."""
        self.version = 0
        self.broken: str | None = None
        self._store: StoreServer | None = None
        self._store_host = ""
        self._secret = new_secret()
        self.reply: Rendezvous | None = None
        self.budget = Budget()
        """Bounds every wait of the driver call in progress (`SyncConfig.push_budget_s`)."""
        self.staged: Staged | None = None
        """The round `stage` started and `commit` has not committed (`actors.staging`)."""
        self.tickets = 0
        """The last colocated round's ticket (`actors.colocated.next_ticket`)."""
        self.recording = Recording()
        """The workers told to record the last version, their answers not yet read."""
        self.tag = GroupTag(token or uuid.uuid4().hex[:12], config.name, ray.get_runtime_context().current_actor)
        """Names this group to its ranks (`token`: the driver's, so it can release them should this
        actor die): an actor belongs to one live group at a time."""

    def _assign_ranks(self) -> None:
        group = Membership.of(self.trainer_handles, self.worker_entries)
        self.trainers, self.workers = group.trainers, group.workers
        self.worker_ranks, self.ranks, self.firsts = group.worker_ranks, group.ranks, group.worker_firsts()
        give_controls(self.workers, self.controls)
        self.ipc = False

    def setup(self, budget_s: float | None = None) -> SyncSummary:
        """Describe, plan, rendezvous and connect, within `budget_s` seconds; returns a summary
        of the plan."""
        with self.budget.within(budget_s, "init"):
            return self._setup()

    def _setup(self) -> SyncSummary:
        start, cfg = time.perf_counter(), self.config
        T, N = len(self.trainers), len(self.worker_ranks)
        self._secret = new_secret()
        self.reply = self._reply_store()
        asked = DescribeOptions(group=self.tag, lora=self.lora)  # (trainers check the spec against their adapter)
        blobs = gather(
            self.trainers,
            lambda m: m.describe("trainer", self.trainers.index(m), T, asked, None),
            self.budget.left(cfg.init_timeout_s),
            "init (describe trainers)",
        )
        trainer_reports = [decode(RankReport, b) for b in blobs]
        sources = merge_sources(trainer_reports)
        checkpoint, sharded = checkpoint_of(sources)
        options = DescribeOptions(
            group=self.tag, checkpoint=checkpoint, sharded=sharded, double_buffer=cfg.double_buffer, lora=self.lora
        )
        blobs = gather(
            self.workers,
            lambda m: m.describe("worker", self.firsts[self.workers.index(m)], N, options, self.reply),
            self.budget.left(cfg.init_timeout_s),
            "init (bind workers)",
        )
        reports = trainer_reports + [decode(RankReport, b) for b in blobs]
        note_controls(self.workers, reports[T:], self.controls)
        self._choose_colocation(reports[:T], reports[T:])
        colocated = any(r < T for r in self.worker_ranks)
        self.schedule = plan_group(sources, reports[T:], self.worker_ranks, T, cfg)
        plan = self.schedule.plan
        self.names = set(plan.index)
        self.parts: dict[str, list[str]] = {}
        for name in plan.index:
            found = parse_part(name)
            if found is not None:
                self.parts.setdefault(found[0], []).append(name)
        self.quantized = {plan.specs[i].name: [plan.specs[i].name, scale_name(plan.specs[i].name)] for i in plan.blocks}
        world = sum(m.size for m in self.ranks)
        devices = [r.device for r in reports[:T]] + [
            reports[T + self.worker_ranks.index(r)].device for r in range(T, world)
        ]
        info = self._init_info(devices)
        self._connect(info, devices, [r.device for r in reports[T:]])
        self.formed = Formed(sources, reports[T:], devices, options, info)
        return self._summary(info, colocated, reports[T:], time.perf_counter() - start)

    def _summary(self, info: InitInfo, colocated: bool, workers: list[RankReport], seconds: float) -> SyncSummary:
        world = sum(m.size for m in self.ranks)
        return summarize(self.schedule, workers, info.transport, self.ipc, world, colocated, seconds)

    def _choose_colocation(self, trainers: list[RankReport], workers: list[RankReport]) -> None:
        mode = self.config.colocate
        mates = None if mode == "off" else colocated_mates(trainers, workers)
        if mode == "ipc" and mates is None:
            raise ValueError(
                "colocate='ipc' needs every worker on the same GPU as exactly one trainer "
                "(fractional GPUs in one placement-group bundle)"
            )
        if mates is not None:
            self.ipc, self.worker_ranks, self.ranks = True, tuple(mates), list(self.trainers)
            if not any(isinstance(m, ServiceMember) for m in self.workers):
                self._close_store()  # (a service's ranks still answer through it)

    def _connect(self, info: InitInfo, devices: list[str], worker_devices: list[str]) -> None:
        cfg = self.config
        plan_ref = ray.put(encode(PlanInfo.from_schedule(self.schedule), compress=True))
        world = sum(m.size for m in self.ranks)
        exports = dict(zip(self.worker_ranks, self._ipc_exports(worker_devices))) if self.ipc else {}
        inits = [
            encode(_colocated(replace(info, rank=i), exports[i]) if i in exports else replace(info, rank=i))
            for i in range(world)
        ]
        firsts = self._rank_firsts()

        def connect(member):
            lo, hi = firsts[id(member)], firsts[id(member)] + member.size
            return member.connect(inits[lo:hi], plan_ref, cfg.bind_host, devices[lo:hi], self.reply)

        gather(self.ranks, connect, self.budget.left(cfg.init_timeout_s), "init (connect)")

    def _ipc_exports(self, worker_devices: list[str]) -> list[bytes]:
        """Every colocated worker's export; memory no other process can map fails init saying why
        (there is no other path: NCCL cannot join two ranks on one GPU)."""
        timeout = self.config.init_timeout_s
        try:
            return gather(
                self.workers,
                lambda m: m.ipc_export(self._slice(worker_devices, m), timeout, self.reply),
                self.budget.left(timeout),
                "init (CUDA IPC export)",
            )
        except SyncError as exc:
            if "IpcUnavailable" not in str(exc):
                raise
            raise SyncError(
                f"{exc}\nEvery worker shares its GPU with a trainer, so CUDA IPC is the only path between "
                "them (NCCL cannot join two ranks on one GPU). Allocate the workers' weights with "
                "PyTorch's caching allocator (expandable segments included) or VMM memory created with "
                "a POSIX file-descriptor handle type, or give the workers GPUs of their own."
            ) from exc.__cause__  # the workers' tracebacks

    def _rank_firsts(self) -> dict[int, int]:
        """The first group rank of each member that runs rounds."""
        out, rank = {}, 0
        for member in self.ranks:
            out[id(member)] = rank
            rank += member.size
        return out

    def _slice(self, per_worker_rank: list, member) -> list:
        first = self.firsts[self.workers.index(member)]
        return per_worker_rank[first : first + member.size]

    def _reply_store(self) -> Rendezvous | None:
        """The rendezvous store, opened at init when Gloo or a vLLM engine service needs it (a
        service's ranks answer through it; see `rl_sync.vllm.service`)."""
        self._close_store()
        if not any(isinstance(m, ServiceMember) for m in self.workers):
            return None
        host, port = self._open_store()
        return Rendezvous(host, port, f"rl-sync-{uuid.uuid4().hex[:12]}", self.config.init_timeout_s, self._secret)

    def _open_store(self) -> tuple[str, int]:
        """The rendezvous store's address, opened unless it is (an engine joining or leaving
        regroups on the store the group formed on)."""
        if self._store is not None:
            return self._store_host, self._store.port
        cfg = self.config
        host = cfg.rendezvous_host or (
            interface_address(cfg.interface) if cfg.interface else ray.util.get_node_ip_address()
        )
        try:
            sock = _listen(host, cfg.rendezvous_port)
        except OSError as exc:
            setting = "SyncConfig.rendezvous_host" if cfg.rendezvous_host else "the coordinator's Ray node address"
            raise ValueError(
                f"the rendezvous store cannot listen on {host}:{cfg.rendezvous_port} ({setting}, with "
                f"SyncConfig.rendezvous_port): {exc.strerror or exc}; give an address of the "
                "coordinator's node"
            ) from None
        self._store, self._store_host = StoreServer(sock, self._secret), host
        return host, self._store.port

    def _close_store(self) -> None:
        if self._store is not None:
            self._store.close()
        self._store, self.reply = None, None

    def _init_info(self, devices: list[str]) -> InitInfo:
        cfg, T = self.config, len(self.trainers)
        world = sum(m.size for m in self.ranks)
        transport, rendezvous = self._rendezvous(world, all(d.startswith("cuda") for d in devices))
        return group_init(cfg, world, T, self.worker_ranks, transport, encode(rendezvous), self._secret)

    def _rendezvous(self, world: int, on_cuda: bool) -> tuple[str, LocalRendezvous | NcclRendezvous | GlooRendezvous]:
        """The group's transport and its rendezvous message: `local` for one rank; NCCL when asked
        for, or on CUDA where trainer 0 can create NCCL ids; Gloo, on the coordinator's store,
        otherwise."""
        cfg = self.config
        if world == 1:
            return "local", LocalRendezvous()
        wants_nccl = cfg.transport == "nccl" or (cfg.transport == "auto" and on_cuda)
        nccl = self._nccl_rendezvous() if wants_nccl else None
        if nccl is not None:
            return "nccl", nccl
        if cfg.transport == "nccl":
            raise SyncError(
                "transport 'nccl' was asked for, but trainer 0 cannot create an NCCL id (is CuPy installed?)"
            )
        host, port = (self.reply.host, self.reply.port) if self.reply is not None else self._open_store()
        return "gloo", GlooRendezvous(host, port)

    def _nccl_rendezvous(self) -> NcclRendezvous | None:
        """Two fresh NCCL ids from trainer 0 (p2p group, broadcast group), or None without NCCL."""
        try:
            ids = ray.get(
                self.trainers[0].handle._rl_sync_nccl_ids.remote(), timeout=self.budget.left(self.config.init_timeout_s)
            )
        except ray.exceptions.RayError:
            return None
        return NcclRendezvous(tuple(ids[0]), tuple(ids[1]))

    def _plan_names(self, names: list[str] | None) -> list[str] | None:
        """Checkpoint names as the plan holds them: a tensor bound in parts is its parts, a
        block-quantized one its values and its scales."""
        if names is None:
            return None
        return list(
            dict.fromkeys(p for n in names for p in self.parts.get(n) or self.quantized.get(scaled_name(n)) or [n])
        )

    def _check_push(self, version: int | None, names: list[str] | None, mode: str | None) -> tuple[int, Mode]:
        """The round's version and requested mode, or `ValueError`; changes nothing."""
        version = self.version + 1 if version is None else version
        if version <= self.version:
            raise ValueError(f"push: version {version} is not newer than the last applied version {self.version}")
        unknown = [n for n in names or () if n not in self.names]
        if unknown:
            raise ValueError(
                f"push: tensors {unknown[:5]} were not declared at init; the round may carry only "
                f"names the trainers declared ({len(self.names)} of them)"
            )
        return version, check_mode(mode) or self.config.mode

    def repair(self, budget_s: float | None = None) -> SyncSummary:
        """Re-form the group after a failure, within `budget_s` seconds: abort what is left of it,
        describe every actor again (each binds anew: storage may have moved), re-plan, reconnect;
        the next round is a full dense one."""
        with self.budget.within(budget_s, "repair"):
            return self._repair()

    def _repair(self) -> SyncSummary:
        self.broken = self.broken or "a repair that did not finish"  # until it does: the next push repairs
        self._close_ranks(abort=True)
        self._assign_ranks()
        self._check_alive()
        summary = self._setup()
        self.broken = None
        self.refresh.regrouped()
        self.repairs += 1
        return summary

    def _check_alive(self) -> None:
        """Every member answers before any is asked to bind again, so a dead one is named instead
        of leaving the survivors of its engine waiting for it in a collective. An actor Ray is
        restarting (`ActorUnavailableError`) is asked again until `init_timeout_s` is spent."""
        timeout = self.budget.left(self.config.init_timeout_s)
        deadline, members = time.monotonic() + timeout, self.trainers + self.workers
        while True:
            _, failures = collect(members, lambda m: m.ping(), max(0.0, deadline - time.monotonic()))
            restarting = [m for m, e in failures if isinstance(e, ray.exceptions.ActorUnavailableError)]
            if not failures:
                return
            if len(restarting) < len(failures) or time.monotonic() + 0.5 > deadline:
                error = failed("repair (are the actors alive?)", failures, len(self.trainers + self.workers), timeout)
                raise SyncError(
                    f"{error}\nReplace a dead worker first with replace_worker(index, new_actor) (a "
                    "vLLM engine rank cannot rejoin its engine's tensor-parallel group: launch the "
                    "engine again and replace every one of its ranks); a dead trainer must be "
                    "restarted with its state."
                ) from error.__cause__
            members = restarting
            time.sleep(0.5)  # Ray is restarting them: they answer once they are back

    def replace_worker(self, index: int, handle) -> None:
        """Put a new actor (or engine service) in slot `index` of the workers passed at init; the
        group is re-formed at the next push."""
        if not 0 <= index < len(self.worker_entries):
            raise ValueError(f"replace_worker: index {index} is outside the {len(self.worker_entries)} workers")
        entries = list(self.worker_entries)
        entries[index] = handle
        Membership.of(self.trainer_handles, entries)  # refuse a bad replacement before touching the group
        self._close_ranks(abort=True)
        self.worker_entries = entries
        self._assign_ranks()
        self.broken = self.broken or f"worker {index} replaced"

    def push(
        self,
        version: int | None,
        names: list[str] | None,
        mode: str | None,
        budget_s: float | None = None,
        fence: str | None = None,
    ) -> RoundStats:
        """Run one round on every rank (repairing first if an earlier one failed), all of it within
        `budget_s` seconds, and record its version unless the driver gave up on the call (its
        `fence`, `actors.fence`). See the module docstring."""
        with self.budget.within(budget_s, "push"):
            return self._push(version, names, mode, self._fence(fence, "push"))

    def _push(
        self, version: int | None, asked_names: list[str] | None, asked_mode: str | None, fence: Fence | None
    ) -> RoundStats:
        round_ = self._open_round(version, asked_names, asked_mode, paired=True)
        try:
            results = self._run_round(round_)
            if results is None:  # a colocated worker's memory moved: mapped anew, every tensor again
                self.refresh.memory_moved()
                round_ = replace(self._open_round(version, asked_names, asked_mode, paired=True), start=round_.start)
                results = self._run_round(round_)
            if results is None:
                raise SyncError(f"{round_.what}: a colocated worker's memory moved again while the round ran anew")
            committed = self._commit(round_.version, round_.what) if self.config.double_buffer else (0.0, 0.0)
        except Exception:  # (a rank's refusal too: the round started)
            self.broken = f"round {round_.version}"
            raise
        return self._close_round(round_, results, committed, fence)

    def _fence(self, token: str | None, what: str) -> Fence | None:
        """The call's fence; `SyncError`, doing nothing, when its driver gave up on it before it
        started (it waited behind another call, or this process was stopped)."""
        if token is None:
            return None
        fence = Fence(token)
        if not fence.fresh(self.budget.seconds()) and fence.abandoned():
            fence.settle()
            raise SyncError(
                f"{what}: the driver gave up on this call before it started (its timeout_s ran out while the "
                "coordinator was busy or stopped); nothing was done"
            )
        return fence

    def _record(self, version: int, fence: Fence | None) -> None:
        """The one place a version is decided, once every rank finished its round: claim the call's
        fence (refused when the driver gave up on it: nothing is recorded and the version stays
        free), then every worker records it; both off the driver's path (`actors.records`), read
        by the next call (`settled`)."""
        self.settled()
        previous, self.version = self.version, version
        self.recording.commit(fence, self.workers, version, previous)

    @staticmethod
    def claim(fence: Fence | None, refused: str) -> None:
        """Claim the call's fence for the coordinator, before what it decides takes effect;
        `SyncError(refused)` when its driver gave up on the call first."""
        if fence is not None and not fence.commit():
            fence.settle()
            raise SyncError(refused)

    def record_on(self, members: Sequence[Member], version: int) -> None:
        """`members` (workers) record `version`, which they hold. They already hold it, so one that
        does not record it only reports no version, and the next push repairs the group: the calls
        are sent and not waited for (`actors.records`); `settled` reads their answers."""
        self.settled()
        self.recording.send(members, version)

    def settled(self) -> None:
        """What came of the last version decided (`actors.records`): the version stays the one
        before when the driver gave up first, and the group is broken where a worker did not
        record it. Called first by every call that relies on the group's state."""
        settled = self.recording.settle(self.budget.left(self.config.round_timeout_s + 5, at_least=1.0))
        if settled.version is not None:
            self.version = settled.version
        if settled.broken is not None and self.broken is None:
            self.broken = settled.broken

    def _open_round(
        self,
        version: int | None,
        asked_names: list[str] | None,
        asked_mode: str | None,
        what: str = "push",
        paired: bool = False,
    ) -> OpenRound:
        """Check the push (`what`: the driver's call), repair first if the group is broken, and
        decide the round (version, mode, tensors, why); nothing is sent yet, except, in a colocated
        group whose round cannot be `paired` (`actors.colocated.one_step`), the workers' opening of
        it."""
        self.settled()
        self._check_push(version, self._plan_names(asked_names), asked_mode)  # a refused push repairs nothing
        self._check_unstaged(what)
        if self.broken is not None:
            if not self.config.auto_repair:
                raise SyncError(f"the sync group is broken by an earlier failure ({self.broken}); call repair()")
            self._repair()
        planned = self._plan_names(asked_names)
        version, mode = self._check_push(version, planned, asked_mode)
        mode, reason = self.refresh.round_mode(mode)
        start = time.perf_counter()
        ticket, paired = colocated.next_ticket(self), paired and colocated.one_step(self)
        writes_all = writes_every_element(mode, None if planned is None else tuple(planned))
        what_ipc = f"round {version} (CUDA IPC)"
        staged = what == "stage"
        if self.ipc and not paired and colocated.begin(self, version, ticket, writes_all, what_ipc, staged):
            self.refresh.memory_moved()
        full = self.refresh.full_round(mode)
        if full is not None:
            planned, (mode, reason) = None, full
        names = None if planned is None else tuple(planned)
        dense_bytes = self._dense_bytes(names)
        if mode == "auto":
            choice = self.auto.choose(dense_bytes)
            mode, reason = ("auto" if choice.engine == "sparse" else "m2n"), f"auto: {choice.reason}"
        try:
            timeout = self.budget.left(self.config.round_timeout_s)
        except SyncError:
            self.broken = f"round {version}"  # (colocated workers may have opened it)
            raise
        blob = encode(RoundInfo(version, mode, names, timeout, self.refresh.baselines, ticket))
        return OpenRound(version, mode, names, reason, dense_bytes, start, blob, paired)

    def _close_round(
        self,
        round_: OpenRound,
        results: list[RankStats],
        committed: tuple[float, float],
        fence: Fence | None,
        seconds: float | None = None,
    ) -> RoundStats:
        """Record a round every rank finished (and committed: `_commit`'s figures) unless its
        driver gave up on it (`_record`); `seconds`: its time where it is not the wall time since
        it opened (a staged round's)."""
        self._record(round_.version, fence)
        first = self.refresh.finished(round_.mode, every_tensor=round_.names is None)
        took = time.perf_counter() - round_.start if seconds is None else seconds
        stats = RoundStats(round_.version, round_.mode, took, tuple(results), round_.reason, *committed)
        if not first and seconds is None:  # the first round pays one-time costs; a staged one shares the CPUs
            self.auto.learn(stats, round_.dense_bytes)
        self.metrics.record(stats)
        return stats

    def stage(
        self,
        version: int | None,
        names: list[str] | None,
        mode: str | None,
        budget_s: float | None = None,
        fence: str | None = None,
    ) -> tuple[int, str, str]:
        """Start a round into the workers' shadows while they serve (`actors.staging`), within
        `budget_s` seconds, unless the driver gave up on the call (`fence`); returns its version,
        mode and why that mode."""
        with self.budget.within(budget_s, "stage"):
            return stage(self, version, names, mode, self._fence(fence, "stage"))

    def unstage(self, fence: str) -> None:
        """The driver gave up on the stage call of `fence` after it staged its round: drop that
        round (`actors.staging`)."""
        unstage(self, fence)

    def commit(self, version: int, budget_s: float | None = None, fence: str | None = None) -> RoundStats:
        """Finish staged round `version` and make it live on every worker, within `budget_s`
        seconds; recorded unless the driver gave up on the call (`fence`)."""
        with self.budget.within(budget_s, "commit"):
            return commit(self, version, fence)

    def add_engine(
        self, handles: list, budget_s: float | None = None, fence: str | None = None, catch_up: CatchUp = "relay"
    ) -> SyncSummary:
        """Grow the live group by one engine's ranks (`actors.elastic`), caught up as `catch_up`
        says, within `budget_s` seconds, unless the driver gave up on the call (`fence`)."""
        with self.budget.within(budget_s, "add_engine"):
            return add_engine(self, handles, self._fence(fence, "add_engine"), catch_up)

    def remove_engine(self, handles: list, budget_s: float | None = None, fence: str | None = None) -> SyncSummary:
        """Shrink the live group by one engine's ranks (`actors.elastic`), within `budget_s` seconds,
        unless the driver gave up on the call (`fence`)."""
        with self.budget.within(budget_s, "remove_engine"):
            return remove_engine(self, handles, self._fence(fence, "remove_engine"))

    def _check_unstaged(self, what: str) -> None:
        if self.staged is not None:
            raise ValueError(
                f"{what}: round {self.staged.round.version} is staged and not committed; commit it first "
                "(StagedRound.commit())"
            )

    def _commit(self, version: int, what: str) -> tuple[float, float]:
        """Make a double-buffered round live on every worker (between two of its engine's steps
        where it generates, the same step on a tensor-parallel engine's ranks: `rl_sync.rank.steps`,
        `actors.steps`); returns the seconds the step took and the
        longest any worker's engine stopped for it (0 where workers do not say)."""
        start = time.perf_counter()
        step, wait = self.config.round_timeout_s + 5, self.budget.left(self.config.round_timeout_s)
        at_steps = agreed_steps(self.workers, version, self.budget.left(step), f"{what} commit")
        call = lambda m: m.commit(version, wait, self.reply, at_steps.get(id(m)))  # noqa: E731
        held = gather(self.workers, call, self.budget.left(step), f"{what} commit")
        return time.perf_counter() - start, max((h for h in held if isinstance(h, float)), default=0.0)

    def _dense_bytes(self, names: tuple[str, ...] | None) -> int:
        """What a dense round of `names` (None: all) sends, in proportion of the plan's bytes
        (the model's bytes are the plan's `broadcast_recv_bytes`)."""
        plan = self.schedule.plan
        if names is None:
            return plan.stats.total_bytes
        subset = sum(plan.specs[plan.index[n]].nbytes for n in names)
        return plan.stats.total_bytes * subset // max(1, plan.stats.broadcast_recv_bytes)

    def _run_round(self, round_: OpenRound) -> list[RankStats] | None:
        """The round on every rank (colocated: the workers' sides at the same time when it is
        `paired`, else around the trainers'), bounded by the round timeout (plus 5 s for the ranks
        to report) and by what the push's budget has left; the ranks' statistics, or None when a
        paired round found a worker's memory moved (`actors.colocated`)."""
        if round_.paired:
            return colocated.paired_round(self, round_)
        step = self.config.round_timeout_s + 5
        run = lambda m: m.run(round_.blob, round_.version, self.reply)  # noqa: E731
        results = [decode(RankStats, r) for r in gather(self.ranks, run, self.budget.left(step), round_.what)]
        if self.ipc:
            results = colocated.end(self, round_.version, round_.names, results, round_.what, staged=False)
        return results

    def push_patches(
        self, patches: list, version: int | None, budget_s: float | None = None, fence: str | None = None
    ) -> int:
        """Apply flat-index patches (`rl_sync.sparse.patches`) on every worker that keeps part of them,
        within `budget_s` seconds.

        Every patch is checked against the plan (name, dtype, index range, no repeats) before
        anything is sent; each worker gets only its part, in its own box's coordinates. The
        trainers' baselines no longer describe the workers, so the next sparse round is dense;
        patches that fail part-way mark the group broken (the next push repairs it with a full
        round). Returns the version applied; recorded like a round's (`push`)."""
        with self.budget.within(budget_s, "push_patches"):
            return self._push_patches(patches, version, self._fence(fence, "push_patches"))

    def _push_patches(self, patches: list, version: int | None, fence: Fence | None) -> int:
        self._check_patches(patches)
        self.settled()
        if self.refresh.needs_full_round or self.broken is not None:
            raise ValueError(
                "push_patches: the workers do not hold a full copy of the weights yet (no full round "
                "since the group formed or was repaired), so patches would land on unrelated values; "
                "push() first"
            )
        version, _ = self._check_push(version, [p.name for p in patches], "m2n")
        plan = self.schedule.plan
        checked = {}
        for patch in patches:
            spec = plan.specs[plan.index[patch.name]]
            checked[patch.name] = (spec, *check_patch(patch, spec.dtype, spec.shape))
        per_worker: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in self.worker_ranks]
        for name, (spec, index, values) in checked.items():
            for j, rank in enumerate(self.worker_ranks):
                box = spec.dst.local_box(spec.shape, rank)
                if box is not None:
                    per_worker[j][name] = route_patch(index, values, spec.shape, box)
        self.refresh.patched()
        try:
            gather(
                self.workers,
                lambda m: m.apply_patches(version, self._slice(per_worker, m)),
                self.budget.left(self.config.round_timeout_s),
                f"patches {version}",
            )
        except SyncError:
            self.broken = f"patches {version}"
            raise
        self._record(version, fence)
        return version

    def _check_patches(self, patches: list) -> None:
        """Refuse what patches cannot do right, before anything is sent."""
        if self.config.double_buffer:
            raise ValueError(
                "push_patches: not supported with double_buffer=True (patches would reach the shadow "
                "copies only); push(mode='sparse') sends only the changed elements"
            )
        names = [p.name for p in patches]
        repeated = repeated_names(names)
        if repeated:
            raise ValueError(
                f"push_patches: several patches for {repeated[:5]} in one call; merge them into one patch per tensor"
            )
        in_parts = [n for n in names if n in self.parts]
        if in_parts:
            raise ValueError(
                f"push_patches: {in_parts[:5]} are bound in parts on the workers (cut along a dim); "
                "patches into them are not supported, push(mode='sparse') is"
            )
        quantized = [n for n in names if n in self.quantized]
        if quantized:
            raise ValueError(
                f"push_patches: {quantized[:5]} are kept block-quantized (FP8) on the workers; patches "
                "carry unquantized values, push(mode='sparse') sends changed FP8 values and scales"
            )

    def versions(self) -> list[int | None]:
        """The version each worker-side rank's live weights fully hold; None: torn, in flight,
        never synced, or not answering."""
        self.settled()
        refs = [m.versions() for m in self.workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.config.init_timeout_s)
        out: list[int | None] = []
        for ref, member in zip(refs, self.workers):
            try:
                out.extend(member.results(ray.get(ref)) if ref in ready else [None] * member.size)
            except ray.exceptions.RayError:
                out.extend([None] * member.size)
        return out

    def close(self) -> None:
        """Release every rank's transport and the rendezvous store."""
        self.settled()
        self._close_ranks(abort=self.broken is not None)

    def _close_ranks(self, abort: bool) -> None:
        """Every member leaves the group (`actors.members.leave`), bounded by `init_timeout_s`; the
        rendezvous store goes with it."""
        self.settled()  # (what the workers answered before they leave)
        self.staged = None
        timeout = self.budget.left(self.config.init_timeout_s, at_least=1.0)
        leave(self.ranks + self.workers, abort, self.reply, self.tag.token, timeout)
        self._close_store()
