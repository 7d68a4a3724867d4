"""`SyncTrainerMixin`: a user's trainer actor takes part in weight sync.

Define `rl_sync_sources()` returning `{checkpoint name: DTensor | Sharded | Tensor}`
(`actors.hooks.TrainerHooks`; see `rl_sync.rank.trainer` for how it is called
and cached).
"""

from __future__ import annotations

from rl_sync.rank import TrainerRank

from .participant import RayNode


class SyncTrainerMixin(RayNode, TrainerRank):
    """Inherit in a trainer actor and define `rl_sync_sources()`."""
