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
    assert rank.gate.commit(3, timeout_s=5.0) >= 0.0 and len(rank.made) == 1, "made once"


def _until_generating(gate: StepGate, generations: int = 1) -> None:
    while gate.generations < generations:
        time.sleep(0.001)


def _engine_steps(rank: Rank, steps: int, pause_at: int) -> tuple[threading.Thread, threading.Event, list]:
    """An engine thread running `steps` steps inside a generation, once it runs: before step
    `pause_at` it waits for `asked`, then a little (the commit call is waiting by then). Each
    step's index and the commits made before it are in the list."""
    asked, seen = threading.Event(), []

    def generate():
        with rank.gate.generating():
            for step in range(steps):
                if step == pause_at:
                    assert asked.wait(5.0)
                    time.sleep(0.05)
                rank.gate.boundary()
                seen.append((step, list(rank.made)))

    engine, _ = _in_thread(generate, "engine")
    _until_generating(rank.gate)
    return engine, asked, seen


def test_a_lone_engine_generating_commits_on_its_own_thread_between_two_steps():
    rank = Rank()
    engine, asked, steps = _engine_steps(rank, steps=6, pause_at=2)
    asked.set()
    held = rank.gate.commit(7, timeout_s=10.0)
    engine.join(10.0)
    assert rank.made == [(7, "engine")] and rank.gate.between_steps == 1 and held >= 0.0
    assert steps[1][1] == [] and steps[2][1] == [(7, "engine")], "made before step 2, none during a step"


def test_a_commit_the_engine_never_steps_for_times_out_naming_the_version():
    rank, release = Rank(), threading.Event()
    engine, _ = _in_thread(lambda: _hold(rank.gate, release), "engine")
    _until_generating(rank.gate)
    with pytest.raises(TimeoutError) as raised:
        rank.gate.commit(4, timeout_s=0.2)
    assert str(raised.value) == (
        "commit of version 4: the engine reached no step boundary and did not stop generating within 0.2 s; not made"
    )
    rank.gate.boundary()
    release.set()
    engine.join(5.0)
    assert rank.made == [], "withdrawn: not made at a later step"


def _hold(gate: StepGate, release: threading.Event) -> None:
    with gate.generating():
        assert release.wait(10.0)


def test_a_failed_commit_between_steps_raises_in_the_call_and_the_generation_goes_on():
    rank = Rank(fail=True)
    engine, asked, steps = _engine_steps(rank, steps=4, pause_at=1)
    asked.set()
    with pytest.raises(ValueError, match="engine hook refused version 5"):
        rank.gate.commit(5, timeout_s=10.0)
    engine.join(10.0)
    assert [step for step, _ in steps] == [0, 1, 2, 3]


def test_a_commit_asked_for_during_a_call_that_runs_no_step_is_made_once_the_last_call_ends():
    rank, first, second = Rank(), threading.Event(), threading.Event()
    calls = [_in_thread(lambda e=e: _hold(rank.gate, e), f"call{i}")[0] for i, e in enumerate((first, second))]
    _until_generating(rank.gate, generations=2)
    commit, out = _in_thread(lambda: rank.gate.commit(6, timeout_s=10.0), "control")
    first.set()
    calls[0].join(5.0)
    time.sleep(0.05)
    assert rank.made == [] and "value" not in out, "another call still runs"
    second.set()
    for thread in calls[1:] + [commit]:
        thread.join(5.0)
    assert rank.made == [(6, "control")] and out["value"] >= 0.0 and rank.gate.between_steps == 0


def test_a_commit_waiting_when_the_rank_binds_anew_is_refused_and_not_made():
    rank, release = Rank(), threading.Event()
    engine, _ = _in_thread(lambda: _hold(rank.gate, release), "engine")
    _until_generating(rank.gate)
    call, out = _in_thread(lambda: rank.gate.commit(8, timeout_s=10.0), "control")
    time.sleep(0.05)
    rank.gate.forget()
    call.join(5.0)
    release.set()
    engine.join(5.0)
    assert str(out["error"]) == "commit of version 8: the rank was bound anew meanwhile" and rank.made == []


def test_a_generation_that_holds_commits_over_makes_them_at_its_end_not_at_a_step():
    rank, asked = Rank(), threading.Event()

    def generate():
        with rank.gate.generating(at_steps=False):
            assert asked.wait(5.0)
            time.sleep(0.05)
            rank.gate.boundary()

    engine, _ = _in_thread(generate, "engine")
    _until_generating(rank.gate)
    asked.set()
    rank.gate.commit(9, timeout_s=10.0)
    engine.join(5.0)
    assert rank.made == [(9, "MainThread")] and rank.gate.between_steps == 0
