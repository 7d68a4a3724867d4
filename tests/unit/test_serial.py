"""`rl_sync.rank.serial.one_at_a_time`: calls on one rank wait for each other, across threads,
re-entrantly, within a bound."""

from __future__ import annotations

import threading
import time

import pytest

from rl_sync.rank import serial


class Rank:
    def __init__(self):
        self.order: list[str] = []
        self.release = threading.Event()

    @serial.one_at_a_time
    def commit(self) -> None:
        self.order.append("commit starts")
        assert self.release.wait(5.0)
        self.record()
        self.order.append("commit ends")

    @serial.one_at_a_time
    def record(self) -> None:
        self.order.append("record")

    @serial.one_at_a_time
    def close(self) -> None:
        self.order.append("close")


def test_a_call_from_another_thread_waits_for_the_one_running_which_may_call_another():
    rank = Rank()
    first = threading.Thread(target=rank.commit)
    first.start()
    while not rank.order:
        time.sleep(0.001)
    second = threading.Thread(target=rank.close)
    second.start()
    time.sleep(0.05)
    assert rank.order == ["commit starts"], "close waits"
    rank.release.set()
    first.join(5.0)
    second.join(5.0)
    assert rank.order == ["commit starts", "record", "commit ends", "close"]


def test_a_call_waiting_past_the_bound_fails_naming_itself(monkeypatch):
    monkeypatch.setattr(serial, "SERIAL_WAIT_S", 0.05)
    rank = Rank()
    first = threading.Thread(target=rank.commit)
    first.start()
    while not rank.order:
        time.sleep(0.001)
    with pytest.raises(TimeoutError) as raised:
        rank.close()
    rank.release.set()
    first.join(5.0)
    assert str(raised.value) == "Rank.close: another rl-sync call on this rank ran for over 0.05 s"
