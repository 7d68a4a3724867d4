"""Actors without their mixin or hooks are refused on the driver; a rank's error reaches it typed,
with the rank's traceback."""

from __future__ import annotations

import pytest
import ray
import torch

from actors import SyncTrainerMixin, SyncWorkerMixin, WeightSync
from actors.ready import InferenceWorker, TrainerActor
from rl_sync.wire.failure import RemoteTraceback

from .conftest import loopback_config


class NoSources(SyncTrainerMixin):
    """A trainer that forgot `rl_sync_sources`."""


class NoDestinations(SyncWorkerMixin):
    """A worker that forgot `rl_sync_destinations`."""


class NotAWorker:
    """An actor without the worker mixin."""

    def ping(self) -> None:
        """Answers."""


class Refusing(InferenceWorker):
    """A worker whose binding fails the way a caller's mistake does."""

    def rl_sync_destinations(self, checkpoint=None):
        raise ValueError("no room for these weights")


def _replicated(rank: int, size: int) -> dict:
    return {"w": torch.arange(6, dtype=torch.float32)}


@pytest.fixture
def actors(ray_session):
    """Start actors of the given classes (a small CPU share each); kill them afterwards."""
    started = []

    def start(cls: type, *args):
        started.append(ray.remote(num_cpus=0.1)(cls).remote(*args))
        return started[-1]

    yield start
    for actor in started:
        ray.kill(actor)


def test_missing_mixins_and_hooks_are_refused_on_the_driver_naming_actor_and_hook(actors):
    trainer, worker = actors(TrainerActor, 0, 1, _replicated), actors(InferenceWorker, 0, 1, _replicated)
    with pytest.raises(
        TypeError,
        match=r"^trainer 0: NoSources must define rl_sync_sources\(\) -> \{name: DTensor \| "
        r"Sharded \| Tensor\} \(actors.hooks.TrainerHooks\)$",
    ):
        WeightSync.create([actors(NoSources)], [worker], loopback_config(), progress=False)
    with pytest.raises(
        TypeError,
        match=r"^worker 1: NoDestinations must define rl_sync_destinations\(checkpoint\) -> "
        r"\{name: Destination\} \(actors.hooks.WorkerHooks\)$",
    ):
        WeightSync.create([trainer], [worker, actors(NoDestinations)], loopback_config(), progress=False)
    with pytest.raises(
        TypeError,
        match=r"^worker 0: NotAWorker is asked to be a worker but does not inherit the "
        r"worker mixin \(actors.SyncWorkerMixin\)$",
    ):
        WeightSync.create([trainer], [actors(NotAWorker)], loopback_config(), progress=False)
    unformed = WeightSync(None, loopback_config(), None)  # the check runs before the coordinator is asked
    with pytest.raises(TypeError, match=r"^replace_worker: worker 0: NotAWorker is asked to be a worker"):
        unformed.replace_worker(0, actors(NotAWorker))


def test_a_rank_error_keeps_its_type_and_brings_its_traceback(actors):
    trainer, worker = actors(TrainerActor, 0, 1, _replicated), actors(Refusing, 0, 1, _replicated)
    with pytest.raises(
        ValueError,
        match=r"^init \(bind workers\) failed on 1 of 1 members:\n  worker 0 \(rank 1\): "
        r"ValueError: no room for these weights$",
    ) as info:
        WeightSync.create([trainer], [worker], loopback_config(), progress=False)
    remote = info.value.__cause__
    assert isinstance(remote, RemoteTraceback)
    assert "in _setup" in str(remote), "the coordinator's traceback"
    assert "worker 0 (rank 1): ray::Refusing._rl_sync_describe()" in str(remote), "the failing rank, named"
    assert 'in rl_sync_destinations\n    raise ValueError("no room for these weights")' in str(remote), "its frames"
