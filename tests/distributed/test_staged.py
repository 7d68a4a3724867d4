"""Staged rounds: the next version travels while the workers serve the last, then commits at once."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import ray
import torch

from actors import SyncError, WeightSync
from actors.ready import InferenceWorker, TrainerActor
from rl_sync.planning.layout import Layout, Mesh, Shard

from .harness import Group
from .recipes import Recipe, as_bytes, expected, read_all
from .test_fencing import NOT_APPLIED, _stopped

RECIPES = [
    Recipe("w", torch.bfloat16, (32, 80), Layout(Mesh((2,)), (Shard(0),)), Layout(Mesh((2,)), (Shard(1),))),
    Recipe("v", torch.float32, (24, 40), Layout(Mesh((2,)), (Shard(1),)), Layout(Mesh((2,)), (Shard(0),))),
    Recipe("n", torch.float32, (80,), Layout.replicated(Mesh((2,))), Layout.replicated(Mesh((2,)))),
]
"""Trainer and worker layouts of three dtypes and shardings (each worker keeps its own storages,
which commits swap)."""


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
    """A worker that, when told to, kills its own process once a round's transfer ended (a staged
    round's thread runs that hook: it dies in the background), or refuses once to process a round
    (an engine's `rl_sync_prepare` raising)."""

    def _rl_sync_after_round(self, round_info, stats):
        if self.state.get("die"):
            os._exit(1)
        return super()._rl_sync_after_round(round_info, stats)

    def rl_sync_prepare(self, names, spare):
        if self.state.pop("refuse", False):
            raise ValueError("engine: cannot process this round")


Trainer = ray.remote(num_cpus=0.1)(GatedTrainer)
Worker = ray.remote(num_cpus=0.1, max_restarts=1, max_task_retries=0)(MortalWorker)


def _group(**config) -> Group:
    return Group(RECIPES, 2, 2, classes=(Trainer, Worker), **config)


def _address(actor) -> int:
    return actor.held["w"].local.data_ptr()


def _gate(g: Group, path: str) -> None:
    ray.get([t.call.remote(lambda self: self.state.update(gate=path)) for t in g.trainers])


def test_a_staged_round_arrives_while_workers_serve_and_commits_by_swap(ray_session, tmp_path):
    with _group(double_buffer=True) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        gate = str(tmp_path / "gate")
        _gate(g, gate)
        g.step(2)
        addresses = ray.get([w.call.remote(_address) for w in g.workers])
        staged = sync.stage()
        assert (staged.version, staged.mode) == (2, "m2n")
        g.check(1)  # answered while the round waits on the trainers: the workers serve version 1
        assert sync.versions() == [1, 1]
        open(gate, "w").close()
        stats = staged.commit()
        g.check(2)
        assert sync.versions() == [2, 2] and stats.version == 2 and stats.commit_seconds > 0
        kept = list(sync.summary.kept_bytes)
        assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == kept
        assert list(sync.summary.swap_bytes) == kept, "the workers' commits swap every byte they keep"
        moved = ray.get([w.call.remote(_address) for w in g.workers])
        assert all(a != b for a, b in zip(addresses, moved)), "the commit swapped the memory behind the weights"
        for version, mode in ((3, "m2n"), (4, "sparse")):  # a first sparse request runs dense (no baselines yet)
            g.step(version)
            assert sync.stage(mode="sparse").commit().mode == mode  # the spares caught up with the live round
            g.check(version)
        g.step(5)
        sync.stage(names=["w"]).commit()
        g.check(5, names=["w"])
        g.check(4, names=["v", "n"])
        g.step(6)
        assert sync.push(mode="sparse").version == 6, "blocking rounds follow staged ones"
        g.check(6)


def test_misuse_of_staged_rounds_is_refused_naming_what_to_do(ray_session):
    with _group() as g:
        with pytest.raises(
            ValueError,
            match=r"^stage: a staged round lands in the workers' shadow copies while they serve, which only a "
            r"double-buffered group keeps; create the group with SyncConfig\(double_buffer=True\)$",
        ):
            g.connect().stage()
        assert g.sync.summary.swap_bytes == (0, 0), "no shadows to swap without double buffering"
        g.sync.close()
        sync = WeightSync.create(g.trainers, g.workers, replace(g.config, double_buffer=True))
        g.sync = sync
        g.step(1)
        staged = sync.stage()
        for call, what in ((sync.push, "push"), (sync.stage, "stage")):
            with pytest.raises(
                ValueError,
                match=rf"^{what}: round 1 is staged and not committed; commit it first \(StagedRound.commit\(\)\)$",
            ):
                call()
        staged.commit()
        with pytest.raises(ValueError, match=r"^push: version 1 is not newer than the last applied version 1$"):
            sync.push(version=1)
        with pytest.raises(ValueError, match=r"^commit: round 1 was committed already$"):
            staged.commit()
        g.check(1)


def test_a_worker_dying_during_a_staged_round_leaves_the_others_serving_then_the_group_repairs(ray_session, tmp_path):
    with _group(double_buffer=True, round_timeout_s=6.0) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        gate = str(tmp_path / "gate")
        _gate(g, gate)
        ray.get(g.workers[1].call.remote(lambda self: self.state.update(die=True)))
        g.step(2)
        staged = sync.stage()  # the trainers wait at the gate: worker 1 dies only after this returned
        open(gate, "w").close()
        start = time.monotonic()
        with pytest.raises(
            SyncError, match=r"round 2 \(m2n\), staged failed on 1 of 2 members:\n  worker 1 \(rank 3\)"
        ):
            staged.commit()
        assert time.monotonic() - start < 6.0 + 10.0, "the commit outlived the round's timeout"
        survivor = ray.get(g.workers[0].call.remote(read_all))
        for name, value in expected(RECIPES, 0, 1).items():  # committed nowhere: worker 0 serves version 1 in full
            assert torch.equal(survivor[name], as_bytes(value)), name
        assert sync.versions()[0] == 1
        g.step(3)
        assert sync.push(version=3).mode == "m2n"  # the restarted worker rejoins; a full round brings both to 3
        g.check(3)
        assert sync.versions() == [3, 3]


def _replace(actor, name: str) -> None:
    """The engine puts a new tensor, of the same layout, where it keeps `name` (holding zeros)."""
    bound = actor.held[name]
    actor.held[name] = replace(bound, local=torch.zeros_like(bound.local))


def test_weights_the_engine_replaces_around_a_staged_round_get_what_it_commits(ray_session):
    """The watch (`rl_sync.rank.watch`): `w`, replaced after a commit swapped its storage, is bound
    anew before the next round (a round of `v` only), its spare caught up from the tensor it
    replaced; `n`, replaced while a round is staged, is bound anew before the commit. Each new tensor
    gets what the commit makes live."""
    with _group(double_buffer=True) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        g.step(2)
        sync.stage().commit()  # by swap: the spares hold version 1 now
        ray.get([w.call.remote(_replace, "w") for w in g.workers])
        g.step(3)
        staged = sync.stage(names=["v"])
        ray.get([w.call.remote(_replace, "n") for w in g.workers])
        staged.commit()
        g.check(3, names=["v"])
        g.check(2, names=["w", "n"])
        assert sync.versions() == [3, 3]
        g.step(4)
        assert sync.stage(mode="sparse").commit().mode == "m2n"  # (a first sparse request runs dense)
        g.check(4)


def test_a_stage_or_commit_the_driver_gave_up_on_commits_nothing(ray_session):
    """The coordinator stopped (SIGSTOP) for the whole call, then resumed: it refuses a stage it
    finds abandoned (nothing staged), and drops the round of a commit it finds abandoned (the
    workers serve version 1 in full; the next push repairs)."""
    with _group(double_buffer=True) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        g.step(2)
        with (
            _stopped(sync.coordinator),
            pytest.raises(
                SyncError,
                match=r"^the coordinator did not answer within 4 s \(the call's budget of 2 s plus 2 s\); version 2 "
                r"was not staged and never will be: stage or push it again$",
            ),
        ):
            sync.stage(version=2, timeout_s=2.0)
        staged = sync.stage(version=2)
        with _stopped(sync.coordinator), pytest.raises(SyncError, match=NOT_APPLIED.format(w=4, b=2, v=2)):
            staged.commit(timeout_s=2.0)
        assert sync.versions() == [1, 1]
        g.check(1)
        assert sync.push(version=2).mode == "m2n"
        g.check(2)
        assert sync.versions() == [2, 2]


def _tell(actor, **state) -> None:
    ray.get(actor.call.remote(lambda self: self.state.update(state)))


def test_a_round_a_worker_refuses_before_the_commit_is_committed_nowhere(ray_session):
    """Worker 1 refuses staged round 2 as it lands (its engine cannot process it), then round 3 just
    before the commit (its destinations mapping names a tensor the group did not bind). Each time
    every worker keeps the version before in full, and the next push repairs the group."""
    with _group(double_buffer=True) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        _tell(g.workers[1], refuse=True)
        g.step(2)
        staged = sync.stage()
        with pytest.raises(
            ValueError,
            match=r"^round 2 \(m2n\), staged failed on 1 of 2 members:\n  worker 1 \(rank 3\): ValueError: engine: "
            r"cannot process this round$",
        ):
            staged.commit()
        g.check(1)
        assert sync.versions() == [1, 1]
        g.step(3)
        assert sync.push(version=3).mode == "m2n"  # a repair: the workers' shadows held round 2
        g.check(3)
        g.step(4)
        staged = sync.stage(version=4)
        ray.get(g.workers[1].call.remote(lambda self: self.held.update(extra=self.held["n"])))
        with pytest.raises(ValueError, match=r"^round 4 \(m2n\), staged failed on 1 of 2 members:\n  worker 1 "):
            staged.commit()
        g.check(3)
        assert sync.versions() == [3, None]  # (worker 1's bindings no longer match its engine)
        ray.get(g.workers[1].call.remote(lambda self: self.held.pop("extra")))
        g.step(5)
        sync.push(version=5)
        g.check(5)
        assert sync.versions() == [5, 5]
