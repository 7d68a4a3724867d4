"""The side-agnostic part of a rank: describe, connect, run a round, close.

A process may play the trainer side, the worker side, or both (one process
holding training shards and inference weights: it joins the group as one rank
and copies its overlap locally). The side classes (`TrainerRank`,
`WorkerRank`) provide `_rl_sync_<side>_entries` and the round hooks.

Where the process runs comes from `_rl_sync_node()`: an identity of its node
(with the CUDA device it finds colocated pairs) and the address its Gloo
device binds by default (unless the group's `bind_host` says); the Ray layer
reads both off Ray.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Mapping
from types import MappingProxyType

import torch

from ..engine.runner import Counters
from ..engine.session import RankSession
from ..engine.sources import Entries
from ..transport.cuda_ipc import IpcExport, IpcTransport, device_uuid
from ..transport.doorbell import FAILED, SKIPPED, WRITTEN
from ..transport.nccl import new_unique_id
from ..wire.codec import decode, encode
from ..wire.messages import InitInfo, RankReport, RankStats, RoundInfo, WriteMode
from ..wire.plan_info import PlanInfo
from .address import interface_address
from .background import joined
from .claim import Claim, GroupTag
from .pairing import Pair
from .serial import one_at_a_time
from .side import DescribeOptions, Side

_NONE: Mapping = MappingProxyType({})
RETIRE_WAIT_S = 30.0
"""How long the next regroup, or leaving, waits for the group a switch left to finish closing."""
log = logging.getLogger("rl_sync")


def _close_quietly(session: RankSession) -> None:
    """Close a group no rank uses any more, on its device; a failure is only logged (its peers
    closed it too)."""
    try:
        with torch.cuda.device(session.device) if session.device.type == "cuda" else contextlib.nullcontext():
            session.close()
    except Exception as exc:  # (a thread's: nothing above it to raise to)
        log.warning("rl-sync: closing the group a switch left failed: %s: %s", type(exc).__name__, exc)


class Participant:
    """State and coordinator-facing methods; side classes add their entries and round hooks."""

    _rl_sync_session: RankSession | None = None
    _rl_sync_regrouped: RankSession | None = None
    """A grown or shrunk group's session, joined beside the current one (`_rl_sync_regroup`)."""
    _rl_sync_retiring: threading.Thread | None = None
    """The thread closing the session the last switch left (`_rl_sync_switch`)."""
    _rl_sync_sides: dict[str, Side] | None = None
    _rl_sync_claim: Claim | None = None
    _rl_sync_numbering: str | None = None
    """The token of the group whose version numbers this rank's version is in."""

    def _rl_sync_node(self) -> tuple[str, str]:
        """(node identity, default bind address) of this process: the host name and the
        address it resolves to, unless a subclass knows better (the Ray layer asks Ray)."""
        name = socket.gethostname()
        return name, socket.gethostbyname(name)

    def _rl_sync_entries(self, side: str) -> Entries:
        method = getattr(self, f"_rl_sync_{side}_entries", None)
        if method is None:
            raise TypeError(f"{type(self).__name__} is asked to be a {side} but does not inherit the {side} mixin")
        assert self._rl_sync_sides is not None  # entries are asked for only of a described side
        return method(*self._rl_sync_sides[side])

    def _rl_sync_endpoints(self, side: str) -> Mapping:
        """This side's endpoints; the same (empty) object every round for a side this process
        does not play, so the session keeps replaying its compiled round."""
        return self._rl_sync_entries(side).endpoints if side in (self._rl_sync_sides or {}) else _NONE

    @one_at_a_time
    def _rl_sync_describe(
        self, side: str, side_rank: int, side_size: int, options: DescribeOptions | None = None
    ) -> bytes:
        """Report this side's tensors. `options.group` names the group asking; a rank held by
        another live group refuses (`rl_sync.rank.claim`), and joining a new group first drops
        all an earlier one left. A worker's options also carry the trainers' checkpoint, the
        dims they shard, and whether to double-buffer (`DescribeOptions`). Nothing is recorded
        when describing fails."""
        options = options or DescribeOptions()
        if options.group is not None:
            self._rl_sync_join(options.group)
        previous = self._rl_sync_sides
        self._rl_sync_sides = dict(previous or {}, **{side: Side(side_rank, side_size, options)})
        try:
            reports, endpoints = self._rl_sync_entries(side)
        except BaseException:
            self._rl_sync_sides = previous
            raise
        devices = {str(e.tensor.device) for e in endpoints.values()}
        if len(devices) > 1:
            raise ValueError(f"rank {side_rank} of {type(self).__name__}: tensors span devices {sorted(devices)}")
        device = devices.pop() if devices else "cpu"
        gpu = f"{self._rl_sync_node()[0]}/{device_uuid(torch.device(device))}" if device.startswith("cuda") else ""
        modes, reasons = (self._rl_sync_modes(), self._rl_sync_reasons()) if side == "worker" else ({}, {})
        kept = sum(e.tensor.numel() * e.tensor.element_size() for e in endpoints.values()) if side == "worker" else 0
        swap = self._rl_sync_swap_bytes() if side == "worker" else 0
        control = self._rl_sync_control_of(side)
        engine_ranks, engine = self._rl_sync_engine() if control else (1, "")
        report = RankReport(
            side_rank,
            device,
            gpu,
            tuple(reports),
            modes,
            kept,
            reasons,
            swap,
            control,
            engine_ranks,
            engine,
        )
        return encode(report, compress=True)

    def _rl_sync_join(self, tag: GroupTag) -> None:
        """Be held by `tag`'s group; a new membership starts from nothing."""
        if self._rl_sync_claim is None:
            self._rl_sync_claim = Claim()
        if self._rl_sync_claim.take(tag, self._rl_sync_owner_alive):
            self._rl_sync_leave(abort=True)
        if tag.token != self._rl_sync_numbering:
            self._rl_sync_numbering = tag.token
            self._rl_sync_new_numbering()

    def _rl_sync_new_numbering(self) -> None:
        """Hook: the rank joins another group, whose versions count anew (a worker forgets the
        version it held)."""

    def _rl_sync_owner_alive(self, owner) -> bool:
        """Whether the coordinator `owner` still runs; without a way to ask, assume it does
        (the Ray layer asks Ray)."""
        return True

    def _rl_sync_modes(self) -> dict[str, WriteMode]:
        """A worker's write mode per name (see `RankReport.modes`)."""
        return {}

    def _rl_sync_reasons(self) -> dict[str, str]:
        """Why each of a worker's fallbacks falls back (see `RankReport.reasons`)."""
        return {}

    def _rl_sync_swap_bytes(self) -> int:
        """What a worker's commits swap rather than copy (see `RankReport.swap_bytes`)."""
        return 0

    def _rl_sync_control_of(self, side: str) -> str:
        """The Ray concurrency group this rank takes a staged round's calls in, playing `side`
        ('': none; a worker's may have one, `rl_sync.rank.worker`)."""
        return ""

    def _rl_sync_engine(self) -> tuple[int, str]:
        """The ranks of this worker's engine, which commit before the same step, and the engine's
        name (see `RankReport.engine_ranks`, `.engine`)."""
        return 1, ""

    def _rl_sync_ping(self) -> None:
        """Answers when the process is alive (the coordinator checks before re-forming a group)."""

    def _rl_sync_nccl_ids(self) -> tuple[list[int], list[int]]:
        return new_unique_id(), new_unique_id()

    def _rl_sync_connect(self, init: bytes, plan: bytes, bind_host: str | None, device: str) -> None:
        """Join the group with the transport `init` names (`rl_sync.transport.registry`)."""
        self._rl_sync_session = self._rl_sync_joined(init, plan, bind_host, device)

    def _rl_sync_joined(self, init: bytes, plan: bytes, bind_host: str | None, device: str) -> RankSession:
        info = decode(InitInfo, init)
        host = bind_host or (interface_address(info.interface) if info.interface else self._rl_sync_node()[1])
        return RankSession(info, decode(PlanInfo, plan), bind_host=host, device=torch.device(device))

    def _rl_sync_regroup(self, init: bytes, plan: bytes, bind_host: str | None, device: str) -> None:
        """An engine joins or leaves the group: join the grown or shrunk group (`init`, `plan`)
        beside the current one, keeping this rank's bindings and buffers; `_rl_sync_switch`
        then makes it current, or drops it."""
        self._rl_sync_switch(keep=False)
        self._rl_sync_retired()
        self._rl_sync_regrouped = self._rl_sync_joined(init, plan, bind_host, device)

    def _rl_sync_switch(self, keep: bool) -> None:
        """Make the session `_rl_sync_regroup` joined current (`keep`: every rank joined it; its
        sparse baselines carried over where the tensors are the same; the old one closes on a
        thread of its own, `_rl_sync_retire`, since no rank uses it any more), or drop it and go
        on in the current group."""
        new, self._rl_sync_regrouped = self._rl_sync_regrouped, None
        if new is None:
            return
        if not keep:
            new.transport.abort()
            new.close()
            return
        old, self._rl_sync_session = self._rl_sync_session, new
        if old is not None:
            if old.names == new.names:
                new.baselines = old.baselines
            self._rl_sync_retire(old)

    def _rl_sync_retire(self, old: RankSession) -> None:
        """Close `old`, the group a switch left, on a thread: shutting a transport down and
        collecting what it held takes a while (a tenth of a second and more for Gloo), and no rank
        needs it, so the switch returns without waiting. The next regroup and leaving wait for it
        (`_rl_sync_retired`)."""
        self._rl_sync_retired()
        self._rl_sync_retiring = threading.Thread(
            target=_close_quietly, args=(old,), name="rl-sync-retire", daemon=True
        )
        self._rl_sync_retiring.start()

    def _rl_sync_retired(self) -> None:
        """The group the last switch left is closed (waiting at most `RETIRE_WAIT_S`; past it, a
        warning, and the rank goes on: `joined`)."""
        retiring, self._rl_sync_retiring = self._rl_sync_retiring, None
        joined(retiring, RETIRE_WAIT_S, "closing the group a switch left")

    def _rl_sync_ipc_remap(self, ipc: bytes) -> None:
        """Map a colocated worker's new export (its memory moved) in place of the one before; only
        a rank joined through `cuda_ipc` has one."""
        session = self._rl_sync_session
        transport = None if session is None else session.joined
        if not isinstance(transport, IpcTransport):
            raise TypeError(
                f"{type(self).__name__}: this rank did not join its group through 'cuda_ipc', so it has "
                "no colocated worker memory to map"
            )
        transport.remap(decode(IpcExport, ipc))

    def _rl_sync_run(self, round_blob: bytes) -> bytes:
        """Run one round; in a colocated round (`RoundInfo.ticket`), first wait for the colocated
        worker and agree with the other trainers (`rl_sync.rank.pairing`), and tell the worker how
        the round ended, whatever happens."""
        session = self._rl_sync_session
        if session is None:
            raise RuntimeError("rl-sync: this process has not joined a sync group")
        round_info = decode(RoundInfo, round_blob)
        pair, ended = Pair.of(session.joined, round_info), FAILED
        try:
            self._rl_sync_before_round(round_info)
            sources, dests = self._rl_sync_endpoints("trainer"), self._rl_sync_endpoints("worker")
            if pair is not None and not pair.agreed():
                ended = SKIPPED
                return encode(session.stats(round_info, Counters(), 0.0))
            stats = session.run(round_info, sources, dests)
            ended = WRITTEN
        except Exception:
            session.transport.abort()  # the peers fail at once instead of waiting out the round
            raise
        finally:
            if pair is not None:
                pair.ring(ended)
        return encode(self._rl_sync_after_round(round_info, stats))

    def _rl_sync_before_round(self, round_info: RoundInfo) -> None:
        """Hook: a worker marks itself in flight."""

    def _rl_sync_after_round(self, round_info: RoundInfo, stats: RankStats) -> RankStats:
        """Hook: a worker records its version and hands over fallbacks."""
        return stats

    @one_at_a_time
    def _rl_sync_close(self, abort: bool = False, group: str | None = None) -> None:
        """Leave the group whose token is `group` (`None`: whichever holds this rank); a close
        from a group that no longer holds the rank changes nothing."""
        if self._rl_sync_claim is not None and not self._rl_sync_claim.release(group):
            return
        self._rl_sync_leave(abort)

    def _rl_sync_leave(self, abort: bool) -> None:
        """Drop the session (aborting its transport first if asked; closing then releases what
        the abort left) and everything described for the group."""
        self._rl_sync_switch(keep=False)
        self._rl_sync_retired()
        session, self._rl_sync_session = self._rl_sync_session, None
        self._rl_sync_sides = None
        if session is not None:
            if abort:
                session.transport.abort()
            session.close()
