"""Whether a round counts, decided once: the driver's wait and the coordinator's commit race for one claim.

The driver gives every `push` (and `push_patches`) a fresh `Fence`. The
coordinator, once the round finished on every rank and before any worker
records its version, claims the fence for itself (`commit`); a driver that
stops waiting claims it for itself (`abandon`). A claim is an insert-if-absent
in Ray's GCS key-value store, which answers whether the coordinator or the
driver is stopped, so exactly one claim lands: a round the driver reported as
not applied is never recorded later, and a driver that gave up just after the
commit learns that its version was applied. The coordinator also refuses a
call whose fence was abandoned before it started (it was queued behind a
stalled call, or its process was stopped); a token carries the time the driver
made it, so a call that starts within half its budget of that (by the two
hosts' clocks) skips asking: its driver waits at least its whole budget before
it gives up, and a call it gave up on all the same is still refused at its
commit. A driver forgets the claim of a call it was answered off its own path
(`Settler`: a thread of its own), so a push waits for no store round trip after
its answer.

Typical use::

    fence = Fence.new()                              # the driver, per call
    ref = coordinator.push.remote(..., fence.token)
    ...                                              # no answer in time:
    if fence.abandon(): ...                          # not applied, never will be
    fence.settle()                                   # answered: the claim is no longer needed

    fence = Fence(token)                             # the coordinator
    if not fence.fresh(budget_s) and fence.abandoned(): ...   # refuse the call
    if not fence.commit(): ...                       # the driver gave up: record nothing
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid

from ray.experimental import internal_kv

log = logging.getLogger("rl_sync")

NAMESPACE = "rl_sync_fence"
COMMIT, ABANDON = b"commit", b"abandon"


class Fence:
    """One driver call's claim, named by `token` (a key in the GCS under `NAMESPACE`)."""

    def __init__(self, token: str):
        self.token = token

    @classmethod
    def new(cls) -> Fence:
        return cls(f"{uuid.uuid4().hex}-{time.time_ns()}")

    def fresh(self, budget_s: float | None) -> bool:
        """Whether the call started within half of its budget after its driver made the fence, so
        its driver cannot have given up on it yet (it waits at least `budget_s`); False when the
        token holds no time, the call has no budget, or the clocks disagree by over a second."""
        made = self.token.rpartition("-")[2]
        if budget_s is None or not made.isdigit():
            return False
        age = time.time() - int(made) / 1e9
        return -1.0 < age < budget_s / 2

    def _claim(self, side: bytes) -> bool:
        """Claim the call for `side`; True when this claim landed first."""
        existed = internal_kv._internal_kv_put(self.token, side, overwrite=False, namespace=NAMESPACE)
        return not existed

    def commit(self) -> bool:
        """The coordinator's claim, before a round's version is recorded; False: the driver gave up."""
        return self._claim(COMMIT)

    def abandon(self) -> bool:
        """The driver's claim, when it stops waiting; False: the coordinator committed first."""
        return self._claim(ABANDON)

    def abandoned(self) -> bool:
        """Whether the driver gave up on the call (the coordinator asks before it starts one)."""
        return internal_kv._internal_kv_get(self.token, namespace=NAMESPACE) == ABANDON

    def settle(self) -> None:
        """Forget the claim: the call is answered (the driver), or was refused as abandoned (the
        coordinator, which never asks about it again)."""
        internal_kv._internal_kv_del(self.token, namespace=NAMESPACE)


class Settler:
    """Forgets the fences of answered calls on a thread of its own, off the driver's path.

    `later(fence)` queues a fence; `close(timeout_s)` waits that long at most for those queued
    to be forgotten, then ends the thread (a fence left over only keeps a few bytes in the GCS)."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def later(self, fence: Fence) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rl-sync-fence-settler", daemon=True)
            self._thread.start()
        self._queue.put(fence)

    def close(self, timeout_s: float) -> None:
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        self._thread = None

    def _run(self) -> None:
        while (fence := self._queue.get()) is not None:
            try:
                fence.settle()
            except Exception as exc:  # (the GCS gone: nothing to forget there)
                log.debug("rl-sync: fence %s not forgotten: %s", fence.token, exc)
