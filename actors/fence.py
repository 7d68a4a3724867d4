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
stalled call, or its process was stopped).

Typical use::

    fence = Fence.new()                              # the driver, per call
    ref = coordinator.push.remote(..., fence.token)
    ...                                              # no answer in time:
    if fence.abandon(): ...                          # not applied, never will be
    fence.settle()                                   # answered: the claim is no longer needed

    fence = Fence(token)                             # the coordinator
    if not fence.commit(): ...                       # the driver gave up: record nothing
"""

from __future__ import annotations

import uuid

from ray.experimental import internal_kv

NAMESPACE = "rl_sync_fence"
COMMIT, ABANDON = b"commit", b"abandon"


class Fence:
    """One driver call's claim, named by `token` (a key in the GCS under `NAMESPACE`)."""

    def __init__(self, token: str):
        self.token = token

    @classmethod
    def new(cls) -> Fence:
        return cls(uuid.uuid4().hex)

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
