"""Members of a sync group as the coordinator reaches them: one seam, two kinds.

* `ActorMember`: a Ray actor holding one rank (ready actors, your mixin
  actors, vLLM ranks run by the external launcher); each call is the rank's
  `rl_sync.rank.SyncRank` method.
* `ServiceMember`: a vLLM engine run as a service, one handle for all its
  ranks (`actors.service`), reached through vLLM's weight-transfer calls; each
  call answers for every rank of the engine.

Every call returns a Ray ObjectRef; `results(value)` turns what it resolves
to into one entry per rank, so the coordinator waits on all members of a step
at once with one deadline (`gather`), and failures name the member and its
ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import ray

from rl_sync.rank.side import DescribeOptions
from rl_sync.vllm.service import CloseRequest, DescribeRequest, IpcRequest, Rendezvous, RoundRequest
from rl_sync.wire.codec import encode
from rl_sync.wire.failure import RemoteTraceback, kept_type
from rl_sync.wire.messages import RankReport

from .calls import SyncError, failure_reason, remote_text


class ActorMember:
    """One Ray actor, one rank."""

    size = 1

    def __init__(self, handle, label: str):
        self.handle, self.label = handle, label
        self.control: str | None = None
        """The concurrency group the actor declares for a staged round's calls (its `RankReport`
        says), which then run beside its generation (`rl_sync.rank.steps`)."""
        self.engine_ranks, self.engine = 1, ""
        """With a control group: its engine's ranks, which commit before the same step, and the
        engine's name (`RankReport.engine_ranks`, `.engine`, `actors.steps`)."""

    def _control(self, method, beside: bool = True):
        """`method` in the actor's control group, if it declares one and the call runs `beside`
        the engine's generation (a blocking round's does not: it waits for one to end)."""
        return method if self.control is None or not beside else method.options(concurrency_group=self.control)

    def results(self, value) -> list:
        return [value]

    def ping(self):
        return self.handle._rl_sync_ping.remote()

    def describe(self, side: str, first: int, side_size: int, options: DescribeOptions, reply: Rendezvous | None):
        return self.handle._rl_sync_describe.remote(side, first, side_size, options)

    def connect(
        self, inits: Sequence[bytes], plan, bind_host: str | None, devices: Sequence[str], reply: Rendezvous | None
    ):
        return self.handle._rl_sync_connect.remote(inits[0], plan, bind_host, devices[0])

    def run(self, blob: bytes, version: int, reply: Rendezvous | None):
        return self.handle._rl_sync_run.remote(blob)

    def commit(self, version: int, timeout_s: float, reply: Rendezvous | None, at_step: int | None = None):
        return self._control(self.handle._rl_sync_commit).remote(version, timeout_s, at_step)

    def arm(self, version: int, timeout_s: float):
        return self._control(self.handle._rl_sync_arm).remote(version, timeout_s)

    def disarm(self, version: int):
        return self._control(self.handle._rl_sync_disarm).remote(version)

    def stage(self, blob: bytes, version: int, reply: Rendezvous | None):
        return self._control(self.handle._rl_sync_stage).remote(blob)

    def staged(self, version: int, timeout_s: float, reply: Rendezvous | None):
        return self._control(self.handle._rl_sync_staged).remote(version, timeout_s)

    def record(self, version: int):
        """(In the control group: after a commit made mid-generation, the next round waits for it,
        `actors.records`, not for the generation.)"""
        return self._control(self.handle._rl_sync_record).remote(version)

    def versions(self):
        return self.handle._rl_sync_version_of.remote()

    def close(self, abort: bool, reply: Rendezvous | None, group: str | None = None):
        return self.handle._rl_sync_close.remote(abort, group)

    def apply_patches(self, version: int, patches: Sequence[dict]):
        return self.handle._rl_sync_apply_patches.remote(version, patches[0])

    def ipc_export(self, devices: Sequence[str], timeout_s: float, reply: Rendezvous | None):
        return self.handle._rl_sync_ipc_export.remote(devices[0], timeout_s)

    def ipc_begin(self, version: int, ticket: int, writes_all: bool, reply: Rendezvous | None, staged: bool):
        return self._control(self.handle._rl_sync_ipc_begin, beside=staged).remote(ticket, writes_all)

    def ipc_round(self, version: int, names: tuple[str, ...] | None, ticket: int, timeout_s: float, writes_all: bool):
        return self.handle._rl_sync_ipc_round.remote(version, names, ticket, timeout_s, writes_all)

    def ipc_remap(self, ipc: bytes):
        return self.handle._rl_sync_ipc_remap.remote(ipc)

    def ipc_end(self, version: int, names: tuple[str, ...] | None, reply: Rendezvous | None, staged: bool):
        return self._control(self.handle._rl_sync_ipc_end, beside=staged).remote(version, names)

    def regroup(self, init: bytes, plan, bind_host: str | None, device: str):
        return self.handle._rl_sync_regroup.remote(init, plan, bind_host, device)

    def switch(self, keep: bool):
        return self.handle._rl_sync_switch.remote(keep)

    def catch_up(self, plan: bytes, round_blob: bytes):
        return self.handle._rl_sync_catch_up.remote(plan, round_blob)


