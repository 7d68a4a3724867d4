"""Start trainers and workers for a list of recipes, push, and check bit-exactness."""

from __future__ import annotations

import ray
import torch

from actors import InferenceWorker, TrainerActor, WeightSync

from .conftest import loopback_config
from .recipes import as_bytes, expected, read_all, set_version, trainer_build, worker_build

Trainer = ray.remote(num_cpus=0.1)(TrainerActor)
Worker = ray.remote(num_cpus=0.1)(InferenceWorker)


class Group:
    """T trainer actors and N worker actors holding `recipes`, plus their WeightSync."""

    def __init__(self, recipes, num_trainers: int, num_workers: int, worker_recipes=None, **config):
        self.recipes = recipes
        self.trainers = [Trainer.remote(i, num_trainers, trainer_build(recipes)) for i in range(num_trainers)]
        self.workers = [Worker.remote(j, num_workers, worker_build(worker_recipes or recipes)) for j in range(num_workers)]
        self.sync = None
        self.config = loopback_config(**config)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.sync is not None:
            try:
                self.sync.close()
            except Exception:
                pass
        for actor in self.trainers + self.workers:
            ray.kill(actor)

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
                assert torch.equal(tensors[name], as_bytes(value)), f"worker {j}: tensor {name} differs at version {version}"
