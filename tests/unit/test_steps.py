"""Commits between an engine's steps (`rl_sync.rank.steps.StepGate`): threads stand in for the
engine's generation and the rank's control calls."""

from __future__ import annotations

import threading
import time

import pytest

from rl_sync.rank.steps import StepGate


class Rank:
    """A rank's commits as the gate runs them: which versions, on which thread."""

    def __init__(self, fail: bool = False):
        self.made: list[tuple[int, str]] = []
        self.fail = fail
        self.gate = StepGate(self.apply)

    def apply(self, version: int) -> None:
        if self.fail:
            raise ValueError(f"engine hook refused version {version}")
        self.made.append((version, threading.current_thread().name))


def _in_thread(fn, name: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name=name)
    thread.start()
    return thread, out


def test_an_idle_engine_commits_at_once_on_the_calling_thread():
    rank = Rank()
    assert rank.gate.commit(3, timeout_s=5.0) >= 0.0
    assert rank.made == [(3, threading.current_thread().name)] and rank.gate.between_steps == 0
    assert rank.gate.commit(3, timeout_s=5.0) == 0.0 and len(rank.made) == 1, "made once"


def test_a_lone_engine_generating_commits_on_its_own_thread_between_two_steps():
    rank, steps = Rank(), []
    asked = threading.Event()

    def generate():
        with rank.gate.generating():
            for step in range(6):
                if step == 2:
                    assert asked.wait(5.0)
                    time.sleep(0.05)  # (the commit call is waiting by now)
                rank.gate.boundary()
                steps.append((step, list(rank.made)))

    engine, _ = _in_thread(generate, "engine")
    while not rank.gate.generating_now:
        time.sleep(0.001)
    asked.set()
    held = rank.gate.commit(7, timeout_s=10.0)
    engine.join(10.0)
    assert rank.made == [(7, "engine")] and rank.gate.between_steps == 1 and held >= 0.0
    assert steps[1][1] == [] and steps[2][1] == [(7, "engine")], "made before step 2, none during a step"


def test_a_commit_the_engine_never_steps_for_times_out_naming_the_version():
    rank, release = Rank(), threading.Event()
    engine, _ = _in_thread(lambda: _hold(rank.gate, release), "engine")
    while not rank.gate.generating_now:
        time.sleep(0.001)
    with pytest.raises(TimeoutError) as raised:
        rank.gate.commit(4, timeout_s=0.2)
    assert str(raised.value) == (
        "commit of version 4: the engine did not reach a step boundary within 0.2 s (a tensor-parallel "
        "engine commits when its generation ends)"
    )
    release.set()
    engine.join(5.0)
    assert rank.made == [], "not made during the generation"


def _hold(gate: StepGate, release: threading.Event, agree=None) -> None:
    with gate.generating(agree):
        assert release.wait(10.0)


def test_a_failed_commit_between_steps_raises_in_the_call_and_the_generation_goes_on():
    rank = Rank(fail=True)
    steps: list[int] = []
    asked = threading.Event()

    def generate():
        with rank.gate.generating():
            for step in range(4):
                if step == 1:
                    assert asked.wait(5.0)
                    time.sleep(0.05)
                rank.gate.boundary()
                steps.append(step)

    engine, _ = _in_thread(generate, "engine")
    while not rank.gate.generating_now:
        time.sleep(0.001)
    asked.set()
    with pytest.raises(ValueError, match="engine hook refused version 5"):
        rank.gate.commit(5, timeout_s=10.0)
    engine.join(10.0)
    assert steps == [0, 1, 2, 3]


class Agreement:
    """The engine's ranks' collective: each passes its value, all get the largest (a barrier)."""

    def __init__(self, ranks: int):
        self.values: list[int] = []
        self.barrier = threading.Barrier(ranks, action=lambda: None)
        self.lock = threading.Lock()

    def __call__(self, value: int) -> int:
        with self.lock:
            self.values.append(value)
        self.barrier.wait(10.0)
        largest = max(self.values)
        self.barrier.wait(10.0)
        with self.lock:
            self.values.clear()
        return largest


def test_tensor_parallel_ranks_commit_together_when_a_generation_starts_never_mid_way():
    ranks, agree = [Rank(), Rank()], Agreement(2)
    for rank in ranks:
        rank.gate.ready = 2
    release = threading.Event()
    engines = [_in_thread(lambda r=r: _hold(r.gate, release, agree), f"engine{i}")[0] for i, r in enumerate(ranks)]
    while not all(r.gate.generating_now for r in ranks):
        time.sleep(0.001)
    call, out = _in_thread(lambda: ranks[0].gate.commit(2, timeout_s=10.0), "control0")
    time.sleep(0.1)
    assert ranks[0].made == [] and "value" not in out, "no commit during a tensor-parallel generation"
    release.set()
    for thread in engines + [call]:
        thread.join(10.0)
    assert ranks[0].made == [(2, "control0")] and ranks[1].made == [], "rank 0 commits once its generation ended"
    release.clear()
    engines = [_in_thread(lambda r=r: _hold(r.gate, release, agree), f"engine{i}")[0] for i, r in enumerate(ranks)]
    while not all(r.gate.generating_now for r in ranks):
        time.sleep(0.001)
    assert ranks[1].made == [(2, "engine1")], "rank 1 made it before its next generation's first step"
    release.set()
    for thread in engines:
        thread.join(10.0)
    assert ranks[1].gate.commit(2, timeout_s=1.0) >= 0.0 and len(ranks[1].made) == 1, "its own call finds it made"


def test_an_agreed_commit_a_rank_does_not_hold_fails_its_call_and_is_not_made():
    ranks, agree = [Rank(), Rank()], Agreement(2)
    ranks[0].gate.ready = 3
    ranks[0].gate.commit(3, timeout_s=5.0)
    release = threading.Event()
    release.set()
    engines = [_in_thread(lambda r=r: _hold(r.gate, release, agree), f"engine{i}")[0] for i, r in enumerate(ranks)]
    for thread in engines:
        thread.join(10.0)
    assert ranks[1].made == []
    with pytest.raises(RuntimeError, match="version 3 is not staged on this rank"):
        ranks[1].gate.commit(3, timeout_s=1.0)