class ServiceMember:
    """A vLLM engine service: `size` ranks behind one host actor (`actors.service`)."""

    def __init__(self, service, label: str):
        self.handle, self.size, self.label = service.host, service.ranks, label
        self.double_buffer = False
        self._closes = 0

    def results(self, value) -> list:
        return list(value) if isinstance(value, (list, tuple)) else [value] * self.size

    def ping(self):
        return self.handle._rl_sync_service_ping.remote()

    def describe(self, side: str, first: int, side_size: int, options: DescribeOptions, reply: Rendezvous | None):
        if side != "worker":
            raise ValueError(f"{self.label}: a vLLM engine service can only be a worker, not a {side}")
        self.double_buffer = options.double_buffer
        request = DescribeRequest(
            first,
            side_size,
            dict(options.checkpoint),
            dict(options.sharded),
            self.double_buffer,
            self._reply(reply),
            node="",  # (the host knows it: `actors.service`)
        )
        return self.handle._rl_sync_service_describe.remote(encode(request), options.group)

    def connect(
        self, inits: Sequence[bytes], plan, bind_host: str | None, devices: Sequence[str], reply: Rendezvous | None
    ):
        return self.handle._rl_sync_service_connect.remote(tuple(inits), plan, bind_host, encode(reply))

    def run(self, blob: bytes, version: int, reply: Rendezvous | None):
        request = RoundRequest(blob, version, self._reply(reply))
        return self.handle._rl_sync_service_run.remote(encode(request), not self.double_buffer)

    def commit(self, version: int, timeout_s: float, reply: Rendezvous | None, at_step: int | None = None):
        """(Its ranks take no step agreed, `actors.steps`: vLLM's workers run them.)"""
        return self.handle._rl_sync_service_commit.remote(encode(RoundRequest(b"", version, self._reply(reply))))

    def stage(self, blob: bytes, version: int, reply: Rendezvous | None):
        return self.handle._rl_sync_service_stage.remote(encode(RoundRequest(blob, version, self._reply(reply))))

    def staged(self, version: int, timeout_s: float, reply: Rendezvous | None):
        request = RoundRequest(b"", version, replace(self._reply(reply), timeout_s=timeout_s))
        return self.handle._rl_sync_service_staged.remote(encode(request))

    def record(self, version: int):
        return self.handle._rl_sync_service_record.remote(version)

    def versions(self):
        return self.handle._rl_sync_service_versions.remote()

    def close(self, abort: bool, reply: Rendezvous | None, group: str | None = None):
        self._closes += 1
        if reply is None:
            return self.handle._rl_sync_service_ping.remote()
        return self.handle._rl_sync_service_close.remote(encode(CloseRequest(abort, self._closes, reply)), group)

    def _reply(self, reply: Rendezvous | None) -> Rendezvous:
        """The store the engine's ranks answer through, which the coordinator opens for every
        group with a service member (`Coordinator._reply_store`)."""
        assert reply is not None, f"{self.label}: no reply store"
        return reply

    def _unsupported(self, what: str):
        raise SyncError(f"{self.label}: {what} is not available for a vLLM engine service")

    def apply_patches(self, version: int, patches: Sequence[dict]):
        self._unsupported("push_patches")

    def ipc_export(self, devices: Sequence[str], timeout_s: float, reply: Rendezvous | None):
        request = IpcRequest(0, None, timeout_s, self._reply(reply))
        return self.handle._rl_sync_service_ipc_export.remote(encode(request))

    def ipc_begin(self, version: int, ticket: int, writes_all: bool, reply: Rendezvous | None, staged: bool):
        request = IpcRequest(version, None, 1.0, self._reply(reply), ticket, writes_all)
        return self.handle._rl_sync_service_ipc_begin.remote(encode(request))

    def ipc_end(self, version: int, names: tuple[str, ...] | None, reply: Rendezvous | None, staged: bool):
        request = IpcRequest(version, names, 1.0, self._reply(reply))
        return self.handle._rl_sync_service_ipc_end.remote(encode(request))

    def ipc_remap(self, ipc: bytes):
        self._unsupported("mapping a worker's memory (a trainer's step)")

    def regroup(self, init: bytes, plan, bind_host: str | None, device: str):
        self._unsupported("joining or leaving a live group")

    def switch(self, keep: bool):
        self._unsupported("joining or leaving a live group")

    def catch_up(self, plan: bytes, round_blob: bytes):
        self._unsupported("joining or leaving a live group")


