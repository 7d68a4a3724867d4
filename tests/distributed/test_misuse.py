"""Random sequences of use and misuse on a live group: no weights reported wrong, no long waits.

Each example drives one group (double-buffered or not) through a drawn
sequence of good pushes (every mode), patches, refused arguments, sources and destinations moved or
replaced under the group,
ranks failing before their round, a second group on the same actors, and
bad replacements. After every action, each worker that reports a version must
hold exactly that version's weights, and no call may take longer than the
push budget the configuration promises. CI runs three fixed examples;
`RL_SYNC_MISUSE_EXAMPLES=20 pytest tests/distributed/test_misuse.py` explores
twenty random ones.
"""

from __future__ import annotations

import os
import time
from typing import Any, get_args

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors import SyncError, WeightSync
from rl_sync.config.sync import Mode
from rl_sync.sparse.patches import SparseWeightPatch

from .harness import Group
from .recipes import as_bytes, expected, full_value, read_all
from .test_failures import W, _move_destination, _replace_destination, _swap_storage

BAD_PUSHES: list[tuple[dict[str, Any], type[Exception]]] = [  # Any: the arguments are ill-typed on purpose
    (dict(names="wb"), TypeError),
    (dict(names=[]), ValueError),
    (dict(names=["nope"]), ValueError),
    (dict(version=1.5), TypeError),
    (dict(version=1), ValueError),  # never newer than the last applied version after the first push
    (dict(mode="bogus"), ValueError),
    (dict(timeout_s=float("nan")), ValueError),
]


def _break_sources(actor) -> None:
    actor.rl_sync_sources_kept = actor.rl_sync_sources
    actor.rl_sync_sources = lambda: None


def _mend_sources(actor) -> None:
    actor.rl_sync_sources = actor.rl_sync_sources_kept


class Driver:
    """One group and the version its trainers are at; checks the invariant after each action."""

    def __init__(self, g: Group, sync: WeightSync):
        self.g, self.sync, self.trained = g, sync, 0

    def push(self, mode: str) -> None:
        self.trained += 1
        self.g.step(self.trained)
        self.sync.push(version=self.trained, mode=mode)
        assert self.sync.versions() == [self.trained, self.trained]

    def bad_push(self, case: int) -> None:
        kwargs, error = BAD_PUSHES[case]
        before = self.sync.versions()
        with pytest.raises(error):
            self.sync.push(**kwargs)
        assert self.sync.versions() == before, "a refused push changed what the workers hold"

    def failing_push(self, breaks, mends) -> None:
        self.trained += 1
        self.g.step(self.trained)
        breaks()
        try:  # a round fails with SyncError; a repair re-describing the bad rank names its bad input
            with pytest.raises((SyncError, TypeError, ValueError)):
                self.sync.push(version=self.trained)
        finally:
            mends()

    def resized_source(self) -> None:
        grow = self.g.trainers[0].call.remote

        def breaks():
            ray.get(grow(lambda self: self.held["w"].local.resize_(2, 6)))

        def mends():
            ray.get(grow(lambda self: self.held["w"].local.resize_(4, 6)))

        self.failing_push(breaks, mends)

    def none_sources(self) -> None:
        actor = self.g.trainers[1]
        self.failing_push(
            lambda: ray.get(actor.call.remote(_break_sources)), lambda: ray.get(actor.call.remote(_mend_sources))
        )

    def moved_storage(self, side: int) -> None:
        """A trainer's shard or a worker's weight given new storage: both are followed (the moved
        weight holds what the engine put there until the dense round fills it)."""
        if side == 0:
            ray.get(self.g.trainers[1].call.remote(_swap_storage))
        else:
            ray.get(self.g.workers[1].call.remote(_move_destination))
            assert self.sync.versions()[1] is None, "the moved weight holds what the engine put there"
        self.push("m2n")

    def replaced_destination(self, mode: str) -> None:
        """A new Destination in a worker's mapping: a round that writes it whole succeeds, one that
        cannot (sparse, not double-buffered) fails naming it; either way no version is wrong."""
        ray.get(self.g.workers[0].call.remote(_replace_destination))
        assert self.sync.versions()[0] is None
        self.trained += 1
        self.g.step(self.trained)
        try:
            self.sync.push(version=self.trained, mode=mode)
        except SyncError as exc:
            assert "'w' changed since the last round (replaced under its name) and was bound anew" in str(exc)

    def patches(self) -> None:
        """Every element of every tensor patched to the next version's values: applied on a
        group holding a full copy, refused (nothing written) on a broken or double-buffered one."""
        version = self.trained + 1
        patches = [
            SparseWeightPatch(r.name, torch.arange(full_value(r, version).numel()), full_value(r, version).reshape(-1))
            for r in W
        ]
        try:
            applied = self.sync.push_patches(patches, version=version)
        except ValueError as exc:
            assert "push_patches: " in str(exc)
            return
        self.trained = version
        self.g.step(version)
        assert applied == version and self.sync.versions() == [version, version]

    def second_group(self) -> None:
        with pytest.raises(ValueError, match="an actor belongs to one sync group at a time"):
            WeightSync.create(self.g.trainers, self.g.workers, self.g.config)

    def bad_replacement(self) -> None:
        with pytest.raises((TypeError, ValueError)):
            self.sync.replace_worker(0, self.g.workers[1])

    def check(self) -> None:
        """Every worker that reports a version holds exactly that version."""
        got = ray.get([w.call.remote(read_all) for w in self.g.workers])
        for j, version in enumerate(self.sync.versions()):
            if version is None:
                continue
            for name, value in expected(W, j, version).items():
                assert torch.equal(got[j][name], as_bytes(value)), (
                    f"worker {j} reports version {version}, {name} differs"
                )


ACTIONS = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(get_args(Mode))),
    st.tuples(st.just("bad_push"), st.integers(0, len(BAD_PUSHES) - 1)),
    st.tuples(st.just("resized_source")),
    st.tuples(st.just("none_sources")),
    st.tuples(st.just("moved_storage"), st.integers(0, 1)),
    st.tuples(st.just("replaced_destination"), st.sampled_from(get_args(Mode))),
    st.tuples(st.just("second_group")),
    st.tuples(st.just("bad_replacement")),
    st.tuples(st.just("patches")),
)


EXPLORE = int(os.environ.get("RL_SYNC_MISUSE_EXAMPLES", "0"))
"""Examples to draw at random (e.g. 20); by default 3 fixed ones, so CI runs the same sequences."""


@settings(
    max_examples=EXPLORE or 3,
    derandomize=not EXPLORE,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(actions=st.lists(ACTIONS, min_size=6, max_size=10), double_buffer=st.booleans())
def test_random_misuse_never_reports_wrong_weights_or_waits_past_its_budget(ray_session, actions, double_buffer):
    with Group(W, 2, 2, init_timeout_s=10.0, round_timeout_s=4.0, double_buffer=double_buffer) as g:
        driver = Driver(g, g.connect())
        driver.push("m2n")
        for action, *args in actions:
            start = time.monotonic()
            getattr(driver, action)(*args)
            elapsed = time.monotonic() - start
            assert elapsed < g.config.push_budget_s, f"{action}{tuple(args)} took {elapsed:.1f} s"
            driver.check()
        driver.push("auto")  # whatever happened, the group recovers
        driver.check()
