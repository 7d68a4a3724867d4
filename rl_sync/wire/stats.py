"""What the driver sees of a sync group: its summary at init and per-round statistics."""

from __future__ import annotations

from dataclasses import dataclass

from .messages import RankStats, WriteMode


@dataclass(frozen=True, kw_only=True)
class SyncSummary:
    """What forming a sync group decided (`WeightSync.summary`; `repair()` returns a new one)."""

    tensors: int
    """Tensors in the plan (a tensor bound in parts counts each part, an FP8 one its scales)."""
    buckets: int
    """Buckets a full round walks (one grouped launch each)."""
    transport: str
    """What the ranks connected with: `nccl`, `gloo`, or `local` for a group of one rank."""
    cuda_ipc: bool
    """Every worker shares its GPU with a trainer, which writes into its memory through CUDA IPC."""
    world_size: int
    """Ranks in the collective group (a hybrid actor counts once)."""
    colocated: bool
    """Some worker is also a trainer (hybrid actors): it copies its overlap locally."""
    relay: str
    """What the schedule chose about relaying among engine replicas, and why."""
    plan_bytes: int
    """Bytes the plan's transfers carry: what a full dense round sends."""
    local_copy_bytes: int
    """Bytes a rank copies within itself instead of sending (hybrid actors)."""
    broadcast_bytes: int
    """The broadcast baseline's bytes: every full tensor to every worker."""
    fallbacks: tuple[str, ...]
    """Names workers receive whole and hand to their load hook, sorted."""
    fallback_reasons: dict[str, tuple[str, ...]]
    """The fallbacks grouped by why they fall back (`Destination.reason`), names sorted."""
    modes: dict[str, WriteMode]
    """Each name's write mode (`reload` where any worker processes it after a round)."""
    kept_bytes: tuple[int, ...]
    """Bytes each worker-side rank keeps: what a full dense round brings it."""
    swap_bytes: tuple[int, ...]
    """Bytes each worker-side rank's double-buffered commits swap in O(1) per storage; they copy
    the rest of `kept_bytes`. 0 without double buffering, where the engine does not allow it
    (`rl_sync_swappable`: CUDA graphs, sleep mode) and where the process cannot swap storages
    (`rl_sync.rank.swap.can_swap`)."""
    seconds: float
    """Wall time of planning and connecting."""


@dataclass(frozen=True)
class RoundStats:
    """One round: wall seconds on the coordinator and what every rank did."""

    version: int
    mode: str
    seconds: float
    ranks: tuple[RankStats, ...]
    reason: str = ""
    """Why the round ran in `mode` when that is not simply what was asked (`auto`'s choice, a
    first or refreshing dense round of a sparse request)."""
    commit_seconds: float = 0.0
    """The commit step of a double-buffered round: what engines serving between rounds wait for
    (for a staged round, `WeightSync.stage`, all they wait for; its `seconds` are then the slowest
    rank's transfer, made while they served). 0 without double buffering."""
    stall_seconds: float = 0.0
    """The longest any worker's engine stopped for the commit: between two of its steps where it
    was generating (`rl_sync.rank.steps`: the Ray call that brought the commit ran beside its
    generation), else the commit itself on the worker. 0 without double buffering, and where
    workers do not say (engine services)."""

    def _of(self, role: str) -> list[RankStats]:
        return [r for r in self.ranks if r.role == role]

    @property
    def busiest_sender_bytes(self) -> int:
        return max((r.sent_bytes for r in self._of("trainer")), default=0)

    @property
    def worker_received_bytes(self) -> int:
        """Bytes the busiest worker received."""
        return max((r.received_bytes for r in self._of("worker")), default=0)

    @property
    def total_bytes(self) -> int:
        return sum(r.received_bytes for r in self.ranks)

    @property
    def gbps(self) -> float:
        """Bytes into the busiest worker per second of the round (GB/s)."""
        return self.worker_received_bytes / max(self.seconds, 1e-9) / 1e9

    @property
    def staging_bytes(self) -> int:
        return max((r.staging_bytes for r in self.ranks), default=0)

    @property
    def dense_bytes(self) -> int:
        """What the trainers would have sent dense for the same transfers (sparse rounds)."""
        return sum(r.dense_bytes for r in self.ranks if r.role != "worker")

    @property
    def sent_bytes(self) -> int:
        return sum(r.sent_bytes for r in self.ranks)

    @property
    def placed_buckets(self) -> int:
        """Sent buckets the trainers' GPUs encoded with no host step (`RankStats.placed_buckets`)."""
        return sum(r.placed_buckets for r in self.ranks if r.role != "worker")

    @property
    def encodings(self) -> dict[str, int]:
        mix: dict[str, int] = {}
        for r in self.ranks:
            if r.role != "worker":
                for name, count in r.encodings.items():
                    mix[name] = mix.get(name, 0) + count
        return mix

    def log_line(self) -> str:
        return (
            f"rl-sync round {self.version} [{self.mode}]: {self.seconds:.3f} s, busiest trainer sent "
            f"{self.busiest_sender_bytes / 1e6:.1f} MB, busiest worker received "
            f"{self.worker_received_bytes / 1e6:.1f} MB ({self.gbps:.2f} GB/s), "
            f"staging {self.staging_bytes / 1e6:.1f} MB"
            + (f", commit {self.commit_seconds * 1e3:.1f} ms" if self.commit_seconds else "")
            + (f" (engines stopped {self.stall_seconds * 1e3:.2f} ms)" if self.stall_seconds else "")
            + (f"; {self.reason}" if self.reason else "")
        )
