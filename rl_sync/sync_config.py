"""`SyncConfig`: how a sync group moves weights (transport, mode, buckets, timeouts).

Loaded from the `sync:` section of the YAML files in `configs/`, or built in
code: `SyncConfig(transport="gloo", bucket_bytes=64 << 20)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Settings of one `WeightSync`."""

    name: str = "default"
    """Names this sync group in logs and Ray metrics."""
    transport: Literal["auto", "gloo", "nccl"] = "auto"
    """`auto`: NCCL when the tensors are on CUDA and CuPy imports, Gloo otherwise."""
    colocate: Literal["auto", "ipc", "off"] = "auto"
    """`auto`: when every worker shares its GPU with a trainer, trainers write straight into the
    workers' memory through CUDA IPC (`ipc` insists on it, `off` never does)."""
    mode: Literal["m2n", "broadcast", "sparse", "auto"] = "m2n"
    """Default mode of `push`: resharded dense point-to-point, the broadcast baseline, changed
    elements only (`sparse`: indices or bitmap), or per transfer whichever is smallest (`auto`)."""
    sparse_baseline: Literal["device", "pinned_cpu"] = "device"
    """Where trainers keep the last synced values sparse rounds diff against (one copy of each
    local shard, allocated at the first sparse or auto push)."""
    dense_refresh_every: int = 0
    """Run every K-th sparse or auto round dense (0: never)."""
    double_buffer: bool = False
    """Workers receive into a shadow copy of their bound tensors (one extra copy of those bytes)
    and switch the live weights only after the whole round succeeded (asynchronous RL)."""
    auto_repair: bool = True
    """After a failed round, the next `push` re-forms the group with the surviving and restarted
    actors and runs a full dense round before anything else."""
    bucket_bytes: int = 256 << 20
    """Bytes one rank sends plus receives in one bucket (one grouped launch)."""
    coalesce_bytes: int = 1 << 20
    """Segments under this size are packed into one message per peer."""
    init_timeout_s: float = 120.0
    """Bound on planning and forming the group."""
    round_timeout_s: float = 300.0
    """Bound on one round, on every rank and on the coordinator."""
    rendezvous_host: str | None = None
    """Address of the rendezvous store; `None`: the coordinator's Ray node address."""
    rendezvous_port: int = 0
    """Port of the rendezvous store; 0 picks a free one."""
    bind_host: str | None = None
    """Address each rank's Gloo device binds; `None`: that rank's Ray node address."""

    def __post_init__(self) -> None:
        if self.bucket_bytes <= 0:
            raise ValueError(f"SyncConfig.bucket_bytes must be > 0, got {self.bucket_bytes}")
        if self.coalesce_bytes < 0:
            raise ValueError(f"SyncConfig.coalesce_bytes must be >= 0, got {self.coalesce_bytes}")
        if self.init_timeout_s <= 0 or self.round_timeout_s <= 0:
            raise ValueError("SyncConfig timeouts must be > 0 seconds")
        if self.dense_refresh_every < 0:
            raise ValueError(f"SyncConfig.dense_refresh_every must be >= 0, got {self.dense_refresh_every}")
        if not 0 <= self.rendezvous_port < 65536:
            raise ValueError(f"SyncConfig.rendezvous_port must be in [0, 65536), got {self.rendezvous_port}")
