"""Wire types between the coordinator and the ranks (encoded with `rl_sync.wire.codec`).

Init: each rank reports its tensors (`RankReport`), the coordinator answers
with `InitInfo` (which names a transport of `TRANSPORT_NAMES` and carries its own
rendezvous message, decoded by `rl_sync.transport.registry`) plus the shared plan message (`PlanInfo`). Per round:
`RoundInfo` (a version, a mode and optionally a subset of names; never
layouts) goes out and `RankStats` comes back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ..config.sync import BaselineDevice, Integrity, Mode, check_seconds
from ..rendezvous.auth import check_secret
from .plan_info import LayoutInfo

TransportName = Literal["gloo", "nccl", "local"]
"""The transports a group's ranks connect with (the summary's `transport`); a colocated trainer's
`cuda_ipc` rides on one of them."""
WriteMode = Literal["direct", "reload", "fallback"]
"""How a worker writes one tensor (`RankReport.modes`)."""
Role = Literal["trainer", "worker", "both"]
"""What a rank does in a round: sends (a trainer), receives (a worker), or both (colocated)."""
TRANSPORT_NAMES = ("cuda_ipc", "gloo", "local", "nccl")
"""Every transport a rank can join (`rl_sync.transport.registry.TRANSPORTS` maps each to its class),
sorted: the wire checks a name without importing a transport."""


def check_transport(name: str) -> None:
    """A `ValueError` listing the known names unless `name` is one of `TRANSPORT_NAMES`."""
    if name not in TRANSPORT_NAMES:
        raise ValueError(f"unknown transport {name!r}; known transports: {', '.join(TRANSPORT_NAMES)}")


@dataclass(frozen=True)
class TensorReport:
    """One tensor as a side sees it: layout over that side's own ranks `[0, n)`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    layout: LayoutInfo
    block: tuple[int, ...] = ()
    """A destination keeping it block-quantized: the block size (`rl_sync.planning.quant`)."""


@dataclass(frozen=True)
class RankReport:
    """What one rank reports at init."""

    rank: int
    device: str
    gpu: str
    """`node/uuid` of the GPU this rank's tensors are on ('' on CPU): finds colocated pairs."""
    tensors: tuple[TensorReport, ...]
    modes: dict[str, WriteMode]
    """A worker's write mode per name: in place (`direct`), into a buffer the engine processes
    after each round (`reload`), or whole and handed to a load hook (`fallback`)."""
    kept_bytes: int
    """Bytes of what a worker keeps (its boxes; whole tensors of fallbacks): a dense round
    brings exactly these."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why each of a worker's fallbacks falls back (`Destination.reason`)."""
    swap_bytes: int = 0
    """Bytes of what a double-buffered worker's commit swaps in O(1) rather than copies
    (`rl_sync.rank.shadow`: where the engine and this PyTorch allow it)."""
    control_group: str = ""
    """The Ray concurrency group a worker's actor declares for a staged round's calls, so they
    run beside its generation (`rl_sync.rank.steps`); '' where it declares none."""
    engine_ranks: int = 1
    """With a control group: the ranks of this worker's engine (its tensor-parallel size), this one
    and the workers next to it in the group's order, which must commit before the same step of
    their engine (`rl_sync.rank.steps`: armed first, together)."""
    engine: str = ""
    """With more than one engine rank: a name the engine's ranks drew together at binding, the
    same on each (the coordinator checks that the ranks it groups are one engine's)."""


@dataclass(frozen=True)
class InitInfo:
    """How a rank joins the sync group."""

    rank: int
    world_size: int
    num_trainers: int
    worker_ranks: tuple[int, ...]
    transport: str
    """One of `TRANSPORT_NAMES`."""
    rendezvous: bytes
    """That transport's own rendezvous message, encoded (`rl_sync.wire.codec`); joining decodes it
    as the type the name selects."""
    prefix: str
    """Names the group: its store keys and its digests' label."""
    timeout_s: float
    """Bounds each wait of the group's operations."""
    join_timeout_s: float
    """Bounds joining the group's transport (Gloo's connections; NCCL's communicator takes no
    bound): shorter than the coordinator's wait for the join (`rl_sync.planning.agreement.join_bound`),
    so a rank whose peer never joins says so while the coordinator still listens."""
    sparse_baseline: BaselineDevice
    """`SyncConfig.sparse_baseline`: where sparse rounds keep their baselines."""
    integrity: Integrity
    """The digest every transfer carries (`rl_sync.transport.digest`)."""
    interface: str
    """`SyncConfig.interface`, or '' for none."""
    secret: bytes = field(repr=False)
    """The group's secret: opens the rendezvous store and keys the digests. Travels only
    through Ray calls (or a vLLM service's init call); never printed."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size or not 0 < self.num_trainers <= self.world_size:
            raise ValueError(
                f"InitInfo: rank {self.rank}, {self.num_trainers} trainers and world size {self.world_size} "
                "are inconsistent"
            )
        if not self.worker_ranks or not all(0 <= r < self.world_size for r in self.worker_ranks):
            raise ValueError(f"InitInfo: worker ranks {self.worker_ranks} must be non-empty and inside the group")
        check_seconds("InitInfo.timeout_s", self.timeout_s)
        check_seconds("InitInfo.join_timeout_s", self.join_timeout_s)
        check_transport(self.transport)
        if self.integrity not in ("off", "checksum", "keyed"):
            raise ValueError(f"InitInfo.integrity must be 'off', 'checksum' or 'keyed', got {self.integrity!r}")
        check_secret(self.secret)


@dataclass(frozen=True)
class RoundInfo:
    """One round: the version it produces, the mode, and `None` for every tensor."""

    version: int
    mode: Mode
    names: tuple[str, ...] | None
    timeout_s: float
    baseline: bool
    """Trainers keep per-tensor baselines (the last synced values) up to date this round."""
    ticket: int = 0
    """A colocated round's number, larger than any earlier round's of the group: each colocated
    pair meets on it (`rl_sync.transport.doorbell`), and every trainer first agrees with the others
    whether all may write. 0: no colocated pair takes part."""

    def __post_init__(self) -> None:
        if self.version <= 0:
            raise ValueError(f"RoundInfo.version must be > 0, got {self.version}")
        if self.ticket < 0:
            raise ValueError(f"RoundInfo.ticket must be >= 0, got {self.ticket}")
        check_seconds("RoundInfo.timeout_s", self.timeout_s)


@dataclass(frozen=True)
class RankStats:
    """What one rank did in one round."""

    rank: int
    role: Role
    version: int
    mode: Mode
    seconds: float
    sent_bytes: int
    received_bytes: int
    zero_copy_bytes: int
    staged_bytes: int
    local_bytes: int
    messages: int
    buckets: int
    staging_bytes: int
    baseline_bytes: int
    """Memory holding the last synced values for sparse rounds (0 until sparse is used)."""
    dense_bytes: int
    """What a dense round would have moved for the same transfers (sparse rounds)."""
    changed_elements: int
    encodings: dict[str, int]
    """Sparse transfers per encoding: indices, blocked, bitmap, dense."""
    fallbacks: int = 0
    """Tensors this worker received whole and handed to its load hook."""
    placed_buckets: int = 0
    """Buckets of a sparse round whose payloads this rank's GPU encoded and laid out with no host
    step after finding the changes (`sparse_codec.BucketChanges.placed`); its other sent buckets
    the host encoded (another device, dtypes mixed in a bucket, or payloads that outgrew the buffer
    kept for them)."""
