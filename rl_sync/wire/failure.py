"""Failures that cross processes: what a rank reports of an exception, and the remote
traceback chained under the error raised where it arrives.

A vLLM engine service's rank answers a failed call with `ERROR` followed by an encoded
`RankFailure` (`rl_sync.vllm.service`); the driver raises the rank's own type when it is a
caller's mistake (`ValueError`, `TypeError`), with the ranks' tracebacks as the `__cause__`
(`RemoteTraceback`). The Ray layer (`actors.calls`) chains Ray's remote tracebacks the same way.

Typical use::

    report = RankFailure.of(exc)                             # on the rank, inside `except`
    error = kept_type([report.kept], RuntimeError)("...")     # on the driver
    raise error from RemoteTraceback(report.traceback)
"""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from dataclasses import dataclass

KEPT_TYPES: tuple[type[Exception], ...] = (ValueError, TypeError)
"""Exception types that keep their type across processes: the caller's mistakes."""


class RemoteTraceback(Exception):
    """The traceback text of an error raised in another process (a rank, the coordinator),
    chained as the `__cause__` of the error raised here so that both print."""

    def __str__(self) -> str:
        return self.args[0]


@dataclass(frozen=True)
class RankFailure:
    """What one rank reports of an exception: its type's name, its message and its traceback."""

    kind: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> RankFailure:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(type(exc).__name__, str(exc), text)

    @property
    def kept(self) -> type[Exception] | None:
        """The kept type this failure names (`KEPT_TYPES`), or None."""
        return next((t for t in KEPT_TYPES if t.__name__ == self.kind), None)

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def kept_type(kinds: Sequence[type | None], fallback: type[Exception]) -> type[Exception]:
    """The type to raise for failures of `kinds` (one per failure): theirs when they all share one
    of `KEPT_TYPES` (bad input stays a caller's error, whichever rank found it), else `fallback`."""
    distinct = set(kinds)
    if len(distinct) == 1 and (kind := distinct.pop()) in KEPT_TYPES:
        return kind
    return fallback
