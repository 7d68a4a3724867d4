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


class Lockstep:
    """The ranks of a tensor-parallel engine: each runs `steps` steps on a thread of its own, and
    every step waits for all of them (a barrier stands in for the step's collectives). Each
    rank's list holds, for every step, the versions committed on it before the step ran."""

    def __init__(self, ranks: int, steps: int, step_s: float = 0.002):
        self.ranks = [Rank() for _ in range(ranks)]
        self.seen: list[list[list[int]]] = [[] for _ in range(ranks)]
        collective = threading.Barrier(ranks, timeout=10.0)

        def generate(at: int) -> None:
            rank = self.ranks[at]
            with rank.gate.generating():
                for _ in range(steps):
                    rank.gate.boundary()
                    self.seen[at].append([v for v, _ in rank.made])
                    collective.wait()
                    time.sleep(step_s)

        self.engines = [_in_thread(lambda at=at: generate(at), f"engine{at}")[0] for at in range(ranks)]
        for rank in self.ranks:
            _until_generating(rank.gate)

    def join(self) -> None:
        for engine in self.engines:
            engine.join(20.0)

    def first_step_with(self, version: int) -> list[int | None]:
        return [next((i for i, made in enumerate(s) if version in made), None) for s in self.seen]


def _commit_everywhere(ranks: list[Rank], version: int, at_step: int) -> list[dict]:
    calls = [_in_thread(lambda r=r: r.gate.commit(version, 10.0, at_step=at_step), "control") for r in ranks]
    for thread, _ in calls:
        thread.join(10.0)
    return [out for _, out in calls]


@pytest.mark.parametrize("lag_s", [0.0, 0.003, 0.02])
def test_a_tensor_parallel_engines_ranks_armed_one_after_the_other_all_commit_before_the_same_step(lag_s):
    engine = Lockstep(ranks=2, steps=120)
    time.sleep(0.05)
    first = engine.ranks[0].gate.arm(3, timeout_s=10.0)
    time.sleep(lag_s)  # the other rank may be inside a step by now, waiting for the held one
    second = engine.ranks[1].gate.arm(3, timeout_s=10.0)
    assert first is not None and second is not None and abs(first - second) <= 1
    outs = _commit_everywhere(engine.ranks, 3, at_step=max(first, second))
    engine.join()
    assert [sorted(out) for out in outs] == [["value"], ["value"]], outs
    assert engine.first_step_with(3) == [max(first, second)] * 2, "every rank switched before the same step"
    assert [r.gate.last_at_step for r in engine.ranks] == [max(first, second)] * 2
    assert [r.made for r in engine.ranks] == [[(3, "engine0")], [(3, "engine1")]]
    assert [len(s) for s in engine.seen] == [120, 120]


def test_a_rank_armed_while_idle_commits_at_once_at_its_step_or_waits_for_the_generation_that_brings_it():
    rank = Rank()
    assert rank.gate.arm(2, timeout_s=5.0) == 0
    assert rank.gate.commit(2, timeout_s=5.0, at_step=0) >= 0.0 and rank.made == [(2, "MainThread")]
    later, seen = Rank(), []
    assert later.gate.arm(4, timeout_s=5.0) == 0
    call, out = _in_thread(lambda: later.gate.commit(4, timeout_s=5.0, at_step=2), "control")
    time.sleep(0.05)
    assert later.made == [], "two steps first"
    with later.gate.generating():
        for _ in range(4):
            later.gate.boundary()
            seen.append(len(later.made))
    call.join(5.0)
    assert seen == [0, 0, 1, 1] and later.made == [(4, "MainThread")] and out["value"] >= 0.0


def test_a_disarmed_rank_goes_on_without_the_commit():
    engine = Lockstep(ranks=2, steps=60)
    time.sleep(0.03)
    armed = [rank.gate.arm(5, timeout_s=10.0) for rank in engine.ranks]
    time.sleep(0.05)
    steps_held = [len(s) for s in engine.seen]
    for rank in engine.ranks:
        rank.gate.disarm(5)
    engine.join()
    assert max(steps_held) <= max(a for a in armed if a is not None) + 1, "held while armed"
    assert [len(s) for s in engine.seen] == [60, 60] and [r.made for r in engine.ranks] == [[], []]


def test_a_rank_held_past_its_bound_goes_on_and_then_refuses_the_step_it_ran_past():
    engine = Lockstep(ranks=1, steps=40)
    time.sleep(0.02)
    at = engine.ranks[0].gate.arm(6, timeout_s=0.1)
    assert at is not None
    time.sleep(0.3)
    with pytest.raises(RuntimeError) as raised:
        engine.ranks[0].gate.commit(6, timeout_s=5.0, at_step=at)
    engine.join()
    message = str(raised.value)
    assert message.startswith(f"commit of version 6 before step {at}: this rank is past it (step ")
    assert message.endswith("it gave up waiting for the step, or its engine's ranks do not run in lockstep); not made")
    assert engine.ranks[0].made == [] and len(engine.seen[0]) == 40


def test_a_rank_bound_anew_counts_its_steps_from_zero():
    rank = Rank()
    for _ in range(5):
        rank.gate.boundary()
    assert rank.gate.arm(1, timeout_s=5.0) == 5
    rank.gate.forget()
    assert rank.gate.arm(1, timeout_s=5.0) == 0


def test_the_work_ahead_of_a_commit_runs_before_it_waits_for_the_engine_once_per_commit():
    ahead: list[int] = []
    rank = Rank()
    rank.gate = StepGate(rank.apply, ahead=lambda: ahead.append(len(rank.made)))
    rank.gate.commit(1, timeout_s=5.0)
    assert rank.gate.arm(2, timeout_s=5.0) == 0
    rank.gate.commit(2, timeout_s=5.0, at_step=0)
    assert ahead == [0, 1] and [v for v, _ in rank.made] == [1, 2], "before each commit; an agreed one's at its arming"
