"""`Releaser`: what a commit replaced is dropped on a thread of its own, one release at a time."""

import logging
import threading

from rl_sync.vllm import release
from rl_sync.vllm.release import Releaser


class _Kernel:
    """Records the thread that drops it; `hold` (when given) keeps that thread until it is set."""

    def __init__(self, dropped: list, hold: threading.Event | None = None):
        self.dropped, self.hold = dropped, hold

    def __del__(self):
        if self.hold is not None:
            self.hold.wait(10)
        self.dropped.append(threading.current_thread().name)


def test_what_a_commit_replaced_is_dropped_on_the_release_thread_not_the_callers():
    dropped: list[str] = []
    objects = [_Kernel(dropped), [_Kernel(dropped)]]
    releaser = Releaser()
    releaser.release(objects)
    assert objects == []
    releaser.wait()
    assert dropped == ["rl-sync-release", "rl-sync-release"]


def test_nothing_to_release_starts_no_thread():
    releaser = Releaser()
    releaser.release([])
    assert releaser._thread is None


def test_a_release_past_its_wait_is_logged_and_processing_goes_on(monkeypatch, caplog):
    monkeypatch.setattr(release, "RELEASE_WAIT_S", 0.2)
    dropped: list[str] = []
    hold = threading.Event()
    releaser = Releaser()
    releaser.release([_Kernel(dropped, hold)])
    with caplog.at_level(logging.WARNING, logger="rl_sync"):
        releaser.wait()
    assert dropped == []
    assert caplog.messages == ["rl-sync: releasing a commit's replaced kernels took over 0.2 s"]
    hold.set()
