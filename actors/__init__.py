"""Ray layer: coordinator actor, trainer/worker mixins and ready actors,
placement groups, and the driver-side `WeightSync` handle."""

from .calls import SyncError
from .participant import SyncTrainerMixin, SyncWorkerMixin
from .placement import SyncPlacement
from .ready import HybridActor, InferenceWorker, TrainerActor
from .weight_sync import WeightSync

__all__ = [
    "HybridActor", "InferenceWorker", "SyncError", "SyncPlacement", "SyncTrainerMixin", "SyncWorkerMixin", "TrainerActor", "WeightSync",
]
