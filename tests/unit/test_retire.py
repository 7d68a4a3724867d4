"""A switch to a grown or shrunk group closes the group it left on a thread of its own."""

from __future__ import annotations

import logging
import threading

import torch

from rl_sync.rank.participant import Participant


class _Session:
    """What a switch touches of a `RankSession`: its names, baselines, device and close."""

    def __init__(self, names: list[str], release: threading.Event | None = None, fails: bool = False):
        self.names, self.baselines, self.device = names, None, torch.device("cpu")
        self.release, self.fails, self.closed = release, fails, threading.Event()

    def close(self) -> None:
        if self.release is not None:
            assert self.release.wait(10), "the test never released the close"
        if self.fails:
            raise RuntimeError("connection reset by peer")
        self.closed.set()


def test_a_switch_returns_before_the_old_group_closes_and_the_next_regroup_waits_for_it():
    release = threading.Event()
    rank = Participant()
    old, new = _Session(["w"], release), _Session(["w"])
    old.baselines = {0: "baseline"}
    rank._rl_sync_session, rank._rl_sync_regrouped = old, new
    rank._rl_sync_switch(keep=True)
    assert rank._rl_sync_session is new and new.baselines == {0: "baseline"}, "current, baselines carried"
    assert not old.closed.is_set(), "the switch did not wait for the old group to close"
    release.set()
    rank._rl_sync_retired()
    assert old.closed.is_set() and rank._rl_sync_retiring is None


def test_a_failed_close_of_the_old_group_is_logged_not_raised(caplog):
    rank = Participant()
    rank._rl_sync_session, rank._rl_sync_regrouped = _Session(["w"], fails=True), _Session(["w"])
    with caplog.at_level(logging.WARNING, logger="rl_sync"):
        rank._rl_sync_switch(keep=True)
        rank._rl_sync_retired()
    assert caplog.messages == [
        "rl-sync: closing the group a switch left failed: RuntimeError: connection reset by peer"
    ]


def test_a_close_past_its_wait_is_logged_and_the_rank_goes_on(monkeypatch, caplog):
    from rl_sync.rank import participant

    monkeypatch.setattr(participant, "RETIRE_WAIT_S", 0.2)
    release = threading.Event()
    rank = Participant()
    old = _Session(["w"], release)
    rank._rl_sync_session, rank._rl_sync_regrouped = old, _Session(["w"])
    with caplog.at_level(logging.WARNING, logger="rl_sync"):
        rank._rl_sync_switch(keep=True)
        rank._rl_sync_retired()
    assert caplog.messages == ["rl-sync: closing the group a switch left took over 0.2 s"]
    assert not old.closed.is_set() and rank._rl_sync_retiring is None
    release.set()
