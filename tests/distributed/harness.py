"""Start trainers and workers for a list of recipes, push, and check bit-exactness."""

from __future__ import annotations

import contextlib

import ray
import torch

from actors import WeightSync
from actors.ready import InferenceWorker, TrainerActor

from .conftest import loopback_config
from .recipes import as_bytes, expected, read_all, set_version, trainer_build, worker_build

Trainer = ray.remote(num_cpus=0.1)(TrainerActor)
Worker = ray.remote(num_cpus=0.1)(InferenceWorker)


def _reinitialise(actor, *args) -> None:
    """Forget everything (the rl-sync state of any earlier group and the process's default
    torch.distributed group included) and start over."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    actor.__dict__.clear()
    type(actor).__init__(actor, *args)


def _ping(actor) -> None:
    """Answers while the actor is alive and idle."""


class ActorPool:
    """Actors reused across tests: a new Ray actor costs seconds on a 2-core machine (a process,
    torch's import), so a test takes actors of a class re-initialised with its arguments, and
    gives back the ones that still answer; a later group binds them anew, as it must any actor
    that was in an earlier, closed group."""

    def __init__(self) -> None:
        self.idle: dict[object, list] = {}

    def take(self, remote_class, args: list[tuple]) -> list:
        idle = self.idle.setdefault(remote_class, [])
        reused = [idle.pop() for _ in args[: len(idle)]]
        pending = [actor.call.remote(_reinitialise, *a) for actor, a in zip(reused, args)]
        actors = reused + [remote_class.remote(*a) for a in args[len(reused) :]]  # before waiting: ranks rendezvous
        ray.get(pending, timeout=120)
        return actors

    def give_back(self, remote_class, actors: list) -> None:
        """Keep the actors that answer within 2 s; kill the rest (dead, stalled, restarted)."""
        pings = [actor.call.remote(_ping) for actor in actors]
        ready, _ = ray.wait(pings, num_returns=len(pings), timeout=2.0)
        for actor, ping in zip(actors, pings):
            try:
                if ping not in ready:
                    raise TimeoutError
                ray.get(ping)
                self.idle.setdefault(remote_class, []).append(actor)
            except Exception:
                ray.kill(actor)


POOL = ActorPool()


class Group:
    """T trainer actors and N worker actors holding `recipes`, plus their WeightSync."""

    def __init__(
        self, recipes, num_trainers: int, num_workers: int, worker_recipes=None, classes=(Trainer, Worker), **config
    ):
        self.recipes, self.classes = recipes, classes
        trainer_class, worker_class = classes
        trainer_args = [(i, num_trainers, trainer_build(recipes)) for i in range(num_trainers)]
        self.trainers = POOL.take(trainer_class, trainer_args)
        self.workers = POOL.take(
            worker_class, [(j, num_workers, worker_build(worker_recipes or recipes)) for j in range(num_workers)]
        )
        self.sync: WeightSync | None = None
        self.config = loopback_config(**config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.sync is not None:
            with contextlib.suppress(Exception):
                self.sync.close()
        POOL.give_back(self.classes[0], self.trainers)
        POOL.give_back(self.classes[1], self.workers)

    def connect(self) -> WeightSync:
        self.sync = WeightSync.create(self.trainers, self.workers, self.config)
        return self.sync

    def step(self, version: int) -> None:
        ray.get([t.call.remote(set_version, self.recipes, version) for t in self.trainers])

    def check(self, version: int, names=None) -> None:
        got = ray.get([w.call.remote(read_all) for w in self.workers])
        for j, tensors in enumerate(got):
            want = expected(self.recipes, j, version)
            for name, value in want.items():
                if names is not None and name not in names:
                    continue
                assert torch.equal(tensors[name], as_bytes(value)), (
                    f"worker {j}: tensor {name} differs at version {version}"
                )
