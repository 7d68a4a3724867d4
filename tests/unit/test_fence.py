"""A call's fence says when its driver made it, so a call that starts soon after skips the GCS."""

from __future__ import annotations

import time

from actors.fence import Fence


def _made(seconds_ago: float) -> Fence:
    return Fence(f"{'a' * 32}-{time.time_ns() - int(seconds_ago * 1e9)}")


def test_a_call_started_within_half_its_budget_is_fresh():
    assert Fence.new().fresh(10.0)
    assert _made(4.0).fresh(10.0)
    assert not _made(6.0).fresh(10.0), "past half its budget: its driver may have given up, so ask"


def test_without_a_time_a_budget_or_agreeing_clocks_the_gcs_is_asked():
    assert not Fence("a" * 32).fresh(10.0), "a token without its time"
    assert not Fence.new().fresh(None), "a call without a budget"
    assert not _made(-2.0).fresh(10.0), "made 2 s in this host's future: the clocks disagree"
    assert _made(-0.5).fresh(10.0), "half a second of disagreement is allowed"
