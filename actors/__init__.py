"""Ray layer: coordinator actor, trainer/worker mixins and the hooks they
need, placement groups, vLLM engines as workers, and the driver-side
`WeightSync` handle. The ready actors of tests and benchmarks live in
`actors.ready`, outside the public names.

Names are imported on first use (PEP 562), so `rl-sync plan`, which needs no
cluster, runs without importing Ray."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {
    "SyncError": ".calls",
    "SyncTrainerMixin": ".trainer_mixin",
    "SyncWorkerMixin": ".worker_mixin",
    "SyncPlacement": ".placement",
    "StagedRound": ".weight_sync",
    "VllmEngine": ".vllm",
    "VllmService": ".service",
    "WeightSync": ".weight_sync",
}

__all__ = [
    "StagedRound",
    "SyncError",
    "SyncPlacement",
    "SyncTrainerMixin",
    "SyncWorkerMixin",
    "VllmEngine",
    "VllmService",
    "WeightSync",
]

if TYPE_CHECKING:
    from .calls import SyncError
    from .placement import SyncPlacement
    from .service import VllmService
    from .trainer_mixin import SyncTrainerMixin
    from .vllm import VllmEngine
    from .weight_sync import StagedRound, WeightSync
    from .worker_mixin import SyncWorkerMixin


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'actors' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value
