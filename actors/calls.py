"""The error a sync group raises, and how a remote failure is put in words."""

from __future__ import annotations


class SyncError(RuntimeError):
    """A sync init or round failed; the message names who failed and where."""


def failure_reason(exc: BaseException) -> str:
    """What a remote call's failure says, on one line: the remote exception's type and message
    (its first and last lines where the traceback is long)."""
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    summary = lines[0].split(", \x1b")[0].split(" [36m")[0]
    return f"{type(exc).__name__}: {summary}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")
