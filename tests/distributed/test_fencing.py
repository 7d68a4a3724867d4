"""A push the driver gave up on is never recorded later; `close` survives a dead coordinator.

The coordinator's process is stopped (SIGSTOP) so that the driver's wait runs
out; once it runs again, the push it finds fenced off is refused before it
starts, or, finishing after the driver gave up, records nothing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager

import pytest
import ray

from actors import SyncError
from actors.fence import ABANDON, NAMESPACE, Fence

from .harness import Group
from .test_failures import W

BUDGET_S = 2.0
"""The pushes' `timeout_s`: the driver waits twice that before it gives up."""
LATE_BUDGET_S = 3.0
"""The budget of a push whose coordinator resumes half-way through the driver's extra wait: it
starts 1.5 s before the driver gives up, and has 1.5 s of its own budget left then."""


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


@contextmanager
def _stopped(actor, resume_after_s: float | None = None):
    """The actor's process stopped (SIGSTOP) for the block, or for `resume_after_s` seconds of it."""
    pid = _pid(actor)
    os.kill(pid, signal.SIGSTOP)
    timer = threading.Timer(resume_after_s or 0.0, os.kill, (pid, signal.SIGCONT))
    if resume_after_s is not None:
        timer.start()
    try:
        yield
    finally:
        timer.cancel()
        os.kill(pid, signal.SIGCONT)


def _abandoned() -> set[bytes]:
    """The fences drivers gave up on (`actors.fence`)."""
    from ray.experimental import internal_kv

    keys = internal_kv._internal_kv_list(b"", namespace=NAMESPACE)
    return {k for k in keys if internal_kv._internal_kv_get(k, namespace=NAMESPACE) == ABANDON}


def _until_the_driver_gives_up(actor, before: set[bytes]) -> None:
    """A worker's round ends only once a driver gave up on a call (not one of `before`), or 30 s."""

    def wait(names) -> None:
        deadline = time.monotonic() + 30.0
        while not _abandoned() - before and time.monotonic() < deadline:
            time.sleep(0.05)

    actor.rl_sync_weights_updated = wait


NOT_APPLIED = (
    r"^the coordinator did not answer within {w} s \(the call's budget of {b} s plus {b} s\); version {v} was not "
    r"applied and never will be \(a round finishing later is not recorded, and workers it wrote into report no "
    r"version\): push it again$"
)


def test_a_push_the_driver_gave_up_on_is_refused_when_the_coordinator_resumes(ray_session):
    """The issue's scenario: the coordinator is stopped for the whole push; resumed, it refuses
    the push it finds abandoned, so the workers keep version 1 and version 2 is free."""
    with Group(W, 2, 2) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        g.step(2)
        before = _abandoned()
        with _stopped(sync.coordinator):
            with pytest.raises(SyncError, match=NOT_APPLIED.format(w=4, b=2, v=2)):
                sync.push(version=2, timeout_s=BUDGET_S)
            assert len(_abandoned() - before) == 1, "the driver's claim, made while the coordinator is stopped"
        assert sync.versions() == [1, 1], "the abandoned push was applied after all"
        assert _abandoned() == before, "the coordinator forgets the claim once it refused the call"
        g.check(1)
        assert sync.push(version=2).version == 2, "the abandoned version is free"
        g.check(2)
        assert sync.versions() == [2, 2]


@pytest.mark.parametrize("double_buffer", [False, True])
def test_a_round_finishing_after_the_driver_gave_up_records_nothing(ray_session, double_buffer):
    """The coordinator resumes while the driver still waits, and its round finishes only after
    the driver gave up: the workers hold the round's values but report no version, and a retry
    of the same version is taken."""
    with Group(W, 2, 2, double_buffer=double_buffer) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        before = _abandoned()
        for worker in g.workers:
            ray.get(worker.call.remote(_until_the_driver_gives_up, before), timeout=30)
        g.step(2)
        stopped = _stopped(sync.coordinator, resume_after_s=1.5 * LATE_BUDGET_S)
        with stopped, pytest.raises(SyncError, match=NOT_APPLIED.format(w=6, b=3, v=2)):
            sync.push(version=2, timeout_s=LATE_BUDGET_S)
        assert sync.versions() == [None, None], "a round finished after the driver gave up was recorded"
        g.check(2)
        for worker in g.workers:
            ray.get(worker.call.remote(lambda self: delattr(self, "rl_sync_weights_updated")), timeout=30)
        assert sync.push(version=2).version == 2
        assert sync.versions() == [2, 2]


def test_close_releases_the_actors_of_a_dead_coordinator_and_never_raises(ray_session):
    with Group(W, 2, 2) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        ray.kill(sync.coordinator)
        sync.close()
        sync.close()
        sessions = ray.get([a.call.remote(lambda self: self._rl_sync_session) for a in g.trainers + g.workers])
        assert sessions == [None] * 4, "every actor left the dead coordinator's group"
        g.sync = g.connect()  # a new group takes the same actors at once
        g.sync.push()
        g.check(1)


def test_a_fence_goes_to_the_first_claim_only(ray_session):
    committed, abandoned = Fence.new(), Fence.new()
    assert committed.commit() and not committed.abandon() and not committed.abandoned()
    assert abandoned.abandon() and not abandoned.commit() and abandoned.abandoned()
    for fence in (committed, abandoned):
        fence.settle()
        assert not fence.abandoned()
    assert committed.abandon(), "a settled fence is free again (tokens are never reused)"
    committed.settle()
