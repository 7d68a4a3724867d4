"""A round's version taking effect, off the driver's path: the fence's claim, then the workers' records.

Once every rank finished a round, the coordinator claims the call's fence
(`actors.fence`) and only then tells each worker to record the version
(`_rl_sync_record`). Nothing the driver is told depends on either: a driver
still waiting for the answer cannot have claimed the fence, so the
coordinator's claim lands; a driver that gave up claimed it first, and then
neither the answer nor anything else reaches it, and the version is not
recorded; a worker that does not record it only reports no version, and the
next push repairs the group. So the coordinator answers at once and claims,
then sends the records, on a thread of its own (`commit`), and reads what came
of them (`settle`) before it next relies on the group's state (any later
call). A worker takes a coordinator's calls in the order they were sent, so a
later call (a round, `versions()`) finds the version recorded.

    recording = Recording()
    recording.commit(fence, workers, version=3, previous=2)     # returns at once
    ...
    settled = recording.settle(timeout_s)     # before anything relies on the version
    settled.version                           # 3, or 2 when the driver gave up first
    settled.broken                            # None, or why the group is broken
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import NamedTuple

from .fence import Fence
from .members import Member, collect


class Settled(NamedTuple):
    """What came of the last version committed: the group's version now, and why it is broken."""

    version: int | None
    """The version recorded (the one before it when the driver gave up first); None: nothing was
    pending."""
    broken: str | None


@dataclass
class _Pending:
    """One version taking effect: its fence's claim, then its record calls."""

    fence: Fence | None
    members: list[Member]
    version: int
    previous: int
    refs: dict[int, object] = field(default_factory=dict)
    landed: bool | None = None
    """Whether the claim landed (None: not known yet)."""
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def run(self) -> None:
        try:
            self.landed = self.fence is None or self.fence.commit()
            if self.landed:
                self.refs = {id(m): m.record(self.version) for m in self.members}
            elif self.fence is not None:
                self.fence.settle()
        except BaseException as exc:  # (read by `settle`)
            self.error = exc


class Recording:
    """The last version committed, until what came of it is read (see the module docstring)."""

    def __init__(self) -> None:
        self._pending: _Pending | None = None

    def commit(self, fence: Fence | None, members: Sequence[Member], version: int, previous: int) -> None:
        """Claim `fence` for `version` and, once it lands, tell `members` to record it, on a thread
        of its own (`previous`: the version to go back to when the driver gave up first)."""
        pending = _Pending(fence, list(members), version, previous)
        pending.thread = threading.Thread(target=pending.run, name="rl-sync-record", daemon=True)
        self._pending = pending
        pending.thread.start()

    def send(self, members: Sequence[Member], version: int) -> None:
        """Tell `members` to record `version`, already claimed; `settle` reads their answers."""
        pending = _Pending(None, list(members), version, version)
        pending.run()
        self._pending = pending

    def settle(self, timeout_s: float) -> Settled:
        """Wait at most `timeout_s` seconds for the last commit's claim and its workers' answers."""
        pending, self._pending = self._pending, None
        if pending is None:
            return Settled(None, None)
        if pending.thread is not None:
            pending.thread.join(timeout_s)
            if pending.thread.is_alive():
                return Settled(pending.version, f"version {pending.version}: its fence's claim did not finish in time")
        if pending.error is not None:
            return Settled(pending.version, f"version {pending.version} not recorded: {pending.error}")
        if not pending.landed:
            return Settled(pending.previous, None)
        return Settled(pending.version, _refused(pending, timeout_s))


def _refused(pending: _Pending, timeout_s: float) -> str | None:
    """Why the group is broken: the members that did not record the version; None if all did."""
    answers, failures = collect(pending.members, lambda m: pending.refs[id(m)], timeout_s)
    firsts = accumulate((m.size for m in pending.members), initial=0)
    refused = [m for m, first in zip(pending.members, firsts) if answers[first] is False]
    if not failures and not refused:
        return None
    labels = [m.label for m, _ in failures] + [m.label for m in refused]
    return f"version {pending.version} not recorded by {', '.join(labels)}"
