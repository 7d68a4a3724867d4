"""Placement groups for trainers and engines, and the meshes they define.

Bundle order is rank order: bundle i of the trainer group holds trainer rank i;
bundle `e * tp + j` of the inference group holds TP rank j of engine e (worker
rank `e * tp + j` on the worker side, `T + e * tp + j` in the sync group).

Typical use::

    groups = SyncPlacement.create(trainers=4, engines=2, tp=2, cpus=0.25)
    actor_cls.options(**groups.trainer(i)).remote(...)
    actor_cls.options(**groups.worker(e, j)).remote(...)
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rl_sync.planning.layout import Mesh


@dataclass
class SyncPlacement:
    """A trainer placement group and an inference placement group."""

    trainers: PlacementGroup
    engines: PlacementGroup
    num_trainers: int
    num_engines: int
    tp: int
    cpus: float
    gpus: float

    @classmethod
    def create(
        cls,
        trainers: int,
        engines: int,
        tp: int,
        *,
        cpus: float = 1.0,
        gpus: float = 0.0,
        strategy: str = "PACK",
        timeout_s: float = 120.0,
    ) -> SyncPlacement:
        """Reserve one bundle per trainer and per inference rank; waits up to `timeout_s`."""
        if trainers <= 0 or engines <= 0 or tp <= 0:
            raise ValueError(f"need trainers, engines and tp > 0, got {trainers}, {engines}, {tp}")
        bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
        train_pg = placement_group([dict(bundle) for _ in range(trainers)], strategy=strategy)
        infer_pg = placement_group([dict(bundle) for _ in range(engines * tp)], strategy=strategy)
        ready, _ = ray.wait([train_pg.ready(), infer_pg.ready()], num_returns=2, timeout=timeout_s)
        if len(ready) != 2:
            for pg in (train_pg, infer_pg):
                remove_placement_group(pg)
            raise TimeoutError(
                f"placement groups for {trainers} trainers and {engines}x{tp} workers were not "
                f"ready within {timeout_s:.0f} s: the cluster lacks {bundle} per bundle"
            )
        return cls(train_pg, infer_pg, trainers, engines, tp, cpus, gpus)

    def _options(self, pg: PlacementGroup, index: int) -> dict:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, "num_cpus": self.cpus, "num_gpus": self.gpus}

    def trainer(self, rank: int) -> dict:
        """`.options(...)` for trainer `rank`."""
        return self._options(self.trainers, rank)

    def worker(self, engine: int, tp_rank: int) -> dict:
        """`.options(...)` for TP rank `tp_rank` of engine `engine`."""
        return self._options(self.engines, engine * self.tp + tp_rank)

    @property
    def trainer_mesh(self) -> Mesh:
        return Mesh((self.num_trainers,))

    @property
    def worker_mesh(self) -> Mesh:
        """Engines x TP over the worker side's ranks `[0, engines * tp)`."""
        return Mesh((self.num_engines, self.tp))

    def remove(self) -> None:
        for pg in (self.trainers, self.engines):
            remove_placement_group(pg)
