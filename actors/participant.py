"""Where an actor runs, read off Ray: the one thing the Ray layer adds to a rank.

The rank logic itself is Ray-free (`rl_sync.rank`); a trainer actor inherits
`SyncTrainerMixin` (`actors/trainer_mixin.py`), a worker actor
`SyncWorkerMixin` (`actors/worker_mixin.py`), and an actor inheriting both is a
trainer and a worker at once (one process holding the training shards and the
inference weights: it joins the group as one rank and copies its overlap
locally). The coordinator calls the `_rl_sync_*` methods
(`rl_sync.rank.SyncRank`); users never do.
"""

from __future__ import annotations

import ray


class RayNode:
    """`_rl_sync_node()` from Ray: the node's id (colocated pairs share it) and its address;
    `_rl_sync_owner_alive(coordinator)`: whether a group's coordinator actor still runs."""

    def _rl_sync_node(self) -> tuple[str, str]:
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def _rl_sync_owner_alive(self, owner) -> bool:
        return coordinator_alive(owner)


def coordinator_alive(owner, timeout_s: float = 5.0) -> bool:
    """Whether the coordinator actor `owner` runs: it answers, or is busy (a round in flight
    counts as alive); only an actor Ray reports dead (killed, exited, its driver gone) is not."""
    if owner is None:
        return True
    try:
        ray.get(owner.__ray_ready__.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        return True
    except ray.exceptions.RayActorError:
        return False
    return True
