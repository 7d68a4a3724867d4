"""Bad input fails init or the round with a clear error; failures never hang."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors import SyncError, WeightSync
from actors.ready import HybridActor
from rl_sync.engine.sources import Destination
from rl_sync.planning.layout import Layout, Mesh, Shard

from .conftest import loopback_config
from .harness import POOL, Group, Trainer, Worker
from .recipes import Recipe, expected, read_all, set_version, trainer_build, worker_build

FSDP2 = Layout(Mesh((2,)), (Shard(0),))
TP2 = Layout(Mesh((2,)), (Shard(1),))
W = [
    Recipe("w", torch.bfloat16, (8, 6), FSDP2, TP2),
    Recipe("b", torch.float32, (6,), FSDP2, Layout.replicated(Mesh((2,)))),
]


def test_bad_push_arguments_are_refused_before_any_transfer_and_the_group_stays_whole(ray_session):
    with Group(W, 2, 2) as g:
        with pytest.raises(
            ValueError,
            match=r"the rendezvous store cannot listen on 192.0.2.1:0 "
            r"\(SyncConfig.rendezvous_host, with SyncConfig.rendezvous_port\): ",
        ):
            WeightSync.create(g.trainers, g.workers, loopback_config(rendezvous_host="192.0.2.1"))
        with pytest.raises(ValueError, match=r"^trainers 0 and 1 are the same actor; pass each trainer once$"):
            WeightSync.create([g.trainers[0], g.trainers[0]], g.workers, g.config)
        with pytest.raises(TypeError, match=r"^worker 1 must be a Ray actor handle or a VllmService, got str 'w'$"):
            WeightSync.create(g.trainers, [g.workers[0], "w"], g.config)
        with pytest.raises(
            ValueError,
            match=r"^a sync group needs at least one trainer and one worker, got 0 trainers "
            r"and 2 workers$",
        ):
            WeightSync.create([], g.workers, g.config)
        sync = g.connect()  # the failed create left nothing behind in the actors
        with pytest.raises(
            TypeError,
            match=r"^replace_worker: the new worker must be a Ray actor handle or a "
            r"VllmService, got str 'not an actor'$",
        ):
            sync.replace_worker(0, "not an actor")
        with pytest.raises(ValueError, match=r"^workers 0 and 1 are the same actor; pass each worker once$"):
            sync.replace_worker(0, g.workers[1])
        with pytest.raises(ValueError, match=r"push: tensors \['nope'\] were not declared at init"):
            sync.push(names=["w", "nope"])
        with pytest.raises(TypeError, match=r"push: names must be a list of tensor names, got str 'wb'"):
            sync.push(names="wb")
        with pytest.raises(ValueError, match=r"push: names is empty"):
            sync.push(names=[])
        with pytest.raises(TypeError, match=r"push: version must be an int, got 1.5 \(float\)"):
            sync.push(version=1.5)
        g.step(1)
        assert sync.push().version == 1, "the refused pushes used no version"
        g.check(1)
        sync.close()
        sync.close()
        with pytest.raises(SyncError, match=r"sync group 'default' is closed; create a new WeightSync"):
            sync.push()


@pytest.mark.parametrize(
    "other, message",
    [
        (
            Recipe("w", torch.float32, (8, 6), FSDP2, TP2),
            r"worker rank 3 resolved dtype float32, .* but worker rank 2 resolved dtype bfloat16",
        ),
        (
            Recipe("w", torch.bfloat16, (8, 7), FSDP2, Layout(Mesh((2,)), (Shard(1),))),
            r"worker rank 3 resolved dtype bfloat16, shape \(8, 7\)",
        ),
        (
            Recipe("w", torch.bfloat16, (8, 6), FSDP2, Layout(Mesh((2,)), (Shard(0),))),
            r"worker rank 3 .* layout Mesh\(\(2,\), start_rank=0\)\[S\(0\)\]",
        ),
    ],
)
def test_workers_that_disagree_fail_init_naming_the_tensor(ray_session, other, message):
    trainers = POOL.take(Trainer, [(i, 2, trainer_build(W)) for i in range(2)])
    workers = POOL.take(Worker, [(0, 2, worker_build(W)), (1, 2, worker_build([other, W[1]]))])
    try:
        with pytest.raises(ValueError, match=r"inference workers disagree on tensor 'w': " + message):
            WeightSync.create(trainers, workers, loopback_config())
    finally:
        POOL.give_back(Trainer, trainers)
        POOL.give_back(Worker, workers)


def test_trainer_and_worker_dtypes_must_be_a_float_cast(ray_session):
    worker_side = [Recipe("w", torch.float8_e4m3fn, (8, 6), FSDP2, TP2), W[1]]
    with (
        Group(W, 2, 2, worker_recipes=worker_side) as g,
        pytest.raises(
            ValueError,
            match=r"tensor 'w': source dtype 'bfloat16' and destination dtype 'float8_e4m3fn' "
            r"disagree; senders cast only between \['bfloat16', 'float16', 'float32', 'float64'\]",
        ),
    ):
        g.connect()


def test_a_rank_that_raises_names_rank_round_and_tensor_and_nothing_hangs(ray_session):
    with Group(W, 2, 2, round_timeout_s=4.0) as g:
        sync = g.connect()
        sync.push()
        ray.get(g.trainers[0].call.remote(lambda self: self.state.update(w=self.held.pop("w"))))
        start = time.monotonic()
        with pytest.raises(SyncError) as info:
            sync.push()
        elapsed = time.monotonic() - start
        assert elapsed < 4.0, f"peers should fail as soon as rank 0 aborts, not at their 4 s deadline ({elapsed:.1f} s)"
        text = str(info.value)
        assert "round 2 (m2n) failed on" in text
        assert (
            "trainer 0 (rank 0): BucketError: rank 0, round 2 (m2n): ValueError: rank 0: "
            "the plan needs source tensor 'w' here" in text
        )
        assert "worker 0 (rank 2): BucketError: rank 2, round 2 (m2n), bucket 0 (tensors 'w', 'b')" in text
        assert sync.versions() == [None, None]  # torn by the failed round
        ray.get(g.trainers[0].call.remote(lambda self: self.held.update(w=self.state.pop("w"))))
        g.step(3)
        stats = sync.push(version=3)  # repairs the group first, then a full dense round
        assert stats.version == 3 and stats.mode == "m2n"
        g.check(3)
        assert sync.versions() == [3, 3]


def _swap_storage(actor) -> None:
    shard = actor.held["w"].local
    shard.set_(shard.clone())  # same object, same shape, new storage (as `p.data = ...` does)


def test_a_source_moved_or_resized_in_place_is_seen_at_the_next_round(ray_session):
    with Group(W, 2, 2, round_timeout_s=4.0) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        ray.get(g.trainers[1].call.remote(_swap_storage))
        g.step(2)
        sync.push()
        g.check(2)  # the new storage's values, not the old one's
        ray.get(g.trainers[0].call.remote(lambda self: self.held["w"].local.resize_(2, 6)))
        start = time.monotonic()
        with pytest.raises(SyncError) as info:
            sync.push()
        assert time.monotonic() - start < 4.0, "the peers should fail when rank 0 aborts, not at their deadline"
        assert (
            "trainer 0 (rank 0): ValueError: trainer rank 0: tensor 'w' holds local shape (2, 6) but its layout "
            "Mesh((2,), start_rank=0)[S(0)] gives this rank the box"
        ) in str(info.value)


def test_a_rank_failing_before_its_round_starts_aborts_at_once(ray_session):
    with Group(W, 2, 2, round_timeout_s=4.0) as g:
        sync = g.connect()
        sync.push()
        ray.get(g.trainers[1].call.remote(lambda self: setattr(self, "rl_sync_sources", lambda: None)))
        start = time.monotonic()
        with pytest.raises(
            SyncError,
            match=r"trainer 1 \(rank 1\): TypeError: .*rl_sync_sources\(\) must return a "
            r"mapping of name to tensor, got NoneType",
        ):
            sync.push()
        assert time.monotonic() - start < 4.0, "the peers should fail when rank 1 aborts, not at their deadline"
        ray.get(g.trainers[1].call.remote(lambda self: delattr(self, "rl_sync_sources")))
        g.step(2)
        sync.push(version=2)
        g.check(2)
        ray.get(g.trainers[1].call.remote(lambda self: setattr(self, "rl_sync_sources", lambda: None)))
        with pytest.raises(TypeError, match=r"init \(describe trainers\) failed on 1 of 2 members"):
            sync.repair()  # a healthy group, re-formed by hand, fails part-way
        ray.get(g.trainers[1].call.remote(lambda self: delattr(self, "rl_sync_sources")))
        g.step(3)
        sync.push(version=3)  # the failed repair left the group marked broken, so this push repairs it
        g.check(3)


def test_a_stalled_peer_fails_the_round_within_the_timeout(ray_session):
    with Group(W, 2, 2, round_timeout_s=3.0) as g:
        sync = g.connect()
        stall = g.workers[1].call.remote(lambda self: time.sleep(12))  # past the 8 s the coordinator waits
        time.sleep(1.0)  # the idle worker starts the stall before the coordinator's round reaches it
        start = time.monotonic()
        with pytest.raises(SyncError) as info:
            sync.push()
        elapsed = time.monotonic() - start
        assert elapsed < 15, f"the round should fail near its 3 s timeout, took {elapsed:.1f} s"
        assert "worker 1 (rank 3): no answer within 8 s" in str(info.value)
        ray.cancel(stall)


def test_colocated_hybrid_ranks_copy_their_overlap_locally(ray_session):
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = Layout(Mesh((2,)), (Shard(1),))
    recipes = [Recipe("w", torch.float32, (6, 4), src, dst)]

    def build(rank, size):
        return trainer_build(recipes)(rank, size), worker_build(recipes)(rank, size)

    Hybrid = ray.remote(num_cpus=0.1)(HybridActor)
    actors = [Hybrid.remote(i, 2, build) for i in range(2)]
    try:
        sync = WeightSync.create(actors, actors, loopback_config())
        assert sync.summary.colocated and sync.summary.world_size == 2
        ray.get([a.call.remote(lambda self, v: set_version(_Sources(self), recipes, v), 1) for a in actors])
        stats = sync.push()
        for j, a in enumerate(actors):
            got = ray.get(a.call.remote(lambda self: read_all(_Dests(self))))
            want = expected(recipes, j, 1)["w"]
            assert torch.equal(got["w"], want.reshape(-1).view(torch.uint8))
        assert all(r.role == "both" and r.local_bytes == 3 * 2 * 4 for r in stats.ranks)
        sync.close()
    finally:
        for a in actors:
            ray.kill(a)


class _Sources:
    def __init__(self, actor):
        self.rank, self.held = actor.rank, actor.held["sources"]


class _Dests:
    def __init__(self, actor):
        self.rank, self.held = actor.rank, actor.held["destinations"]


def test_an_actor_belongs_to_one_live_group_and_a_failed_create_leaves_nothing(ray_session):
    with Group(W, 2, 2) as g:
        with pytest.raises(
            TypeError,
            match=r"InferenceWorker is asked to be a trainer but does not inherit the "
            r"trainer mixin",
        ):
            WeightSync.create([g.workers[0], g.trainers[1]], [g.workers[1]], g.config)
        first = g.connect()  # worker 0 was not left recorded as a trainer
        g.step(1)
        first.push()
        g.check(1)
        with pytest.raises(
            ValueError,
            match=r"this actor is already in sync group 'default' \([0-9a-f]{12}\), "
            r"which is still open: an actor belongs to one sync group at a time",
        ):
            WeightSync.create(g.trainers, g.workers, g.config)
        g.step(2)
        first.push()  # the refused group took nothing from the first one
        g.check(2)
        ray.kill(first.coordinator)  # its driver is gone without closing it: the actors are free again
        g.sync = WeightSync.create(g.trainers, g.workers, g.config)
        g.step(3)
        g.sync.push(version=3)
        g.check(3)


def _slow_commits(actor, seconds: float) -> None:
    actor.rl_sync_weights_updated = lambda names: time.sleep(seconds)


def test_a_push_reported_failed_is_never_recorded_later_and_its_retry_is_taken(ray_session):
    with Group(W, 2, 2, double_buffer=True, round_timeout_s=20.0) as g:
        sync = g.connect()
        sync.push()
        ray.get(g.workers[1].call.remote(_slow_commits, 6.0))
        g.step(2)
        start = time.monotonic()
        with pytest.raises(
            SyncError,
            match=r"round 2 \(m2n\) commit failed on 1 of 2 members:\n  worker 1 \(rank 3\): "
            r"no answer within [23] s",
        ):
            sync.push(timeout_s=3.0)
        elapsed = time.monotonic() - start
        assert elapsed < 5.0, f"the push should end within its 3 s budget, took {elapsed:.1f} s"
        ray.get(g.workers[1].call.remote(lambda self: delattr(self, "rl_sync_weights_updated")), timeout=30)
        assert sync.versions() == [None, None], "worker 1's commit finished late, and worker 0's: neither records it"
        assert sync.push(version=2).version == 2, "the failed push recorded nothing, so its version is still free"
        g.check(2)
        assert sync.versions() == [2, 2]
        with pytest.raises(ValueError, match=r"push: timeout_s must be > 0 and at most 604800 seconds, got nan"):
            sync.push(timeout_s=float("nan"))


def _replace_destination(actor) -> None:
    """A new Destination for 'w' in the worker's mapping, over a new tensor (NaN until written)."""
    old = actor.held["w"]
    actor.held["w"] = Destination(torch.full_like(old.local, float("nan")), old.layout, old.shape, old.dtype)


