"""Ray layer: coordinator actor, trainer/worker mixins and ready actors,
placement groups, and the driver-side `WeightSync` handle."""

from .calls import SyncError
from .trainer_mixin import SyncTrainerMixin
from .worker_mixin import SyncWorkerMixin
from .placement import SyncPlacement
from .ready import HybridActor, InferenceWorker, TrainerActor
from .weight_sync import WeightSync

__all__ = [
    "HybridActor", "InferenceWorker", "SyncError", "SyncPlacement", "SyncTrainerMixin", "SyncWorkerMixin", "TrainerActor", "WeightSync",
]
