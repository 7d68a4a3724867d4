"""Workers recording a round's version, not waited for.

Once every rank finished a round and the coordinator claimed its fence
(`actors.fence`), each worker is told to record the version (`_rl_sync_record`).
Nothing the driver is told depends on their answers: a worker that does not
record it only reports no version, and the next push repairs the group. So
the coordinator sends those calls and answers the driver at once, and reads
the answers before it next relies on the group's state (a push, patches, an
engine joining, a close). A worker takes a coordinator's calls in the order
they were sent, so any later call (a round, `versions()`) finds the version
recorded.

    recording = Recording()
    recording.send(workers, version)            # returns at once
    ...
    why = recording.settle(timeout_s)           # None, or why the group is broken
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from .members import Member, collect


class Recording:
    """The last version sent to the workers to record, until its answers are read."""

    def __init__(self) -> None:
        self._sent: tuple[int, list[Member], dict[int, object]] | None = None

    def send(self, members: Sequence[Member], version: int) -> None:
        """Tell `members` to record `version`; the answers are read by `settle`."""
        self._sent = (version, list(members), {id(m): m.record(version) for m in members})

    def settle(self, timeout_s: float) -> str | None:
        """Read the answers of the last `send` (waiting at most `timeout_s` seconds): why the group
        is broken (the members that did not record the version), or None."""
        if self._sent is None:
            return None
        (version, members, refs), self._sent = self._sent, None
        answers, failures = collect(members, lambda m: refs[id(m)], timeout_s)
        firsts = accumulate((m.size for m in members), initial=0)
        refused = [m for m, first in zip(members, firsts) if answers[first] is False]
        if not failures and not refused:
            return None
        labels = [m.label for m, _ in failures] + [m.label for m in refused]
        return f"version {version} not recorded by {', '.join(labels)}"
