"""The error a sync group raises, and how a remote failure is put in words.

A rank's error reaches the driver through two Ray calls (rank to coordinator,
coordinator to driver). Each hop keeps the error's type where it is the
caller's (`ValueError`, `TypeError`) and chains the remote traceback as the
`__cause__` of what it raises (`rl_sync.wire.failure.RemoteTraceback`), so the driver's traceback
shows the coordinator's and, inside it, each failing rank's::

    try:
        sync.push()
    except ValueError as exc:
        print(exc)              # one line per failing rank
        print(exc.__cause__)    # the remote tracebacks
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

_COLOURS = re.compile(r"\x1b?\[\d+(?:;\d+)*m")
"""The terminal colour codes Ray puts around a task's name in its error text (with or without
their escape character, which some of Ray's paths drop)."""


class SyncError(RuntimeError):
    """A sync init or round failed; the message names who failed and where."""


def remote_text(exc: BaseException) -> str:
    """What a remote call's failure says in full, as Ray renders it (for a task that raised:
    the task's name, then its traceback), without terminal colour codes."""
    return _COLOURS.sub("", str(exc)).strip()


def failure_reason(exc: BaseException) -> str:
    """What a remote call's failure says, on one line: the remote exception's type and message
    (its first and last lines where the text is long)."""
    cause = getattr(exc, "cause", None)  # a task that raised: the exception itself
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in remote_text(exc).splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    summary = lines[0].split(", ray::")[0]  # an actor whose constructor raised: Ray names that task next
    return f"{type(exc).__name__}: {summary}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")


class Budget:
    """The time one driver call gave the coordinator, shared by every wait of that call.

    Typical use (inside the coordinator)::

        with self.budget.within(budget_s, "push"):
            gather(members, call, self.budget.left(step_timeout_s), what)
    """

    def __init__(self) -> None:
        self._deadline: tuple[float, float, str] | None = None

    @contextmanager
    def within(self, seconds: float | None, what: str) -> Iterator[None]:
        """Bound the waits inside by `seconds` in all (None: each step's own timeout only)."""
        self._deadline = None if seconds is None else (time.monotonic() + seconds, seconds, what)
        try:
            yield
        finally:
            self._deadline = None

    def seconds(self) -> float | None:
        """The budget of the call in progress (None: none given)."""
        return None if self._deadline is None else self._deadline[1]

    def left(self, step_s: float, at_least: float | None = None) -> float:
        """A step's timeout: `step_s`, cut to what the call's budget has left. When nothing is
        left, `SyncError` (or `at_least`, for a step that must run anyway, such as a close)."""
        if self._deadline is None:
            return step_s
        end, seconds, what = self._deadline
        left = end - time.monotonic()
        if left <= 0 and at_least is None:
            raise SyncError(
                f"{what} ran out of its {seconds:g} s budget (WeightSync timeout_s) before it was done; "
                "nothing was recorded as applied"
            )
        return min(step_s, max(left, at_least or 0.0))
