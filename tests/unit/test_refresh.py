"""The dense-refresh policy: which rounds run dense and carry every tensor, whatever was asked."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rl_sync.config.sync import Mode
from rl_sync.sparse.refresh import RefreshPolicy

FIRST = "the first round after init or a repair carries every tensor, dense"
FILL = "a dense round first fills the baselines sparse rounds diff against"


def _round(policy: RefreshPolicy, asked: Mode, every_tensor: bool = True) -> tuple[str, str, bool]:
    """One successful round as the coordinator runs it: (mode it ran, why, every tensor)."""
    mode, reason = policy.round_mode(asked)
    full = policy.full_round(mode)
    if full is not None:
        (mode, reason), every_tensor = full, True
    policy.finished(mode, every_tensor)
    return mode, reason, every_tensor


def _ready(every: int = 0) -> RefreshPolicy:
    """A policy past its first round, with baselines filled."""
    policy = RefreshPolicy(every)
    _round(policy, "sparse")
    return policy


def test_the_first_round_carries_every_tensor_in_a_dense_mode_and_only_the_first():
    policy = RefreshPolicy()
    assert policy.full_round("broadcast") == ("broadcast", FIRST)
    assert policy.full_round("auto") == ("m2n", FIRST)
    assert policy.finished("m2n", every_tensor=True) is True
    assert policy.full_round("m2n") is None
    assert policy.finished("m2n", every_tensor=False) is False


def test_sparse_waits_for_a_full_dense_round_that_fills_the_baselines():
    policy = RefreshPolicy()
    assert _round(policy, "m2n") == ("m2n", FIRST, True)
    assert not policy.baselines, "dense rounds alone keep no baselines"
    assert _round(policy, "sparse", every_tensor=False) == ("m2n", f"sparse: {FILL}", False)
    assert policy.baselines and not policy.baselines_ready, "a subset does not fill every baseline"
    assert _round(policy, "auto", every_tensor=False) == ("m2n", f"auto: {FILL}", False)
    assert _round(policy, "m2n") == ("m2n", "", True)
    assert policy.baselines_ready
    assert _round(policy, "sparse", every_tensor=False) == ("sparse", "", False)


def test_every_kth_sparse_round_is_a_dense_refresh():
    policy = _ready(every=3)
    ran = [_round(policy, "sparse")[:2] for _ in range(6)]
    refresh = ("m2n", "sparse: the dense refresh due every 3 rounds")
    assert ran == [("sparse", ""), ("sparse", ""), refresh, ("sparse", ""), ("sparse", ""), refresh]


def test_a_refresh_on_a_subset_does_not_reset_the_count():
    policy = _ready(every=2)
    assert _round(policy, "auto", every_tensor=False)[0] == "auto"
    assert _round(policy, "auto", every_tensor=False)[0] == "m2n"
    assert _round(policy, "auto", every_tensor=False)[0] == "m2n", "still due: the refresh did not carry every tensor"
    assert _round(policy, "auto")[0] == "m2n"
    assert _round(policy, "auto")[0] == "auto"


def test_a_repair_needs_a_full_round_and_fresh_baselines():
    policy = _ready()
    policy.regrouped()
    assert policy.needs_full_round and policy.baselines and not policy.baselines_ready
    assert _round(policy, "sparse", every_tensor=False) == ("m2n", FIRST, True)
    assert _round(policy, "sparse")[0] == "sparse"


def test_patches_stale_the_baselines_but_not_the_workers():
    policy = _ready()
    policy.patched()
    assert not policy.needs_full_round
    assert _round(policy, "sparse") == ("m2n", f"sparse: {FILL}", True)
    assert _round(policy, "sparse")[0] == "sparse"


def test_moved_worker_memory_needs_a_full_dense_round_with_baselines_kept():
    policy = _ready()
    policy.memory_moved()
    assert _round(policy, "sparse", every_tensor=False) == ("m2n", FIRST, True)
    assert policy.baselines_ready
    assert _round(policy, "sparse")[0] == "sparse"


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(["m2n", "broadcast", "sparse", "auto"]), st.booleans(), st.booleans()),
        st.sampled_from(["regrouped", "patched", "memory_moved"]),
    ),
    max_size=40,
)


@given(st.integers(0, 4), ACTIONS)
def test_sparse_runs_only_on_filled_baselines_and_never_past_the_refresh(every: int, actions: list):
    """For any sequence of rounds (asked mode, every tensor, succeeded), repairs, patches and
    moves: a round runs sparse only when the workers and the baselines hold the last full dense
    round, and at most `every` - 1 sparse rounds follow one. A failed round is followed by a
    repair, as the coordinator does before its next round."""
    policy, synced, sparse_run = RefreshPolicy(every), False, 0
    for action in actions:
        if isinstance(action, str):
            getattr(policy, action)()
            synced = False
            continue
        asked, every_tensor, succeeded = action
        mode, _ = policy.round_mode(asked)
        full = policy.full_round(mode)
        if full is not None:
            mode, every_tensor = full[0], True
        if mode in ("sparse", "auto"):
            assert synced and policy.baselines_ready and not policy.needs_full_round
            sparse_run += 1
            assert not every or sparse_run < every
        if not succeeded:
            policy.regrouped()
            synced = False
            continue
        policy.finished(mode, every_tensor)
        if mode not in ("sparse", "auto") and every_tensor and policy.baselines:
            synced, sparse_run = True, 0
