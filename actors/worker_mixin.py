"""`SyncWorkerMixin`: a user's inference-worker actor takes part in weight sync.

Define `rl_sync_destinations(checkpoint)` (`actors.hooks.WorkerHooks`) and, as
needed, the optional hooks of `actors.hooks.EngineHooks`; see
`rl_sync.rank.worker` for what they receive, versions and double buffering.
"""

from __future__ import annotations

from rl_sync.rank import WorkerRank

from .participant import RayNode


class SyncWorkerMixin(RayNode, WorkerRank):
    """Inherit in an inference-worker actor and define `rl_sync_destinations(checkpoint)`."""
