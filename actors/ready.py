"""Ready trainer and worker actor classes: test and benchmark fixtures.

They are not among the public `actors` names, since `call(fn)` runs any
function the driver sends inside the actor: import them from here
(`from actors.ready import TrainerActor`), in tests, benchmarks and the demo
notebook, not in a training job.

Each holds whatever its `build(rank, size)` callable returns (tensors for a
trainer, `Destination`s for a worker) and runs arbitrary functions on itself
with `call`, so a test or benchmark can step an optimizer or read weights
without defining a class::

    Trainer = ray.remote(TrainerActor)
    t = Trainer.options(**placement.trainer(0)).remote(0, 4, build_sources)
    ray.get(t.call.remote(train_step, batch))
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

import ray

from .trainer_mixin import SyncTrainerMixin
from .worker_mixin import SyncWorkerMixin


class _Holder:
    def __init__(self, rank: int, size: int, build: Callable[[int, int], Mapping[str, Any]]):
        self.rank, self.size = rank, size
        self.state: dict[str, Any] = {}
        built = build(rank, size)
        self.held = dict(built) if isinstance(built, Mapping) else {"sources": built[0], "destinations": built[1]}

    @ray.method  # typed: handles get `call.remote`
    def call(self, fn: Callable, *args, **kwargs) -> Any:
        """Run `fn(self, *args, **kwargs)` in this actor."""
        return fn(self, *args, **kwargs)


class TrainerActor(_Holder, SyncTrainerMixin):
    """A trainer rank whose sources are `build(rank, size)`'s tensors."""

    def rl_sync_sources(self) -> Mapping[str, Any]:
        return self.held


class InferenceWorker(_Holder, SyncWorkerMixin):
    """A worker rank whose destinations are `build(rank, size)`'s `Destination`s; nothing captures
    their addresses, so a double-buffered commit swaps them."""

    def rl_sync_destinations(self, checkpoint=None) -> Mapping[str, Any]:
        return self.held

    def rl_sync_swappable(self) -> Collection[str]:
        return self.held.keys()


class HybridActor(_Holder, SyncTrainerMixin, SyncWorkerMixin):
    """One process that trains and serves: `build` returns `(sources, destinations)`.

    Pass the same handle in both the trainer and the worker lists: it joins the
    group as one rank and copies its own overlap locally."""

    def rl_sync_sources(self) -> Mapping[str, Any]:
        return self.held["sources"]

    def rl_sync_destinations(self, checkpoint=None) -> Mapping[str, Any]:
        return self.held["destinations"]
