"""`auto` rounds choose their engine from measured costs, and say why."""

from __future__ import annotations

from rl_sync.sparse.auto import MIN_DECIDING_S, PROBE_EVERY, WARMUP, AutoPolicy, RoundCost

GB = 10**9


def _policy(dense_s: float, sparse_s: float, wire: float = 0.02) -> AutoPolicy:
    policy = AutoPolicy()
    policy.record(RoundCost("dense", dense_s, GB))
    for _ in range(WARMUP):
        policy.record(RoundCost("sparse", sparse_s, GB, wire))
    return policy


def test_the_sparse_engine_is_measured_before_anything_is_decided():
    policy = AutoPolicy()
    policy.record(RoundCost("dense", 0.5, GB))
    assert policy.choose(GB).reason == "measuring the sparse engine (0 of 2 rounds measured)"
    policy.record(RoundCost("sparse", 5.0, GB))
    assert policy.choose(GB).engine == "sparse"


def test_without_a_dense_round_one_is_measured_unless_rounds_are_too_short_to_time():
    policy = AutoPolicy()
    for _ in range(WARMUP):
        policy.record(RoundCost("sparse", 0.3, GB))
    choice = policy.choose(GB)
    assert (choice.engine, choice.reason) == (
        "dense",
        "measuring the dense engine (sparse 0.300 s predicted, no dense round measured)",
    )
    quick = AutoPolicy()
    for _ in range(WARMUP):
        quick.record(RoundCost("sparse", 0.02, GB))
    assert quick.choose(GB).reason == "a sparse round takes 20.0 ms, under the 50 ms where timings decide"


def test_the_faster_engine_is_chosen_with_the_predictions_as_the_reason():
    slow_sparse = _policy(dense_s=0.125, sparse_s=0.25, wire=0.5)
    choice = slow_sparse.choose(2 * GB)
    assert choice.engine == "dense"
    assert choice.reason == "sparse 0.500 s against dense 0.250 s predicted (the last sparse round sent 50.0% of dense)"
    assert _policy(dense_s=0.125, sparse_s=0.1).choose(GB).engine == "sparse"


def test_rounds_too_short_to_time_stay_sparse():
    policy = _policy(dense_s=0.01, sparse_s=0.05)
    choice = policy.choose(GB)
    assert (
        choice.engine == "sparse" and f"under the {MIN_DECIDING_S * 1e3:.0f} ms where timings decide" in choice.reason
    )


def test_after_a_run_of_dense_choices_one_sparse_round_measures_again():
    policy = _policy(dense_s=0.1, sparse_s=0.4)
    engines = [policy.choose(GB).engine for _ in range(2 * PROBE_EVERY + 2)]
    assert engines == (["dense"] * PROBE_EVERY + ["sparse"]) * 2
    for _ in range(6):  # training moved: far fewer changes; the average follows within a few rounds
        policy.record(RoundCost("sparse", 0.01, GB, 0.001))
    assert policy.choose(GB).engine == "sparse"


def test_costs_are_smoothed_so_one_slow_round_does_not_flip_the_choice():
    policy = _policy(dense_s=0.1, sparse_s=0.06)
    policy.record(RoundCost("sparse", 0.15, GB))
    assert policy.choose(GB).engine == "sparse"  # 0.25 x 0.15 + 0.75 x 0.06 = 0.0825 s, under dense 0.1 s
