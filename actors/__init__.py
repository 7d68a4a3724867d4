"""Ray layer: coordinator actor, trainer/worker mixins and ready actors,
placement groups, and the driver-side `WeightSync` handle.

Names are imported on first use (PEP 562), so `rl-sync plan`, which needs no
cluster, runs without importing Ray."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "SyncError": ".calls", "SyncTrainerMixin": ".trainer_mixin", "SyncWorkerMixin": ".worker_mixin",
    "SyncPlacement": ".placement", "HybridActor": ".ready", "InferenceWorker": ".ready", "TrainerActor": ".ready",
    "WeightSync": ".weight_sync",
}

__all__ = ["HybridActor", "InferenceWorker", "SyncError", "SyncPlacement", "SyncTrainerMixin", "SyncWorkerMixin",
           "TrainerActor", "WeightSync"]

if TYPE_CHECKING:
    from .calls import SyncError
    from .placement import SyncPlacement
    from .ready import HybridActor, InferenceWorker, TrainerActor
    from .trainer_mixin import SyncTrainerMixin
    from .weight_sync import WeightSync
    from .worker_mixin import SyncWorkerMixin


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
