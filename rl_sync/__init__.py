"""rl-sync core: layouts, the reshard planner and schedule, wire codecs, the engine
and transports. Imports without Ray; `actors` is the Ray layer.

What a user needs from the core is importable from here: layouts (`Layout`,
`Mesh`, `Shard`, `Replicate`), what trainers and workers hand over (`Sharded`,
`Destination`, and the `Slot` an engine keeps a destination's parameter in),
binding a checkpoint into an engine's fused layout (`Binder`, `Rule`,
`ModelConfig`, `Parallel`), and the group's settings (`SyncConfig`).
The planner's own entry points (`plan_model`, `build_schedule`, `TensorSpec`)
are for tools built on it."""

from .bind import Binder, Rule
from .config.sync import SyncConfig
from .models import ModelConfig, Parallel
from .planning.layout import Box, Layout, Mesh, Replicate, Shard
from .planning.plan import TensorSpec, plan_model, plan_reshard
from .planning.schedule import build_schedule
from .storage import Destination, Sharded, Slot

__all__ = [
    "Binder",
    "Box",
    "Destination",
    "Layout",
    "Mesh",
    "ModelConfig",
    "Parallel",
    "Replicate",
    "Rule",
    "Shard",
    "Sharded",
    "Slot",
    "SyncConfig",
    "TensorSpec",
    "build_schedule",
    "plan_model",
    "plan_reshard",
]
