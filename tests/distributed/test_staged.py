"""Staged rounds: the next version travels while the workers serve the last, then commits at once."""

from __future__ import annotations

import os
import time

import pytest
import ray
import torch

from actors import SyncError, WeightSync
from actors.ready import InferenceWorker, TrainerActor
from rl_sync.planning.layout import Layout, Mesh, Shard

from .conftest import loopback_config
from .recipes import Recipe, expected, read_all, set_version, trainer_build, worker_build

FSDP2 = Layout(Mesh((2,)), (Shard(0),))
TP2 = Layout(Mesh((2,)), (Shard(1),))
RECIPES = [
    Recipe("w", torch.bfloat16, (64, 48), FSDP2, TP2),
    Recipe("v", torch.float32, (40, 16), FSDP2, TP2),
    Recipe("n", torch.float32, (48,), FSDP2, Layout.replicated(Mesh((2,)))),
]


class GatedTrainer(TrainerActor):
    """A trainer that, when told, holds each round until a file exists (at most 60 s): the workers'
    part of a staged round is then still running."""

    def _rl_sync_before_round(self, round_info):
        gate = self.state.get("gate")
        deadline = time.monotonic() + 60
        while gate is not None and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.05)
        super()._rl_sync_before_round(round_info)


class MortalWorker(InferenceWorker):
    """A worker that kills its own process once a round's transfer ended, when told to (a staged
    round's thread runs that hook: it dies in the background)."""

    def _rl_sync_after_round(self, round_info, stats):
        if self.state.get("die"):
            os._exit(1)
        return super()._rl_sync_after_round(round_info, stats)


@pytest.fixture
def group(ray_session):
    Trainer = ray.remote(num_cpus=0.1)(GatedTrainer)
    Worker = ray.remote(num_cpus=0.1, max_restarts=1, max_task_retries=0)(MortalWorker)
    trainers = [Trainer.remote(i, 2, trainer_build(RECIPES)) for i in range(2)]
    workers = [Worker.remote(j, 2, worker_build(RECIPES)) for j in range(2)]
    yield trainers, workers
    for actor in trainers + workers:
        ray.kill(actor, no_restart=True)


def _step(trainers, version: int) -> None:
    ray.get([t.call.remote(set_version, RECIPES, version) for t in trainers])


def _check(workers, versions: dict[str, int]) -> None:
    """Every worker's live weights hold `versions[name]` of each tensor, bit for bit."""
    for j, got in enumerate(ray.get([w.call.remote(read_all) for w in workers], timeout=60)):
        for name, version in versions.items():
            want = expected(RECIPES, j, version)[name].reshape(-1).view(torch.uint8)
            assert torch.equal(got[name], want), f"worker {j}: {name} should hold version {version}"


def _all(version: int) -> dict[str, int]:
    return {r.name: version for r in RECIPES}


def _address(actor) -> int:
    return actor.held["w"].local.data_ptr()


def test_a_staged_round_arrives_while_workers_serve_and_commits_by_swap(group, tmp_path):
    trainers, workers = group
    sync = WeightSync.create(trainers, workers, loopback_config(double_buffer=True))
    _step(trainers, 1)
    sync.push()
    _check(workers, _all(1))
    gate = str(tmp_path / "gate")
    ray.get([t.call.remote(lambda self: self.state.update(gate=gate)) for t in trainers])
    _step(trainers, 2)
    addresses = ray.get([w.call.remote(_address) for w in workers])
    staged = sync.stage()
    assert (staged.version, staged.mode) == (2, "m2n")
    _check(workers, _all(1))  # answered while the round waits on the trainers: the workers serve version 1
    assert sync.versions() == [1, 1]
    open(gate, "w").close()
    stats = staged.commit()
    _check(workers, _all(2))
    assert sync.versions() == [2, 2] and stats.version == 2 and stats.commit_seconds > 0
    kept = list(sync.summary.kept_bytes)
    assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == kept
    moved = ray.get([w.call.remote(_address) for w in workers])
    assert all(a != b for a, b in zip(addresses, moved)), "the commit swapped the memory behind the weights"

    for version, mode in ((3, "m2n"), (4, "sparse")):  # a first sparse request runs dense (no baselines yet)
        _step(trainers, version)
        assert sync.stage(mode="sparse").commit().mode == mode  # the spares caught up with the live round first
        _check(workers, _all(version))
    _step(trainers, 5)
    sync.stage(names=["w"]).commit()
    _check(workers, {"w": 5, "v": 4, "n": 4})
    _step(trainers, 6)
    assert sync.push(mode="sparse").version == 6, "blocking rounds follow staged ones"
    _check(workers, _all(6))
    sync.close()


def test_misuse_of_staged_rounds_is_refused_naming_what_to_do(group):
    trainers, workers = group
    plain = WeightSync.create(trainers, workers, loopback_config())
    with pytest.raises(
        ValueError,
        match=r"^stage: a staged round lands in the workers' shadow copies while they serve, which only a "
        r"double-buffered group keeps; create the group with SyncConfig\(double_buffer=True\)$",
    ):
        plain.stage()
    plain.close()
    sync = WeightSync.create(trainers, workers, loopback_config(double_buffer=True))
    _step(trainers, 1)
    staged = sync.stage()
    for call, what in ((sync.push, "push"), (sync.stage, "stage")):
        with pytest.raises(
            ValueError,
            match=rf"^{what}: round 1 is staged and not committed; commit it first \(StagedRound.commit\(\)\)$",
        ):
            call()
    with pytest.raises(ValueError, match=r"^push: version 1 is not newer than the last applied version 1$"):
        staged.commit()
        sync.push(version=1)
    with pytest.raises(ValueError, match=r"^commit: round 1 was committed already$"):
        staged.commit()
    _check(workers, _all(1))
    sync.close()


def test_a_worker_dying_during_a_staged_round_leaves_the_others_serving_then_the_group_repairs(group, tmp_path):
    trainers, workers = group
    sync = WeightSync.create(trainers, workers, loopback_config(double_buffer=True, round_timeout_s=6.0))
    _step(trainers, 1)
    sync.push()
    gate = str(tmp_path / "gate")
    ray.get([t.call.remote(lambda self: self.state.update(gate=gate)) for t in trainers])
    ray.get(workers[1].call.remote(lambda self: self.state.update(die=True)))
    _step(trainers, 2)
    staged = sync.stage()  # the trainers wait at the gate: worker 1 dies only after this returned
    open(gate, "w").close()
    start = time.monotonic()
    with pytest.raises(SyncError, match=r"round 2 \(m2n\), staged failed on 1 of 2 members:\n  worker 1 \(rank 3\)"):
        staged.commit()
    assert time.monotonic() - start < 6.0 + 10.0, "the commit outlived the round's timeout"
    _check(workers[:1], _all(1))  # never committed anywhere: the survivor serves version 1 in full
    assert sync.versions()[0] == 1
    _step(trainers, 3)
    stats = sync.push(version=3)  # the restarted worker rejoins; a full round brings both to version 3
    assert stats.mode == "m2n"
    _check(workers, _all(3))
    assert sync.versions() == [3, 3]
    sync.close()
