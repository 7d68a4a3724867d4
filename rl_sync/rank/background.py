"""A round a worker runs on a thread of its own, so the engine keeps serving meanwhile.

A staged round (`WeightSync.stage`) lands in the worker's shadows
(`rl_sync.rank.shadow`) while the process goes on with other calls (generation
on the main thread); the coordinator collects it with a bounded wait and then
commits it on every worker. The thread's own waits are bounded by the round's
timeout; aborting the rank's transport ends them at once.

Clean-up a rank leaves to a thread (closing a group it left, releasing what a commit replaced)
is waited for with `joined` before the next such work: bounded, and logged when the bound passes.

Typical use (inside `rl_sync.rank.worker`)::

    staged = BackgroundRound(version, lambda: rank._rl_sync_run(blob))
    stats = staged.result(timeout_s=60.0)     # the round's RankStats bytes, or its error
    joined(cleanup_thread, 30.0, "closing the group a switch left")
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("rl_sync")


def joined(thread: threading.Thread | None, wait_s: float, what: str) -> None:
    """Wait at most `wait_s` seconds for `thread` (None: nothing to wait for), which is doing
    `what`; past it, a warning naming `what`, and the caller goes on beside it (clean-up only
    drops what nothing uses any more)."""
    if thread is None:
        return
    thread.join(wait_s)
    if thread.is_alive():
        log.warning("rl-sync: %s took over %g s", what, wait_s)


class BackgroundRound:
    """`work()` running on a daemon thread; `result` waits for it (see the module docstring)."""

    def __init__(self, version: int, work: Callable[[], bytes]):
        self.version = version
        self._work = work
        self._value: bytes | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"rl-sync-round-{version}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._work()
        except BaseException as exc:  # handed to whoever collects the round
            self._error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout_s: float) -> bool:
        """Wait at most `timeout_s` seconds for the thread; whether it ended."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def result(self, timeout_s: float, rank: int) -> bytes:
        """The round's result once the thread ended (at most `timeout_s` seconds from now); raises
        what the round raised, or `TimeoutError` naming `rank` and the round."""
        if not self.join(timeout_s):
            raise TimeoutError(
                f"worker rank {rank}: staged round {self.version} is still running after {timeout_s:.1f} s"
            )
        if self._error is not None:
            raise self._error
        assert self._value is not None  # the thread ended without an error
        return self._value
