"""The receiving side of a rank: an inference worker's live weights as destinations.

Define `rl_sync_destinations(checkpoint)`: given the trainers' checkpoint
(`{name: (torch dtype, shape)}`), return `{name: Destination}` (the
`rl_sync.bind.Binder` builds these from rules). Destinations are resolved
whenever a group forms or is repaired; rl-sync keeps the mapping returned, and
before every round a `rl_sync.rank.watch.Watch` notices what changed under it
(a `Destination` replaced in that mapping, a new parameter where its `Slot`
says the engine keeps it, a weight given new storage or laid out anew in
place) at a cost that follows what changed, and binds those names again
without re-planning. A rebound tensor holds what the engine put there, so the
worker reports no version until a round fills it: a dense round of every
tensor, a double-buffered round (the commit copies every shadow), or a
colocated round (the worker exports anew and the coordinator runs every tensor
dense); a sparse round, a round of other tensors or patches fail instead,
naming tensor and rank, before anything is written. Names bound as fallbacks
are received whole and handed to `rl_sync_load_fallbacks(pairs)`, which the
class must then define. An engine that derives state from its weights (repacked kernels,
caches) may define `rl_sync_weights_updated(names)`: it runs once the live
weights hold a round (`names`: the round's tensors, `None` for all), before
the worker reports the new version; and `rl_sync_write_modes()` (`{name:
"direct" | "reload"}`) to say which names it processes after a round.

Versions: a worker knows the version its live weights hold, and reports
`None` while a round is writing into them or after one failed part-way, until
a full round repairs it. A round's version is recorded only when the
coordinator says so (`_rl_sync_record`), once every rank finished it and the
driver still waited for it (`actors.fence`); until then the worker reports
`None`. With double buffering (`SyncConfig.double_buffer`)
rounds land in a shadow copy of every bound tensor (one extra copy of the
worker's bound bytes) and are committed into the live weights only once the
whole round succeeded, so the worker serves the previous version throughout;
fallbacks are loaded at commit. The commit copies each shadow in, or swaps the
memory behind a storage whose names the engine lists in
`rl_sync_swappable()` (`rl_sync.rank.shadow`). A staged round
(`WeightSync.stage`) runs on a thread of its own (`rl_sync.rank.background`)
while the process serves other calls, and waits for its commit.

A class that takes LoRA rounds (the group's `DescribeOptions.lora`: bind the adapter to
LoRA slots, `actors.vllm`) sets `rl_sync_takes_lora = True`; any other refuses such a group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch

from ..config.sync import DENSE_MODES, writes_every_element
from ..engine import sparse_codec
from ..engine.catch_up import joins, run_catch_up
from ..engine.sources import Entries
from ..planning.quant import is_scale_name, scale_name, scaled_name
from ..sparse.encodings import INDICES
from ..transport.cuda_ipc import WorkerExport
from ..transport.doorbell import FAILED, MOVED, SKIPPED, WRITTEN
from ..wire.codec import decode, encode
from ..wire.messages import RankStats, RoundInfo, WriteMode
from ..wire.plan_info import PlanInfo
from .background import BackgroundRound
from .kept import KeptDestinations
from .participant import Participant
from .serial import one_at_a_time
from .shadow import Shadows
from .side import DescribeOptions
from .steps import StepGate

STOP_WAIT_S = 30.0
"""How long leaving the group waits for a staged round's thread once its transport is aborted,
and a commit for the thread that already answered."""


class WorkerRank(Participant):
    """Inherit and define `rl_sync_destinations(checkpoint)`."""

    _rl_sync_kept: KeptDestinations | None = None
    _rl_sync_background: BackgroundRound | None = None
    _rl_sync_pending: tuple[str, ...] = ()
    """Fallbacks a double-buffered round received, loaded at its commit."""
    _rl_sync_version: int | None = None
    _rl_sync_written: int | None = None
    """The version of the last round written into the live weights, until it is recorded."""
    _rl_sync_ipc: WorkerExport | None = None
    _rl_sync_ipc_timeout: float = 120.0
    _rl_sync_ipc_basis: tuple[frozenset[str], int] | None = None
    """With an alternate face: the names in swapped storages and `Shadows.swaps` at the export."""
    _rl_sync_round_names: tuple[str, ...] | None = None
    _rl_sync_gate: StepGate | None = None
    rl_sync_control_group: str | None = None
    """The Ray concurrency group (`rl_sync.rank.steps.CONTROL_GROUP`) the class's actors declare
    for staged rounds' calls, so those run beside the engine's generation, which must then run
    inside `_rl_sync_steps().generating()` with its `boundary()` before each step (vLLM:
    `VllmWorkerMixin.rl_sync_generating`); None: every call waits for the one before it."""
    rl_sync_load_fallbacks: Callable[[list[tuple[str, torch.Tensor]]], None]
    """The subclass's hook taking `(name, tensor)` of each fallback a round delivered (see the
    module docstring): required when any name is bound as a fallback."""

    @one_at_a_time
    def _rl_sync_describe(
        self, side: str, side_rank: int, side_size: int, options: DescribeOptions | None = None
    ) -> bytes:
        if side == "worker":
            self._rl_sync_steps().forget()
            self._rl_sync_forget_moved()
            self._rl_sync_kept = None  # every group, and every repair, binds anew: storage may have moved
            if options is not None and (options.next_writes_all or options.lora is not None):
                # its new buffers, or the LoRA slot a binding registers anew from zeros (a repair's too),
                # hold nothing until a round writes them (no relay source)
                self._rl_sync_version = None
        return super()._rl_sync_describe(side, side_rank, side_size, options)

    def _rl_sync_new_numbering(self) -> None:
        self._rl_sync_version = None

    def _rl_sync_control_of(self, side: str) -> str:
        """The control group a worker reports (`RankReport.control_group`): its class's, where its
        commits may land mid-generation (see `rl_sync.rank.steps`)."""
        return (self.rl_sync_control_group or "") if side == "worker" else ""

    def _rl_sync_steps(self) -> StepGate:
        """When this rank's commits run against its engine's steps (`rl_sync.rank.steps`)."""
        if self._rl_sync_gate is None:
            self._rl_sync_gate = StepGate(self._rl_sync_commit_now, self._rl_sync_before_commit)
        return self._rl_sync_gate

    def _rl_sync_before_commit(self) -> None:
        """Hook: what of the next commit's work can run before it, beside the engine's steps (a
        vLLM rank hashes its waiting requests, `VllmWorkerMixin`)."""

    def _rl_sync_forget_moved(self) -> None:
        """A weight the engine moved holds what the engine put there: no version until a round."""
        if self._rl_sync_kept is not None and self._rl_sync_kept.moved():
            self._rl_sync_version = None

    def _rl_sync_leave(self, abort: bool) -> None:
        self._rl_sync_stop_background()
        self._rl_sync_forget_moved()
        super()._rl_sync_leave(abort)
        self._rl_sync_drop_export()
        self._rl_sync_kept, self._rl_sync_round_names, self._rl_sync_pending = None, None, ()

    def _rl_sync_worker_entries(self, rank: int, size: int, options: DescribeOptions) -> Entries:
        if self._rl_sync_kept is None:
            destinations = getattr(self, "rl_sync_destinations", None)
            if destinations is None:
                raise TypeError(
                    f"{type(self).__name__} must define rl_sync_destinations(checkpoint) -> {{name: Destination}}"
                )
            if options.lora is not None and not getattr(self, "rl_sync_takes_lora", False):
                raise ValueError(
                    f"worker rank {rank}: {type(self).__name__} takes no LoRA rounds (a LoRA group writes the "
                    "adapter into vLLM's LoRA slots: its workers are vLLM engine ranks, actors.vllm)"
                )
            checkpoint = {n: (getattr(torch, d), tuple(s)) for n, (d, s) in options.checkpoint.items()}
            mapping = destinations(checkpoint)
            swappable = getattr(self, "rl_sync_swappable", lambda: ())() if options.double_buffer else ()
            kept = KeptDestinations(mapping, rank, options.double_buffer, swappable)
            if kept.fallbacks and not hasattr(self, "rl_sync_load_fallbacks"):
                raise ValueError(
                    f"worker rank {rank}: {len(kept.fallbacks)} tensors fall back "
                    f"({list(kept.fallbacks)[:8]}) but {type(self).__name__} defines no "
                    "rl_sync_load_fallbacks(pairs) hook"
                )
            self._rl_sync_kept = kept
        return self._rl_sync_kept.entries

    def _rl_sync_reasons(self) -> dict[str, str]:
        kept = self._rl_sync_kept
        return {} if kept is None else {n: kept.mapping[n].reason for n in kept.fallbacks}

    def _rl_sync_swap_bytes(self) -> int:
        shadow = self._rl_sync_shadow()
        return 0 if shadow is None else shadow.swapped_bytes()

    def _rl_sync_modes(self) -> dict[str, WriteMode]:
        """`fallback` for names bound whole; else what the engine's `rl_sync_write_modes()` says
        (`direct` or `reload`), `direct` without one."""
        engine = getattr(self, "rl_sync_write_modes", None)
        modes = engine() if engine is not None else {}
        kept = self._rl_sync_kept
        names = kept.entries.endpoints if kept else {}
        fallbacks = kept.fallbacks if kept else ()
        return {n: "fallback" if n in fallbacks else modes.get(n, "direct") for n in names}

    def _rl_sync_follow(self, unfilled: Callable[[dict[str, str]], str | None]) -> bool:
        """Bind anew what the engine replaced or moved since the last round (`KeptDestinations`);
        a rebound weight holds what the engine put there, so the version is forgotten. When
        `unfilled(rebound)` says why what comes next cannot fill a rebound weight, refuse with a
        `ValueError` naming rank and tensor before anything is written. True if any was rebound."""
        if self._rl_sync_kept is None:
            return False
        try:
            rebound = self._rl_sync_kept.follow()
        except ValueError:
            self._rl_sync_version = None  # something changed that cannot be bound anew
            raise
        if not rebound:
            return False
        self._rl_sync_version = None
        why = unfilled(rebound)
        if why is not None:
            name, changed = next(iter(rebound.items()))
            raise ValueError(
                f"{self._rl_sync_kept.what}: {name!r} changed since the last round ({changed}) and was bound "
                f"anew, so it holds what the engine put there; {why}, so nothing was written; the next push "
                "runs every tensor dense (with auto_repair) or call repair()"
            )
        return True

    def _rl_sync_before_round(self, round_info: RoundInfo) -> None:
        super()._rl_sync_before_round(round_info)
        shadow = self._rl_sync_shadow()
        self._rl_sync_follow(lambda rebound: None if shadow is not None else _unfilled(round_info, rebound))
        if shadow is not None:
            shadow.prepare(writes_every_element(round_info.mode, round_info.names))
        else:
            self._rl_sync_version = self._rl_sync_written = None  # live weights are being written

    def _rl_sync_after_round(self, round_info: RoundInfo, stats: RankStats) -> RankStats:
        stats = super()._rl_sync_after_round(round_info, stats)
        kept = self._rl_sync_kept
        assert kept is not None  # a round runs on bound destinations
        names = tuple(n for n in kept.fallbacks if round_info.names is None or n in round_info.names)
        self._rl_sync_round_names = round_info.names
        if kept.shadow is None:
            self._rl_sync_load_fallbacks(names)
            self._rl_sync_updated(round_info.names)
            self._rl_sync_written = round_info.version
        else:
            self._rl_sync_pending = names
            prepare = getattr(self, "rl_sync_prepare", None)
            if prepare is not None:
                prepare(round_info.names, kept.shadow.spare_of)
        return replace(stats, fallbacks=len(names))

    def _rl_sync_load_fallbacks(self, names: tuple[str, ...]) -> None:
        """Hand the fallbacks a round received to the engine's loader."""
        if names:
            assert self._rl_sync_kept is not None  # bound with the fallbacks
            views = self._rl_sync_kept.entries.endpoints
            self.rl_sync_load_fallbacks([(n, views[n].tensor) for n in names])

    def _rl_sync_updated(self, names: tuple[str, ...] | None) -> None:
        """The live weights now hold a round's values: run the engine's hook, if it has one."""
        hook = getattr(self, "rl_sync_weights_updated", None)
        if hook is not None:
            hook(names)

    @one_at_a_time
    def _rl_sync_commit(self, version: int, timeout_s: float = STOP_WAIT_S, at_step: int | None = None) -> float:
        """Double buffering: the round completed everywhere; make it live, between two of the
        engine's steps while it generates (`rl_sync.rank.steps`; `at_step`: before that one, a
        tensor-parallel engine's, after `_rl_sync_arm`), waiting at most `timeout_s` seconds for
        that. Returns the seconds the engine stopped for it."""
        return self._rl_sync_steps().commit(version, timeout_s, at_step)

    @one_at_a_time
    def _rl_sync_arm(self, version: int, timeout_s: float) -> int:
        """A tensor-parallel engine's commit of `version`: hold at the engine's next step boundary
        (at most `timeout_s` seconds) and return its number (`rl_sync.rank.steps`)."""
        return self._rl_sync_steps().arm(version, timeout_s)

    @one_at_a_time
    def _rl_sync_disarm(self, version: int) -> None:
        """Release this rank from `_rl_sync_arm`: the commit will not come."""
        self._rl_sync_steps().disarm(version)

    def _rl_sync_commit_now(self, version: int) -> None:
        """Make the round live (by copy, or by swap where the engine allows,
        `rl_sync.rank.shadow`: a colocated trainer then writes the export's other face,
        `rl_sync.transport.cuda_ipc`; bound anew first where the engine replaced or moved a
        weight: the shadows hold every tensor whole), load its fallbacks, run the engine's hook.
        A staged round's thread must have ended."""
        self._rl_sync_end_background()
        self._rl_sync_version = self._rl_sync_written = None
        self._rl_sync_follow(lambda rebound: None)
        kept = self._rl_sync_kept
        assert kept is not None  # commits follow double-buffered rounds
        kept.commit(swap=self._rl_sync_ipc is None or self._rl_sync_ipc.alternates)
        pending, self._rl_sync_pending = self._rl_sync_pending, ()
        self._rl_sync_load_fallbacks(pending)
        self._rl_sync_updated(self._rl_sync_round_names)
        self._rl_sync_written = version

    @one_at_a_time
    def _rl_sync_record(self, version: int) -> bool:
        """The coordinator recorded `version`: report it from now on, if it is what the live
        weights hold (the last round written, nothing written since). Returns whether it is."""
        if self._rl_sync_written != version:
            return False
        self._rl_sync_version, self._rl_sync_written = version, None
        return True

    @one_at_a_time
    def _rl_sync_stage(self, round_blob: bytes, answer: Callable[[Callable[[], bytes]], bytes] | None = None) -> None:
        """Start a round into the shadows on a thread of its own and return at once: the process
        serves other calls meanwhile, the live weights stay as they are until `_rl_sync_commit`.
        `answer(run)` runs the round and passes its result on (a vLLM service rank's store)."""
        rank = self._rl_sync_worker_rank()
        if not self._rl_sync_buffered():
            raise ValueError(
                f"worker rank {rank}: a staged round lands in shadow copies, which only a double-buffered "
                "group keeps; create the group with SyncConfig(double_buffer=True)"
            )
        if self._rl_sync_background is not None:
            raise RuntimeError(
                f"worker rank {rank}: staged round {self._rl_sync_background.version} is not committed yet"
            )
        version = decode(RoundInfo, round_blob).version

        def run() -> bytes:
            return self._rl_sync_run(round_blob)

        self._rl_sync_background = BackgroundRound(version, run if answer is None else lambda: answer(run))

    @one_at_a_time
    def _rl_sync_staged(self, version: int, timeout_s: float) -> bytes:
        """The staged round's `RankStats` once it ended (waiting at most `timeout_s` seconds), or
        what it raised (a round that failed is forgotten: nothing of it is committed). The
        coordinator calls this on every worker before it commits on any, so what would refuse
        the commit is checked here: what the engine replaced or moved is bound anew
        (`_rl_sync_follow`), and what cannot be bound anew refuses before any worker commits."""
        background = self._rl_sync_background
        if background is None or background.version != version:
            raise RuntimeError(f"worker rank {self._rl_sync_worker_rank()}: no staged round {version} here")
        try:
            stats = background.result(timeout_s, self._rl_sync_worker_rank())
        except BaseException:
            if not background.running:
                self._rl_sync_background = None
            raise
        self._rl_sync_follow(lambda rebound: None)
        return stats

    def _rl_sync_end_background(self) -> None:
        """Before a commit: a staged round's thread ended well (its result was collected)."""
        background, self._rl_sync_background = self._rl_sync_background, None
        if background is not None:
            background.result(STOP_WAIT_S, self._rl_sync_worker_rank())

    def _rl_sync_stop_background(self) -> None:
        """Leaving the group: end a staged round still running (its transport aborted, its thread
        waited for within `STOP_WAIT_S`)."""
        background, self._rl_sync_background = self._rl_sync_background, None
        if background is not None and background.running:
            if self._rl_sync_session is not None:
                self._rl_sync_session.transport.abort()
            background.join(STOP_WAIT_S)

    def _rl_sync_catch_up(self, plan: bytes, round_blob: bytes) -> bytes:
        """Within a regroup (`_rl_sync_regroup`), the joining engine's catch-up by relay: a peer
        replica's rank sends what its live weights hold (its engine serving meanwhile; refused,
        sending nothing, when the engine replaced or moved one since the coordinator read the
        peer's version), a joining rank receives it as a dense round of every tensor (into its
        shadows when double-buffered, committed at once) and holds `round_blob`'s version, which
        it reports once the coordinator records it (`_rl_sync_record`). Returns this rank's
        `RankStats` (`rl_sync.engine.catch_up`)."""
        session, kept = self._rl_sync_regrouped, self._rl_sync_kept
        if session is None or kept is None:
            raise RuntimeError(f"worker rank {self._rl_sync_worker_rank()}: a catch-up runs in a regroup only")
        round_info, start = decode(RoundInfo, round_blob), time.perf_counter()
        schedule = decode(PlanInfo, plan).to_schedule()
        joining = joins(schedule, session.rank)
        try:
            if joining:
                self._rl_sync_before_round(round_info)
            elif kept.moved():
                raise ValueError(
                    f"{kept.what}: a weight changed under its binding since the coordinator read this rank's "
                    f"version {self._rl_sync_version}; nothing was sent (the next round binds it anew)"
                )
            counters = run_catch_up(session, schedule, kept.live.endpoints, kept.entries.endpoints, round_info)
        except Exception:
            session.transport.abort()
            raise
        stats = session.stats(round_info, counters, time.perf_counter() - start)
        if joining:
            stats = self._rl_sync_after_round(round_info, stats)
            if kept.shadow is not None:
                self._rl_sync_commit(round_info.version)
        return encode(stats)

    def _rl_sync_worker_rank(self) -> int:
        return self._rl_sync_sides["worker"].rank if self._rl_sync_sides and "worker" in self._rl_sync_sides else -1

    def _rl_sync_apply_patches(self, version: int, patches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write flat-index patches (local to this worker's boxes, checked by the coordinator)
        into live storage; re-validated here before the first write. Then, as after a round, the
        patched fallbacks go to the engine's loader and the engine's hook runs for the patched
        names (vLLM's processing of loader-form buffers, a LoRA slot's scaling, forgetting cached
        prefixes). Returns elements written."""
        self._rl_sync_follow(lambda rebound: "patches write only the elements they name")
        assert self._rl_sync_kept is not None  # the coordinator patches bound workers only
        views = self._rl_sync_kept.entries.endpoints
        unknown = [n for n in patches if n not in views]
        if unknown:
            raise ValueError(f"patches name tensors {unknown[:4]} this worker does not keep")
        for name, (index, _) in patches.items():
            view = views[name].tensor
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= view.numel()):
                raise ValueError(f"patch for {name!r} indexes outside this worker's {tuple(view.shape)} box")
        self._rl_sync_version = self._rl_sync_written = None
        written = 0
        for name, (index, values) in patches.items():
            view = views[name].tensor
            sparse_codec.apply(INDICES, view, index.to(view.device), values.to(view.device, view.dtype))
            written += index.numel()
        names = tuple(patches)
        self._rl_sync_load_fallbacks(tuple(n for n in names if n in self._rl_sync_kept.fallbacks))
        self._rl_sync_updated(names)
        self._rl_sync_written = version
        return written

    def _rl_sync_version_of(self) -> int | None:
        """The version the live weights fully hold, or None (never synced, torn, in flight, or
        the engine replaced or moved a bound tensor since: it holds what the engine put there)."""
        kept, ipc = self._rl_sync_kept, self._rl_sync_ipc
        if (kept is not None and kept.moved()) or (ipc is not None and ipc.moved()):
            return None
        return self._rl_sync_version

    def _rl_sync_ipc_export(self, device: str, timeout_s: float = 120.0) -> bytes:
        """Export the memory behind this worker's destinations to its colocated trainer
        (`rl_sync.transport.cuda_ipc`; double buffered with storages a commit swaps, both faces);
        descriptors wait `timeout_s` seconds to be taken."""
        views = {name: e.tensor for name, e in self._rl_sync_endpoints("worker").items()}
        shadow = self._rl_sync_shadow()
        alternate = shadow.alternate(views) if shadow is not None and shadow.storages else None
        self._rl_sync_drop_export()
        self._rl_sync_ipc = WorkerExport(views, torch.device(device), timeout_s, alternate)
        self._rl_sync_ipc_basis = (frozenset(shadow.swapped), shadow.swaps) if alternate and shadow else None
        self._rl_sync_ipc_timeout = timeout_s
        return encode(self._rl_sync_ipc.export)

    def _rl_sync_drop_export(self) -> None:
        if self._rl_sync_ipc is not None:
            self._rl_sync_ipc.close()
        self._rl_sync_ipc = None

    @one_at_a_time
    def _rl_sync_ipc_begin(self, ticket: int, writes_all: bool = False) -> bytes | None:
        """Open colocated round `ticket`: check the bindings, bring swapped shadows that hold the
        round before up to date unless the round `writes_all` (`Shadows.prepare`), then tell the
        trainer, on the pair's page (`rl_sync.transport.doorbell`), that it may write. Returns a new export when the
        memory behind the bound weights moved since the last one (a weight the engine replaced or
        moved, bound anew; memory released and re-allocated by an engine's sleep and wake): the
        old page then says `MOVED`, so a trainer waiting on it writes nothing, and the new export
        is opened for `ticket` (what a trainer that maps it before its round waits for); the round
        must be full (what the new memory holds is the engine's). A check that fails says
        `FAILED` and raises."""
        ipc = self._rl_sync_ipc
        assert ipc is not None  # colocated rounds run on an export
        shadow = self._rl_sync_shadow()
        try:
            moved = self._rl_sync_follow(lambda rebound: None) or ipc.moved() or self._rl_sync_faces_stale(shadow)
            if shadow is not None:
                shadow.prepare(writes_all)  # (before the ready event: the trainer waits for it)
        except BaseException:
            ipc.refuse(ticket, FAILED)
            raise
        self._rl_sync_written = None
        if shadow is None:
            self._rl_sync_version = None  # (double buffered, the trainer writes the shadows)
        fresh = None
        if moved:
            ipc.refuse(ticket, MOVED)
            fresh = self._rl_sync_ipc_export(str(ipc.device), self._rl_sync_ipc_timeout)
        assert self._rl_sync_ipc is not None  # (the new export, if any)
        self._rl_sync_ipc.begin(ticket, self._rl_sync_face(shadow))
        return fresh

    def _rl_sync_faces_stale(self, shadow: Shadows | None) -> bool:
        """Whether the export's alternate face no longer matches the shadows: a weight the engine
        replaced or moved made a swapped storage commit by copy since the export (`Shadows.rebound`),
        so its names' alternate views lie in memory that is no longer theirs."""
        basis = self._rl_sync_ipc_basis
        return basis is not None and (shadow is None or frozenset(shadow.swapped) != basis[0])

    def _rl_sync_face(self, shadow: Shadows | None) -> int:
        """The face of the export this round writes: the alternate one after an odd number of
        swapping commits since the export (the swapped storages' spares are then in the memory
        exported as live)."""
        basis = self._rl_sync_ipc_basis
        return 0 if basis is None or shadow is None else (shadow.swaps - basis[1]) % 2

    def _rl_sync_ipc_round(
        self, version: int, names: tuple[str, ...] | None, ticket: int, timeout_s: float, writes_all: bool = False
    ) -> bytes | None:
        """A whole colocated round on this side, run at the same time as the trainer's: open it
        (`_rl_sync_ipc_begin`; a new export when the memory moved, and nothing more), wait within
        `timeout_s` seconds for the trainer's word on the pair's page, and end it
        (`_rl_sync_ipc_end`) once the trainer wrote. When every trainer skipped the round
        (another worker's memory moved), the live weights still hold the version they held."""
        deadline = time.monotonic() + timeout_s
        held = self._rl_sync_version
        fresh = self._rl_sync_ipc_begin(ticket, writes_all)
        if fresh is not None:
            return fresh
        assert self._rl_sync_ipc is not None  # (begun above)
        ended = self._rl_sync_ipc.await_trainer(ticket, deadline)
        if ended == WRITTEN:
            self._rl_sync_ipc_end(version, names)
        elif ended == SKIPPED and not self._rl_sync_buffered():
            self._rl_sync_version = held
        return None

    @one_at_a_time
    def _rl_sync_ipc_end(self, version: int, names: tuple[str, ...] | None = None) -> None:
        """Close a colocated round: this worker's later work waits for the trainer's writes; the
        live weights hold `version` (written, not recorded), or, double buffered, the shadows do
        until `_rl_sync_commit` (what the engine replaced or moved is bound anew first, as in
        `_rl_sync_staged`)."""
        assert self._rl_sync_ipc is not None  # colocated rounds run on an export
        self._rl_sync_ipc.end(self._rl_sync_ipc_timeout if self._rl_sync_buffered() else None)
        self._rl_sync_round_names = names
        if not self._rl_sync_buffered():
            self._rl_sync_updated(names)
            self._rl_sync_written = version
        else:  # (every worker ends before any commits: what would refuse the commit refuses here)
            self._rl_sync_follow(lambda rebound: None)

    def _rl_sync_buffered(self) -> bool:
        """Whether rounds land in shadows (double buffering)."""
        return self._rl_sync_shadow() is not None

    def _rl_sync_shadow(self) -> Shadows | None:
        """Where rounds land when double buffered (`rl_sync.rank.shadow`); None otherwise."""
        return None if self._rl_sync_kept is None else self._rl_sync_kept.shadow


def _unfilled(round_info: RoundInfo, rebound: dict[str, str]) -> str | None:
    """Why a round that writes straight into the live weights leaves a rebound weight unfilled,
    or None when it writes every element of each (a dense round carrying it)."""
    if round_info.mode not in DENSE_MODES:
        return f"a {round_info.mode} round writes only what changed"
    if round_info.names is None:
        return None
    named = set(round_info.names)
    carried = named | {scale_name(n) for n in named} | {scaled_name(n) for n in named if is_scale_name(n)}
    missing = [n for n in rebound if n not in carried]
    return f"this round carries other tensors, not {missing[:4]}" if missing else None