Member = ActorMember | ServiceMember
"""A member of a sync group, of either kind (the coordinator calls both alike)."""


def note_controls(members: Sequence[Member], reports: Sequence[RankReport], controls: dict) -> None:
    """Record each actor member's control group and engine as its report says
    (`RankReport.control_group`, `.engine_ranks`, `.engine`; `reports`: one per rank) in
    `controls` (actor handle -> the three), and give them to the members (`give_controls`)."""
    at = 0
    for member, size in ((m, m.size) for m in members):
        if isinstance(member, ActorMember):
            report = reports[at]
            controls[member.handle] = (report.control_group or None, report.engine_ranks, report.engine)
        at += size
    give_controls(members, controls)


def give_controls(members: Sequence[Member], controls: dict) -> None:
    """Each actor member its control group and engine, as `controls` recorded them."""
    for member in members:
        if isinstance(member, ActorMember):
            member.control, member.engine_ranks, member.engine = controls.get(member.handle, (None, 1, ""))


def gather(members: Sequence, call: Callable, timeout_s: float, what: str) -> list:
    """`call(member)` on every member at once; one result per rank, or `SyncError` naming every
    member that raised or had not answered within `timeout_s` seconds."""
    results, failures = collect(members, call, timeout_s)
    if failures:
        raise failed(what, failures, len(members), timeout_s)
    return results


def collect(
    members: Sequence, call: Callable, timeout_s: float
) -> tuple[list, list[tuple[Member, ray.exceptions.RayError | None]]]:
    """`call(member)` on every member at once, waiting at most `timeout_s` seconds in all: one
    result per rank (None where its member failed) and `(member, exception or None)` for each
    member that raised (None: no answer in time; its call is cancelled)."""
    refs = [call(m) for m in members]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    results: list = []
    failures: list[tuple[Member, ray.exceptions.RayError | None]] = []
    for ref, member in zip(refs, members):
        if ref not in done:
            ray.cancel(ref, force=False)
            failures.append((member, None))
            results.extend([None] * member.size)
            continue
        try:
            results.extend(member.results(ray.get(ref)))
        except ray.exceptions.RayError as exc:
            failures.append((member, exc))
            results.extend([None] * member.size)
    return results, failures


def failed(what: str, failures: list[tuple], members: int, timeout_s: float) -> Exception:
    """The error for `failures` from `collect`: `ValueError` / `TypeError` when every failing
    member refused its input that way (bad input stays a caller's error, whichever rank found
    it), `SyncError` otherwise; the message names each member and why, and the members' own
    tracebacks are its `__cause__` (`RemoteTraceback`)."""
    lines = [
        f"{m.label}: " + (failure_reason(e) if e is not None else f"no answer within {timeout_s:.0f} s")
        for m, e in failures
    ]
    message = f"{what} failed on {len(failures)} of {members} members:\n  " + "\n  ".join(lines)
    causes = [getattr(e, "cause", None) for _, e in failures]
    error = kept_type([type(c) for c in causes], SyncError)(message)
    remote = [f"{m.label}: {remote_text(e)}" for m, e in failures if e is not None]
    error.__cause__ = RemoteTraceback("\n\n".join(remote)) if remote else None
    return error


def leave(members: Sequence[Member], abort: bool, reply: Rendezvous | None, token: str, timeout_s: float) -> None:
    """Every member (each actor once) leaves the group with `token`, waiting at most `timeout_s`
    seconds: aborting wakes peers stuck in a failed round; a member another group holds by now is
    left alone, and a dead one is skipped. An engine service's ranks leave only through `reply`
    (the group's store); without it they stay until the next group takes them over."""
    once: dict = {}
    for member in members:
        once.setdefault(member.handle, member)
    refs = [m.close(abort, reply, token) for m in once.values()]
    ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
