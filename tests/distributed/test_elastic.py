"""Engines join and leave a live group: nothing that stays restarts or binds anew, a joining engine
catches up from a peer replica, and a join that fails (the joining engine, a trainer or the peer
dying, the driver giving up) leaves the group as it was."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import ray
import torch

from actors import SyncError, WeightSync
from actors.ready import InferenceWorker, TrainerActor
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

from .conftest import loopback_config
from .harness import POOL, _reinitialise
from .recipes import Recipe, as_bytes, expected, read_all, set_version, trainer_build, worker_build
from .test_fencing import _abandoned, _stopped, _until_the_driver_gives_up


def replicas(engines: int) -> list[Recipe]:
    """Two FSDP trainers' tensors, into `engines` TP2 engines laid out along mesh axis 0."""
    return [
        Recipe(
            "w",
            torch.bfloat16,
            (16, 40),
            Layout(Mesh((2,)), (Shard(0),)),
            Layout(Mesh((engines, 2)), (Replicate(), Shard(1))),
        ),
        Recipe("n", torch.float32, (40,), Layout.replicated(Mesh((2,))), Layout.replicated(Mesh((2 * engines,)))),
    ]


class EngineRank(InferenceWorker):
    """One TP2 engine rank whose layouts follow the worker count it binds for, as a vLLM rank's do;
    when told, it dies at a catch-up (`die`) or as it joins a grown group (`die_joining`), or binds
    a layout of its own."""

    def rl_sync_destinations(self, checkpoint=None):
        side = self._rl_sync_sides["worker"]
        recipes = self.state.get("recipes") or replicas(side.size // 2)
        self.held = worker_build(recipes)(side.rank, side.size)
        return self.held

    def _rl_sync_catch_up(self, plan, round_blob):
        if self.state.get("die"):
            os._exit(1)
        return super()._rl_sync_catch_up(plan, round_blob)

    def _rl_sync_joined(self, init, plan, bind_host, device):
        if self.state.get("die_joining"):
            os._exit(1)
        return super()._rl_sync_joined(init, plan, bind_host, device)


class MortalTrainer(TrainerActor):
    """A trainer that, when told, dies as it switches to a grown group."""

    def _rl_sync_switch(self, keep):
        if keep and self.state.get("die"):
            os._exit(1)
        super()._rl_sync_switch(keep)


Trainer = ray.remote(num_cpus=0.1, max_restarts=1, max_task_retries=0)(MortalTrainer)
Rank = ray.remote(num_cpus=0.1, max_restarts=1, max_task_retries=0)(EngineRank)


def _engine(first: int) -> list:
    return POOL.take(Rank, [(first + r, 2, worker_build(replicas(1))) for r in range(2)])


def _step(trainers, version: int) -> None:
    ray.get([t.call.remote(set_version, replicas(1), version) for t in trainers])


def _check(workers, version: int, engines: int, first: int = 0) -> None:
    """`workers`, worker ranks `first` on of a group of `engines` engines, hold `version`."""
    for j, got in enumerate(ray.get([w.call.remote(read_all) for w in workers], timeout=60), start=first):
        for name, value in expected(replicas(engines), j, version).items():
            assert torch.equal(got[name], as_bytes(value)), f"worker {j}: {name} should hold version {version}"


def _identity(actor) -> tuple[int, int]:
    """The actor's process and the address of its bound `w`: a restart or a new binding changes them."""
    return os.getpid(), actor.held["w"].local.data_ptr()


def _tell(actor, **state) -> None:
    """Set `state` on the actor; one told to die is spent (`SPENT`)."""
    if state.get("die") or state.get("die_joining"):
        SPENT.append(actor)
    ray.get(actor.call.remote(lambda self: self.state.update(state)))


def _restarted(actor, *args, timeout_s: float = 60.0) -> None:
    """Wait until Ray restarted `actor` (its calls fail with ActorUnavailableError meanwhile), then
    give it `args`: a pooled actor restarts with the arguments it was first created with."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.call.remote(_reinitialise, *args), timeout=timeout_s)
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _join_fails(sync, engine: list, dying, failed: str, catch_up: str = "relay") -> None:
    """`engine` fails to join (caught up as `catch_up` says): `dying` (told to die) dies during the
    join, and the error says `failed` (a regex) then that it died."""
    _tell(dying, die=True)
    with pytest.raises(SyncError, match=rf"^{failed}: {DIED}"):
        sync.add_engine(engine, catch_up=catch_up)


def _replace_w(actor) -> None:
    """The engine puts a new tensor, of the same layout, where it keeps `w` (holding other values)."""
    bound = actor.held["w"]
    actor.held["w"] = replace(bound, local=torch.zeros_like(bound.local))


DIED = r"(ActorDiedError|ActorUnavailableError): "
"""How a dead actor's call fails (Ray says the second while it restarts the actor)."""
GAVE_UP = (
    r"^the coordinator did not answer within {w} s \(the call's budget of {b} s plus {b} s\); the engine did not "
    r"join the group and never will \(the group is as it was\): add_engine again$"
)


SPENT: list = []
"""Actors a test made die: killed at its end, never given back (Ray restarts each once)."""


@pytest.fixture
def group(ray_session, request):
    """A group of two trainers and one TP2 engine at version 1 (sparse baselines kept), and a
    second engine to join it; actors from the pool (`harness.POOL`), given back after. An indirect
    parameter overrides the group's `SyncConfig` fields."""
    trainers = POOL.take(Trainer, [(i, 2, trainer_build(replicas(1))) for i in range(2)])
    first, second = _engine(0), _engine(2)
    config = loopback_config(**{"round_timeout_s": 10.0, **getattr(request, "param", {})})
    sync = WeightSync.create(trainers, first, config)
    _step(trainers, 1)
    sync.push(mode="sparse")  # (the first sparse request runs dense: the trainers keep baselines from here)
    yield sync, trainers, first, second
    sync.close()
    for remote_class, actors in ((Trainer, trainers), (Rank, first + second)):
        for actor in actors:
            if actor in SPENT:
                ray.kill(actor, no_restart=True)
        POOL.give_back(remote_class, [a for a in actors if a not in SPENT])
    SPENT.clear()


def test_an_engine_joins_from_a_peer_replica_then_another_leaves_and_nothing_else_moves(group):
    sync, trainers, first, second = group
    before = ray.get([w.call.remote(_identity) for w in first])
    _step(trainers, 2)  # the trainers moved on: only the engine in the group holds version 1
    summary = sync.add_engine(second)
    assert (summary.world_size, len(summary.kept_bytes)) == (6, 4)
    _check(first + second, 1, engines=2)
    assert sync.versions() == [1, 1, 1, 1]
    assert ray.get([w.call.remote(_identity) for w in first]) == before, "the first engine kept its bindings"
    stats = sync.push(mode="sparse")
    assert stats.mode == "sparse", "the trainers' baselines describe the joining engine too"
    _check(first + second, 2, engines=2)
    summary = sync.remove_engine(first)
    assert (summary.world_size, len(summary.kept_bytes)) == (4, 2)
    _step(trainers, 3)
    assert sync.push(mode="sparse").mode == "sparse"
    _check(second, 3, engines=1)
    _check(first, 2, engines=1)  # left the group holding what it held
    assert sync.versions() == [3, 3]


def test_an_engine_that_joins_for_the_next_push_holds_no_version_until_that_push_carries_every_tensor(group):
    sync, trainers, first, second = group
    with pytest.raises(ValueError, match=r"^add_engine: catch_up must be one of \['relay', 'next_push'\], got 'peer'$"):
        sync.add_engine(second, catch_up="peer")
    _step(trainers, 2)
    summary = sync.add_engine(second, catch_up="next_push")
    assert (summary.world_size, len(summary.kept_bytes)) == (6, 4)
    assert sync.versions() == [1, 1, None, None], "nothing was sent to the joining engine"
    _check(first, 1, engines=1)
    stats = sync.push(mode="sparse")
    assert stats.mode == "m2n", "the push after the join carries every tensor, dense"
    _check(first + second, 2, engines=2)
    assert sync.versions() == [2, 2, 2, 2]
    _step(trainers, 3)
    assert sync.push(mode="sparse").mode == "sparse", "the dense push filled the baselines again"
    _check(first + second, 3, engines=2)


def test_joins_that_fail_leave_the_group_as_it_was(group):
    """Bad layouts and members are refused before anything moves; a joining rank dying during the
    catch-up fails the join, its peer (alive) stays in the group it was in, and the group goes on
    without a repair."""
    sync, trainers, first, second = group
    sharded_n = Recipe("n", torch.float32, (40,), replicas(1)[1].src, Layout(Mesh((4,)), (Shard(0),)))
    for rank in second:
        _tell(rank, recipes=[replicas(2)[0], sharded_n])
    with pytest.raises(
        ValueError,
        match=r"^tensor 'n': the joining engine lays it out as Mesh\(\(4,\), start_rank=0\)\[S\(0\)\], which gives "
        r"worker rank 0 the box \[0:10\] where it keeps \[0:40\]; an engine joins a live group only when the "
        r"others keep their boxes \(replicas laid out along mesh axis 0, each binding for the grown count\)$",
    ):
        sync.add_engine(second)
    _tell(second[0], recipes=None, die=True)
    _tell(second[1], recipes=None)
    with pytest.raises(
        SyncError,
        match=r"^add_engine \(catch-up to version 1\) failed on 2 of 4 members:\n  worker 0 \(rank 2\): "
        r"BucketError: rank 2, catch-up to version 1, bucket 0 \(tensors 'w', 'n'\): PeerError: transfers with "
        r"rank\(s\) \[4\] did not complete: .*\n  worker 2 \(rank 4\): " + DIED,
    ):
        sync.add_engine(second)
    _check(first, 1, engines=1)  # the first engine serves version 1 throughout
    assert sync.versions() == [1, 1]
    with pytest.raises(
        ValueError,
        match=r"^add_engine: rank 0 of the engine is worker 0 of the group already; pass the rank actors of an "
        r"engine outside the group$",
    ):
        sync.add_engine([first[0], second[1]])
    with pytest.raises(
        ValueError,
        match=r"^remove_engine: tensor 'w' is laid out as .*, in which workers \[1\] are not one whole replica "
        r"\(replicas lie along mesh axis 0\); only a whole engine leaves a live group$",
    ):
        sync.remove_engine([first[1]])
    with pytest.raises(ValueError, match=r"^remove_engine: the group would keep no worker; close it instead$"):
        sync.remove_engine(first)
    _step(trainers, 2)
    stats = sync.push(mode="sparse")
    assert stats.mode == "sparse", "the group was not broken: no repair, no dense round"
    _check(first, 2, engines=1)
    assert sync.versions() == [2, 2]


@pytest.mark.parametrize("group", [{"init_timeout_s": 8.0, "round_timeout_s": 30.0}], indirect=True)
def test_a_joining_rank_dying_as_it_joins_the_grown_group_leaves_the_group_as_it_was(group):
    """The joining engine's first rank dies before it joins the grown group's transport. Every other
    rank gives up waiting for it within the join's bound (`rl_sync.planning.agreement.join_bound`:
    6 s), which ends while the coordinator still listens (8 s), so none of the group's ranks counts
    as lost: the first engine keeps serving and the next sparse round is sparse (no repair)."""
    sync, trainers, first, second = group
    _tell(second[0], die_joining=True)
    with pytest.raises(
        SyncError,
        match=r"^regroup \(join the new group\) failed on 6 of 6 members:\n  trainer 0 \(rank 0\): DistStoreError: "
        r"rendezvous store 127\.0\.0\.1:\d+: no value for \[.*\] within 6\.0 s",
    ):
        sync.add_engine(second)
    assert sync.versions() == [1, 1]
    _step(trainers, 2)
    assert sync.push(mode="sparse").mode == "sparse", "the group was not broken"
    _check(first, 2, engines=1)


def test_a_peer_dying_during_the_catch_up_breaks_the_group_and_the_next_push_repairs_it(group):
    sync, trainers, first, second = group
    _join_fails(
        sync,
        second,
        first[0],
        r"add_engine \(catch-up to version 1\) failed on [1-4] of 4 members:\n  worker 0 \(rank 2\)",
    )
    _check(first[1:], 1, engines=1, first=1)  # the first engine's other rank serves version 1
    _step(trainers, 2)
    assert sync.push().version == 2  # Ray restarted worker 0: the repair binds it anew, a full round
    _check(first, 2, engines=1)
    assert sync.versions() == [2, 2], "the engine that failed to join is not in the group"
    sync.add_engine(second)
    assert sync.versions() == [2] * 4, "released, the engine joins at the next try"


def test_an_engine_whose_ranks_died_leaves_the_broken_group_which_forms_again_without_it(group):
    """Both ranks of the joined engine die; the push that meets them fails and breaks the group.
    Removing the dead engine forms the group again from the others (a repair), and rounds go on."""
    sync, trainers, first, second = group
    sync.add_engine(second)
    assert sync.versions() == [1] * 4  # (the joining ranks' records read: the group is whole before they die)
    for rank in second:
        SPENT.append(rank)
        ray.kill(rank, no_restart=True)
    _step(trainers, 2)
    with pytest.raises(SyncError, match=r"^round 2 \(sparse\) failed on [1-6] of 6 members:"):
        sync.push(version=2, mode="sparse")
    summary = sync.remove_engine(second)
    assert (summary.world_size, len(summary.kept_bytes)) == (4, 2)
    assert sync.workers == first
    _step(trainers, 3)
    assert sync.push(version=3, mode="sparse").mode == "m2n", "the group formed again: a full round"
    _check(first, 3, engines=1)
    assert sync.versions() == [3, 3]


@pytest.mark.parametrize("catch_up", ["relay", "next_push"])
def test_a_trainer_dying_during_a_join_releases_the_engine_and_the_next_push_repairs_the_group(group, catch_up):
    """Trainer 0 dies as the ranks switch to the grown group (after the catch-up, if any): the
    joining engine is released, the first engine serves the version it holds, and the next push
    repairs the group as it was (Ray restarted the trainer)."""
    sync, trainers, first, second = group
    failed = r"regroup \(switch\) failed on 1 of 6 members:\n  trainer 0 \(rank 0\)"
    _join_fails(sync, second, trainers[0], failed, catch_up)
    _check(first, 1, engines=1)
    assert sync.versions() == [1, 1]
    _restarted(trainers[0], 0, 2, trainer_build(replicas(1)))
    _step(trainers, 2)
    assert sync.push(mode="sparse").mode == "m2n", "a repair: a full round"
    _check(first, 2, engines=1)
    sync.add_engine(second)
    assert sync.versions() == [2] * 4, "released, the engine joins at the next try"


def test_a_peer_whose_engine_replaced_a_weight_sends_nothing_and_the_next_round_carries_every_tensor(group):
    """The watch (`rl_sync.rank.watch`): worker 0's engine put a new tensor where it keeps `w`, so
    it reports no version and cannot serve as the catch-up's source; the engine joins without one,
    and the next round runs dense with every tensor, into the new tensor too."""
    sync, trainers, first, second = group
    ray.get(first[0].call.remote(_replace_w))
    sync.add_engine(second)
    assert sync.versions() == [None, 1, None, None]
    _step(trainers, 2)
    assert sync.push(mode="sparse").mode == "m2n", "the joining engine holds what it loaded: a full round"
    _check(first + second, 2, engines=2)
    assert sync.versions() == [2] * 4


def test_a_join_the_driver_gave_up_on_never_takes_effect(group):
    """The coordinator is stopped (SIGSTOP) for the whole call, then resumed: it refuses the call
    before it starts. Stopped for half of it, it runs the join until its catch-up, which ends only
    once the driver gave up: its claim comes second, so it undoes the join. Either way the group
    is as it was (no repair: the next sparse round is sparse), and the engine joins at the next try."""
    sync, trainers, first, second = group
    with _stopped(sync.coordinator), pytest.raises(SyncError, match=GAVE_UP.format(w=4, b=2)):
        sync.add_engine(second, timeout_s=2.0)
    assert sync.versions() == [1, 1]
    before = _abandoned()
    ray.get(second[0].call.remote(_until_the_driver_gives_up, before))
    stopped = _stopped(sync.coordinator, resume_after_s=6.0)
    with stopped, pytest.raises(SyncError, match=GAVE_UP.format(w=8, b=4)):
        sync.add_engine(second, timeout_s=4.0)
    assert sync.versions() == [1, 1]
    assert ray.get(second[0].call.remote(lambda self: self._rl_sync_session)) is None, "released"
    ray.get(second[0].call.remote(lambda self: delattr(self, "rl_sync_weights_updated")))
    _step(trainers, 2)
    assert sync.push(mode="sparse").mode == "sparse", "the group was not broken"
    sync.add_engine(second)
    assert sync.versions() == [2] * 4
    _check(first + second, 2, engines=2)
