"""`rl_sync.transport.base.made_within`: a blocking call with no bound of its own, bounded."""

import threading
import time

import pytest

from rl_sync.transport.base import made_within


def test_what_is_made_in_time_is_returned_and_its_failure_raised():
    assert made_within(lambda: 7, time.monotonic() + 5, "seven", discard=lambda _: None) == 7

    def refuse():
        raise TimeoutError("the call's own timeout")

    with pytest.raises(TimeoutError, match=r"^the call's own timeout$"):
        made_within(refuse, time.monotonic() + 5, "refused", discard=lambda _: None)


def test_a_call_past_its_deadline_is_abandoned_and_what_it_makes_late_is_discarded():
    release, discarded = threading.Event(), []
    gone = threading.Event()

    def blocked() -> str:
        release.wait(10)
        return "late communicator"

    def discard(made: str) -> None:
        discarded.append(made)
        gone.set()

    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"^forming it: not done within 0\.[23] s; abandoned$"):
        made_within(blocked, time.monotonic() + 0.3, "forming it", discard=discard)
    assert 0.25 < time.monotonic() - start < 2.0
    assert discarded == []
    release.set()
    assert gone.wait(5)
    assert discarded == ["late communicator"]


def test_a_call_abandoned_that_fails_late_discards_nothing():
    release = threading.Event()

    def blocked() -> str:
        release.wait(10)
        raise RuntimeError("a peer died")

    discarded: list = []
    with pytest.raises(TimeoutError, match="abandoned"):
        made_within(blocked, time.monotonic() + 0.1, "forming it", discard=discarded.append)
    release.set()
    time.sleep(0.2)
    assert discarded == []
