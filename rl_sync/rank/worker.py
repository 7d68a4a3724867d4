"""The receiving side of a rank: an inference worker's live weights as destinations.

Define `rl_sync_destinations(checkpoint)`: given the trainers' checkpoint
(`{name: (torch dtype, shape)}`), return `{name: Destination}` (the
`rl_sync.bind.Binder` builds these from rules). Destinations are resolved
whenever a group forms or is repaired and must stay the live storage while it
lasts. Names bound as fallbacks are received whole
and handed to `rl_sync_load_fallbacks(pairs)`, which the class must then
define. An engine that derives state from its weights (repacked kernels,
caches) may define `rl_sync_weights_updated(names)`: it runs once the live
weights hold a round (`names`: the round's tensors, `None` for all), before
the worker reports the new version; and `rl_sync_write_modes()` (`{name:
"direct" | "reload"}`) to say which names it processes after a round.

Versions: a worker knows the version its live weights hold, and reports
`None` while a round is writing into them or after one failed part-way, until
a full round repairs it. With double buffering (`SyncConfig.double_buffer`)
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
from typing import NamedTuple

import torch

from ..config.sync import DENSE_MODES
from ..engine import sparse_codec
from ..engine.catch_up import run_catch_up
from ..engine.sources import Entries, worker_entries
from ..sparse.encodings import INDICES
from ..storage import geometry, owner
from ..transport.cuda_ipc import WorkerExport
from ..wire.codec import decode, encode
from ..wire.messages import RankStats, RoundInfo, WriteMode
from ..wire.plan_info import PlanInfo
from .background import BackgroundRound
from .participant import Participant
from .shadow import Shadows
from .side import DescribeOptions

STOP_WAIT_S = 30.0
"""How long leaving the group waits for a staged round's thread once its transport is aborted,
and a commit for the thread that already answered."""


class BoundOwner(NamedTuple):
    """A tensor the engine owns behind a bound destination, as it was when the group bound it."""

    name: str
    tensor: torch.Tensor
    """The owning tensor (a parameter, for a slice of one): what an engine moves."""
    geometry: tuple
    """Its `rl_sync.storage.geometry` at binding time."""


class WorkerRank(Participant):
    """Inherit and define `rl_sync_destinations(checkpoint)`."""

    _rl_sync_cached: Entries | None = None
    _rl_sync_fallbacks: tuple[str, ...] = ()
    _rl_sync_shadow: Shadows | None = None
    _rl_sync_background: BackgroundRound | None = None
    _rl_sync_pending: tuple[str, ...] = ()
    """Fallbacks a double-buffered round received, loaded at its commit."""
    _rl_sync_version: int | None = None
    _rl_sync_ipc: WorkerExport | None = None
    _rl_sync_ipc_timeout: float = 120.0
    _rl_sync_round_names: tuple[str, ...] | None = None
    _rl_sync_owners: tuple[BoundOwner, ...] = ()
    rl_sync_load_fallbacks: Callable[[list[tuple[str, torch.Tensor]]], None]
    """The subclass's hook taking `(name, tensor)` of each fallback a round delivered (see the
    module docstring): required when any name is bound as a fallback."""

    def _rl_sync_describe(
        self, side: str, side_rank: int, side_size: int, options: DescribeOptions | None = None
    ) -> bytes:
        if side == "worker":
            self._rl_sync_forget_moved()
            self._rl_sync_cached = None  # every group, and every repair, binds anew: storage may have moved
        return super()._rl_sync_describe(side, side_rank, side_size, options)

    def _rl_sync_new_numbering(self) -> None:
        self._rl_sync_version = None

    def _rl_sync_forget_moved(self) -> None:
        """A weight the engine moved holds what the engine put there: no version until a round."""
        if self._rl_sync_storage_moved():
            self._rl_sync_version = None

    def _rl_sync_leave(self, abort: bool) -> None:
        self._rl_sync_stop_background()
        self._rl_sync_forget_moved()
        super()._rl_sync_leave(abort)
        self._rl_sync_drop_export()
        self._rl_sync_cached, self._rl_sync_shadow, self._rl_sync_pending = None, None, ()
        self._rl_sync_fallbacks, self._rl_sync_round_names, self._rl_sync_owners = (), None, ()

    def _rl_sync_worker_entries(self, rank: int, size: int, options: DescribeOptions) -> Entries:
        if self._rl_sync_cached is None:
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
            bound = destinations(checkpoint)
            self._rl_sync_fallbacks = tuple(n for n, d in bound.items() if d.fallback)
            if self._rl_sync_fallbacks and not hasattr(self, "rl_sync_load_fallbacks"):
                raise ValueError(
                    f"worker rank {rank}: {len(self._rl_sync_fallbacks)} tensors fall back "
                    f"({list(self._rl_sync_fallbacks)[:8]}) but {type(self).__name__} defines no "
                    "rl_sync_load_fallbacks(pairs) hook"
                )
            reports, endpoints = worker_entries(bound, rank)
            self._rl_sync_owners = tuple(
                BoundOwner(name, owner(d.local), geometry(owner(d.local)))
                for name, d in bound.items()
                if d.local is not None and not d.fallback
            )
            if options.double_buffer:
                swappable = getattr(self, "rl_sync_swappable", lambda: ())()
                self._rl_sync_shadow = Shadows.of(endpoints, self._rl_sync_fallbacks, swappable)
                endpoints = self._rl_sync_shadow.endpoints
            self._rl_sync_cached = Entries(reports, endpoints)
        return self._rl_sync_cached

    def _rl_sync_modes(self) -> dict[str, WriteMode]:
        """`fallback` for names bound whole; else what the engine's `rl_sync_write_modes()` says
        (`direct` or `reload`), `direct` without one."""
        engine = getattr(self, "rl_sync_write_modes", None)
        modes = engine() if engine is not None else {}
        names = self._rl_sync_cached.endpoints if self._rl_sync_cached else {}
        return {n: "fallback" if n in self._rl_sync_fallbacks else modes.get(n, "direct") for n in names}

    def _rl_sync_check_storage(self) -> None:
        """Refuse to write when the engine moved a bound tensor since the group bound it (new
        storage, shape or strides: `p.data = ...`, a reload that reallocates); nothing is
        written, the round fails, and the repair that follows binds the new storage."""
        moved = self._rl_sync_storage_moved()
        if moved:
            name, tensor = moved[0]
            assert self._rl_sync_sides is not None  # storage is bound only in a group
            rank = self._rl_sync_sides["worker"].rank
            raise ValueError(
                f"worker rank {rank}: the storage bound for {name!r} moved since the group bound it "
                f"(now shape {tuple(tensor.shape)}, strides {tensor.stride()}, {tensor.dtype}; the "
                "engine reallocated or resized its weights); nothing was written, and the next push "
                "binds the new storage (with auto_repair) or call repair()"
            )

    def _rl_sync_before_round(self, round_info: RoundInfo) -> None:
        super()._rl_sync_before_round(round_info)
        self._rl_sync_check_storage()
        if self._rl_sync_shadow is None:
            self._rl_sync_version = None  # live weights are being written
        else:
            self._rl_sync_shadow.prepare(round_info.mode in DENSE_MODES and round_info.names is None)

    def _rl_sync_after_round(self, round_info: RoundInfo, stats: RankStats) -> RankStats:
        stats = super()._rl_sync_after_round(round_info, stats)
        names = tuple(n for n in self._rl_sync_fallbacks if round_info.names is None or n in round_info.names)
        self._rl_sync_round_names = round_info.names
        if self._rl_sync_shadow is None:
            self._rl_sync_load_fallbacks(names)
            self._rl_sync_updated(round_info.names)
            self._rl_sync_version = round_info.version
        else:
            self._rl_sync_pending = names
            prepare = getattr(self, "rl_sync_prepare", None)
            if prepare is not None:
                prepare(round_info.names, self._rl_sync_shadow.spare_of)
        return replace(stats, fallbacks=len(names))

    def _rl_sync_load_fallbacks(self, names: tuple[str, ...]) -> None:
        """Hand the fallbacks a round received to the engine's loader."""
        if names:
            assert self._rl_sync_cached is not None  # bound with the fallbacks
            views = self._rl_sync_cached.endpoints
            self.rl_sync_load_fallbacks([(n, views[n].tensor) for n in names])

    def _rl_sync_updated(self, names: tuple[str, ...] | None) -> None:
        """The live weights now hold a round's values: run the engine's hook, if it has one."""
        hook = getattr(self, "rl_sync_weights_updated", None)
        if hook is not None:
            hook(names)

    def _rl_sync_commit(self, version: int) -> None:
        """Double buffering: the round completed everywhere; make it live (by copy, or by swap where
        the engine allows and no other process maps the memory: `rl_sync.rank.shadow`), load its
        fallbacks, run the engine's hook. A staged round's thread must have ended."""
        self._rl_sync_end_background()
        self._rl_sync_check_storage()
        shadow, cached = self._rl_sync_shadow, self._rl_sync_cached
        assert shadow is not None and cached is not None  # commits follow double-buffered rounds
        if shadow.commit(swap=self._rl_sync_ipc is None):
            self._rl_sync_owners = tuple(o._replace(geometry=geometry(o.tensor)) for o in self._rl_sync_owners)
            self._rl_sync_cached = cached._replace(endpoints=shadow.endpoints)
        pending, self._rl_sync_pending = self._rl_sync_pending, ()
        self._rl_sync_load_fallbacks(pending)
        self._rl_sync_updated(self._rl_sync_round_names)
        self._rl_sync_version = version

    def _rl_sync_stage(self, round_blob: bytes, answer: Callable[[Callable[[], bytes]], bytes] | None = None) -> None:
        """Start a round into the shadows on a thread of its own and return at once: the process
        serves other calls meanwhile, the live weights stay as they are until `_rl_sync_commit`.
        `answer(run)` runs the round and passes its result on (a vLLM service rank's store)."""
        rank = self._rl_sync_worker_rank()
        if self._rl_sync_shadow is None:
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

    def _rl_sync_staged(self, version: int, timeout_s: float) -> bytes:
        """The staged round's `RankStats` once it ended (waiting at most `timeout_s` seconds), or
        what it raised."""
        background = self._rl_sync_background
        if background is None or background.version != version:
            raise RuntimeError(f"worker rank {self._rl_sync_worker_rank()}: no staged round {version} here")
        return background.result(timeout_s, self._rl_sync_worker_rank())

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
        replica's rank sends what its live weights hold (its engine serving meanwhile), a joining
        rank receives it (into its shadows when double-buffered) and makes it live as
        `round_blob`'s version (`rl_sync.engine.catch_up`). Returns this rank's `RankStats`."""
        session, cached = self._rl_sync_regrouped, self._rl_sync_cached
        if session is None or cached is None:
            raise RuntimeError(f"worker rank {self._rl_sync_worker_rank()}: a catch-up runs in a regroup only")
        round_info, start = decode(RoundInfo, round_blob), time.perf_counter()
        live = cached.endpoints if self._rl_sync_shadow is None else self._rl_sync_shadow.live
        try:
            counters, joining = run_catch_up(session, decode(PlanInfo, plan), live, cached.endpoints, round_info)
        except Exception:
            session.transport.abort()
            raise
        stats = session.stats(round_info, counters, time.perf_counter() - start)
        if joining:
            stats = self._rl_sync_after_round(round_info, stats)
            if self._rl_sync_shadow is not None:
                self._rl_sync_commit(round_info.version)
        return encode(stats)

    def _rl_sync_worker_rank(self) -> int:
        return self._rl_sync_sides["worker"].rank if self._rl_sync_sides and "worker" in self._rl_sync_sides else -1

    def _rl_sync_apply_patches(self, version: int, patches: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
        """Write flat-index patches (local to this worker's boxes, checked by the coordinator)
        into live storage; re-validated here before the first write. Returns elements written."""
        self._rl_sync_check_storage()
        assert self._rl_sync_cached is not None  # the coordinator patches bound workers only
        views = self._rl_sync_cached.endpoints
        unknown = [n for n in patches if n not in views]
        if unknown:
            raise ValueError(f"patches name tensors {unknown[:4]} this worker does not keep")
        for name, (index, _) in patches.items():
            view = views[name].tensor
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= view.numel()):
                raise ValueError(f"patch for {name!r} indexes outside this worker's {tuple(view.shape)} box")
        self._rl_sync_version = None
        written = 0
        for name, (index, values) in patches.items():
            view = views[name].tensor
            sparse_codec.apply(INDICES, view, index.to(view.device), values.to(view.device, view.dtype))
            written += index.numel()
        self._rl_sync_version = version
        return written

    def _rl_sync_version_of(self) -> int | None:
        """The version the live weights fully hold, or None (never synced, torn, in flight, or
        the engine moved a bound tensor since: its new storage holds what the engine put there)."""
        if self._rl_sync_storage_moved() or (self._rl_sync_ipc is not None and self._rl_sync_ipc.moved()):
            return None
        return self._rl_sync_version

    def _rl_sync_storage_moved(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) of each bound tensor with other storage, shape, strides or dtype than
        when it was bound."""
        return [(o.name, o.tensor) for o in self._rl_sync_owners if geometry(o.tensor) != o.geometry]

    def _rl_sync_ipc_export(self, device: str, timeout_s: float = 120.0) -> bytes:
        """Export the memory behind this worker's destinations to its colocated trainer
        (`rl_sync.transport.cuda_ipc`); descriptors wait `timeout_s` seconds to be taken."""
        views = {name: e.tensor for name, e in self._rl_sync_endpoints("worker").items()}
        self._rl_sync_drop_export()
        self._rl_sync_ipc = WorkerExport(views, torch.device(device), timeout_s)
        self._rl_sync_ipc_timeout = timeout_s
        return encode(self._rl_sync_ipc.export)

    def _rl_sync_drop_export(self) -> None:
        if self._rl_sync_ipc is not None:
            self._rl_sync_ipc.close()
        self._rl_sync_ipc = None

    def _rl_sync_ipc_begin(self) -> bytes | None:
        """Open a colocated round: the trainer may write once this returns. Returns a new export
        when the memory behind the bound weights was released and re-allocated since the last
        one (an engine's sleep and wake): the trainer must map it before writing, and the round
        must be full (what the new memory holds is the engine's)."""
        self._rl_sync_check_storage()
        self._rl_sync_version = None
        assert self._rl_sync_ipc is not None  # colocated rounds run on an export
        fresh = None
        if self._rl_sync_ipc.moved():
            fresh = self._rl_sync_ipc_export(str(self._rl_sync_ipc.device), self._rl_sync_ipc_timeout)
        self._rl_sync_ipc.begin()
        return fresh

    def _rl_sync_ipc_end(self, version: int, names: tuple[str, ...] | None = None) -> None:
        assert self._rl_sync_ipc is not None  # colocated rounds run on an export
        self._rl_sync_ipc.end()
        self._rl_sync_updated(names)
        self._rl_sync_version = version
