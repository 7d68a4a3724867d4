"""Relay among engine replicas over real Ray actors and Gloo: four TP2 replicas bit-exact in
every mode, each trainer sending a quarter of what it sends directly; a relaying worker that
dies fails the round in time, exposes nothing half-written, and the group repairs."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors import SyncError, WeightSync
from actors.ready import TrainerActor
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

from .conftest import loopback_config
from .harness import Group
from .recipes import Recipe, expected, read_all, set_version, trainer_build, worker_build
from .test_reliability import MortalWorker

REPLICAS = 4
FSDP2 = Layout(Mesh((2,)), (Shard(0),))
COLUMN = Layout(Mesh((REPLICAS, 2)), (Replicate(), Shard(0)))
ROW = Layout(Mesh((REPLICAS, 2)), (Replicate(), Shard(1)))
RECIPES = [
    Recipe("qkv", torch.bfloat16, (96, 40), FSDP2, COLUMN),
    Recipe("o", torch.bfloat16, (40, 48), FSDP2, ROW),
    Recipe("norm", torch.float32, (40,), FSDP2, Layout.replicated(COLUMN.mesh)),
]
REPLICA_BYTES = (96 * 40 + 40 * 48) * 2 + 2 * 40 * 4
"""What one TP2 replica keeps (the norm on both of its ranks)."""


def _trainer_sent(stats) -> list[int]:
    return [r.sent_bytes for r in stats.ranks if r.role == "trainer"]


def test_four_tp2_replicas_relay_bit_exact_in_every_mode(ray_session):
    with Group(RECIPES, 2, 2 * REPLICAS, relay="on", bucket_bytes=4096) as g:
        sync = g.connect()
        assert sync.summary.relay.startswith("relay: asked for")
        assert sync.summary.plan_bytes == REPLICAS * REPLICA_BYTES, "the plan's direct bytes: one copy per replica"
        for version, mode in enumerate(["sparse", "sparse", "auto", "m2n"], start=1):
            g.step(version)
            stats = sync.push(mode=mode)
            assert stats.mode == (mode if version > 1 else "m2n"), "the first round is dense, then as asked"
            g.check(version)
            assert sync.versions() == [version] * 2 * REPLICAS
            if mode == "m2n":
                assert _trainer_sent(stats) == [REPLICA_BYTES // 2] * 2, "each trainer sends its shard once"
                workers = [r for r in stats.ranks if r.role == "worker"]
                forwarded = [r.sent_bytes for r in sorted(workers, key=lambda r: r.rank)]
                kept = list(sync.summary.kept_bytes)
                assert forwarded == kept[: 2 * (REPLICAS - 1)] + [0, 0], "every replica but the last forwards its bytes"
                assert [r.received_bytes for r in sorted(workers, key=lambda r: r.rank)] == kept


CHAIN = [Recipe("w", torch.bfloat16, (64, 48), FSDP2, Layout(Mesh((3, 1)), (Replicate(), Shard(0))))]
"""Three TP1 replicas: worker 1 receives from worker 0 and forwards to worker 2."""


def test_a_dead_relaying_worker_fails_the_round_in_time_exposes_nothing_and_the_group_repairs(ray_session):
    Trainer = ray.remote(num_cpus=0.1)(TrainerActor)
    Worker = ray.remote(num_cpus=0.1, max_restarts=1, max_task_retries=0)(MortalWorker)
    trainers = [Trainer.remote(i, 2, trainer_build(CHAIN)) for i in range(2)]
    workers = [Worker.remote(j, 3, worker_build(CHAIN)) for j in range(3)]
    try:
        sync = WeightSync.create(
            trainers, workers, loopback_config(relay="on", double_buffer=True, round_timeout_s=5.0, bucket_bytes=2048)
        )
        _step(trainers, 1)
        sync.push()
        ray.get(workers[1].call.remote(lambda self: self.state.update(die=True)))
        _step(trainers, 2)
        start = time.monotonic()
        with pytest.raises(SyncError, match=r"round 2 \(m2n\) failed"):
            sync.push()
        assert time.monotonic() - start < 5.0 + 10.0, "the round outlived its timeout"
        _check([workers[0], workers[2]], [0, 2], 1)
        _step(trainers, 3)
        stats = sync.push(version=3)  # the restarted worker rejoins; a full dense round repairs it
        assert stats.mode == "m2n" and sync.versions() == [3] * 3
        _check(workers, range(3), 3)
        sync.close()
    finally:
        for actor in trainers + workers:
            ray.kill(actor, no_restart=True)


def _step(trainers, version: int) -> None:
    ray.get([t.call.remote(set_version, CHAIN, version) for t in trainers])


def _check(workers, indices, version: int) -> None:
    """Each worker's live weights are exactly `version`'s (a failed double-buffered round leaves
    the last committed one)."""
    for j, got in zip(indices, ray.get([w.call.remote(read_all) for w in workers])):
        for name, value in expected(CHAIN, j, version).items():
            assert torch.equal(got[name], value.reshape(-1).view(torch.uint8)), (
                f"worker {j}: {name} at version {version}"
            )