def _move_destination(actor) -> None:
    live = actor.held["w"].local
    live.set_(torch.full_like(live, 0.5))  # the engine reallocated its weight: new storage, same object


def test_a_destination_the_engine_moved_is_bound_anew_and_a_resized_one_fails_the_round(ray_session):
    with Group(W, 2, 2, round_timeout_s=4.0) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        ray.get(g.workers[1].call.remote(_move_destination))
        assert sync.versions() == [1, None], "the moved weight holds what the engine put there"
        g.step(2)
        assert sync.push().version == 2, "a dense round of every tensor fills the weight bound anew"
        g.check(2)
        assert sync.versions() == [2, 2]
        ray.get(g.workers[1].call.remote(lambda self: self.held["w"].local.resize_(2, 3)))
        g.step(3)
        with pytest.raises(SyncError) as info:
            sync.push()
        assert (
            "worker 1 (rank 3): ValueError: worker rank 1: tensor 'w' holds local shape (2, 3) but its layout "
            "Mesh((2,), start_rank=0)[S(1)] gives this rank the box"
        ) in str(info.value)
        assert sync.versions()[1] is None, "worker 1 wrote nothing; it holds what the engine left there"
        with pytest.raises(ValueError, match=r"push: tensors \['nope'\] were not declared at init"):
            sync.push(version=3, names=["nope"])
        assert sync.versions()[1] is None, "a refused push neither repairs nor revives worker 1's old version"
        ray.get(g.workers[1].call.remote(lambda self: self.held["w"].local.resize_(8, 3)))
        sync.repair()
        assert sync.versions()[1] is None, "bound anew, the weight still holds what the engine left there"
        assert sync.push(version=3).version == 3
        g.check(3)
