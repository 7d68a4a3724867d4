"""`WeightSync`: the driver-side handle of one sync group.

Typical use, between training steps::

    sync = WeightSync.create(trainers, workers, SyncConfig(bucket_bytes=64 << 20))
    stats = sync.push()                 # every tensor, next version
    stats = sync.push(names=["lm_head.weight"], mode="broadcast")
    sync.close()

`trainers[i]` must be the actor whose layouts call it rank i (its default
process-group rank for DTensors); workers follow in their own order.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext

import ray
from rich.console import Console

from rl_sync.push_args import check_push_args, check_version
from rl_sync.stats import RoundStats
from rl_sync.sync_config import SyncConfig

from .calls import SyncError
from .coordinator import Coordinator

log = logging.getLogger("rl_sync")


def _unwrap(ref, timeout_s: float):
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise SyncError(f"the coordinator did not answer within {timeout_s:.0f} s") from None
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, (ValueError, TypeError, SyncError)):
            raise type(cause)(str(cause)) from None
        raise SyncError(str(cause)) from None


def _discard(coordinator, config: SyncConfig) -> None:
    """A create that failed leaves nothing behind: the actors it reached leave the group (bounded)
    and the coordinator goes; an actor it could not reach is freed all the same, since a group
    whose coordinator is dead holds no actor (`rl_sync.rank.claim`)."""
    try:
        ray.get(coordinator.close.remote(), timeout=config.init_timeout_s + 10)
    except ray.exceptions.RayError:
        pass
    finally:
        ray.kill(coordinator)


class WeightSync:
    """Handle to a Coordinator actor that owns one sync group."""

    def __init__(self, coordinator, config: SyncConfig, summary: dict):
        self.coordinator, self.config, self.summary = coordinator, config, summary
        self.closed = False

    def _open(self):
        """The coordinator, unless the group was closed."""
        if self.closed:
            raise SyncError(f"sync group {self.config.name!r} is closed; create a new WeightSync")
        return self.coordinator

    @classmethod
    def create(cls, trainers: list, workers: list, config: SyncConfig | None = None, *, progress: bool = True) -> WeightSync:
        """Start a coordinator, plan, and connect every rank (bounded by `init_timeout_s`);
        `progress` shows a spinner on the driver's terminal meanwhile."""
        config = config or SyncConfig()
        if not trainers or not workers:
            raise ValueError(f"WeightSync.create needs at least one trainer and one worker, got {len(trainers)} "
                             f"trainers and {len(workers)} workers")
        coordinator = ray.remote(Coordinator).options(num_cpus=0).remote(trainers, workers, config)
        try:
            with Console(stderr=True).status(f"rl-sync: planning and connecting {len(trainers)} trainers and "
                                             f"{len(workers)} workers", spinner="dots") if progress else nullcontext():
                summary = _unwrap(coordinator.setup.remote(), config.init_timeout_s * 2 + 10)
        except BaseException:
            _discard(coordinator, config)
            raise
        log.info("rl-sync group %r: %s", config.name, summary)
        return cls(coordinator, config, summary)

    def push(self, version: int | None = None, names: list[str] | None = None, mode: str | None = None) -> RoundStats:
        """Move the trainers' current weights into every worker; returns the round's statistics
        (also logged, and recorded as Ray metrics by the coordinator)."""
        version, names, mode = check_push_args(version, names, mode)
        stats = _unwrap(self._open().push.remote(version, names, mode), self.config.round_timeout_s + 30)
        log.info(stats.log_line())
        return stats

    def push_patches(self, patches, version: int | None = None) -> int:
        """Drop-in for vLLM's sparse patches: `SparseWeightPatch(name, indices, values)` with flat
        indices into the whole tensor, for any destination layout. Patches travel through
        Ray's object store; returns the version now held everywhere."""
        version = check_version(version)
        return _unwrap(self._open().push_patches.remote(list(patches), version), self.config.round_timeout_s + 30)

    def versions(self) -> list[int | None]:
        """The version each worker's live weights fully hold (None: torn, in flight, never synced, dead)."""
        return _unwrap(self._open().versions.remote(), self.config.init_timeout_s + 10)

    def repair(self) -> dict:
        """Re-form the group now (push does this by itself after a failure with `auto_repair`)."""
        return _unwrap(self._open().repair.remote(), self.config.init_timeout_s * 3 + 10)

    def replace_worker(self, index: int, handle) -> None:
        """Swap in a new actor for worker `index`; the next push re-forms the group and brings it
        to the current version with a full dense round."""
        _unwrap(self._open().replace_worker.remote(index, handle), self.config.init_timeout_s + 10)

    def close(self) -> None:
        """Release the group and the coordinator; closing again does nothing."""
        if self.closed:
            return
        self.closed = True
        try:
            _unwrap(self.coordinator.close.remote(), self.config.init_timeout_s + 10)
        finally:
            ray.kill(self.coordinator)
