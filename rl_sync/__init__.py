"""rl-sync core: layouts, the reshard planner and schedule, wire codecs, the engine
and transports. Imports without Ray; `actors` is the Ray layer."""

from .layout import Box, Layout, Mesh, Replicate, Shard
from .plan import SideSpec, TensorSpec, join_specs, plan_model, plan_reshard
from .schedule import build_schedule
from .storage import Destination, Sharded
from .sync_config import SyncConfig

__all__ = [
    "Box", "Destination", "Layout", "Mesh", "Replicate", "Shard", "Sharded", "SideSpec", "SyncConfig", "TensorSpec",
    "build_schedule", "join_specs", "plan_model", "plan_reshard",
]
