"""One rl-sync call at a time on a rank whose actor takes some of them beside its generation.

A worker actor that declares a control group (`rl_sync.rank.steps.CONTROL_GROUP`) runs a
staged round's calls on a thread of their own, beside the thread that takes every other call.
The coordinator never overlaps its calls to a rank, except after it gave up on one (a repair,
a close): `@one_at_a_time` makes those calls, and the ones that form and leave a group, wait
for each other on the rank (re-entrant, so one may call another), for at most `SERIAL_WAIT_S`.
Rounds are not among them: a staged round runs one on a thread the staged calls wait for.

    class Rank(Participant):
        @one_at_a_time
        def _rl_sync_close(self, abort=False, group=None): ...
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

SERIAL_WAIT_S = 600.0
"""How long a call waits for another rl-sync call on the same rank (a commit may wait for a
generation step, a staged round's collection for its transfer, each bounded below this)."""
_CREATING = threading.Lock()
F = TypeVar("F", bound=Callable[..., Any])


def _lock_of(rank: Any) -> threading.RLock:
    lock = rank.__dict__.get("_rl_sync_serial")
    if lock is None:
        with _CREATING:
            lock = rank.__dict__.setdefault("_rl_sync_serial", threading.RLock())
    return lock


def one_at_a_time(method: F) -> F:
    """`method` waits (at most `SERIAL_WAIT_S`) for any other such call on the same rank."""

    @functools.wraps(method)
    def serial(self, *args, **kwargs):
        lock = _lock_of(self)
        if not lock.acquire(timeout=SERIAL_WAIT_S):
            raise TimeoutError(
                f"{type(self).__name__}.{method.__name__}: another rl-sync call on this rank ran for over "
                f"{SERIAL_WAIT_S:g} s"
            )
        try:
            return method(self, *args, **kwargs)
        finally:
            lock.release()

    return serial  # type: ignore[return-value]
