"""`SyncConfig`: how a sync group moves weights (transport, mode, buckets, timeouts).

Loaded from the `sync:` section of the YAML files in `configs/`, or built in
code: `SyncConfig(transport="gloo", bucket_bytes=64 << 20)`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

Transport = Literal["auto", "gloo", "nccl"]
Colocate = Literal["auto", "ipc", "off"]
Mode = Literal["m2n", "broadcast", "sparse", "auto"]
"""How a round moves weights (`SyncConfig.mode`); the one list of round modes."""
SPARSE_MODES: tuple[Mode, ...] = ("sparse", "auto")
"""The modes that send changes against baselines (the sparse engine)."""
DENSE_MODES: tuple[Mode, ...] = ("m2n", "broadcast")
"""The modes that write every element of the tensors a round carries."""

Relay = Literal["off", "on", "auto"]
BaselineDevice = Literal["device", "pinned_cpu"]
Integrity = Literal["keyed", "checksum", "off"]


def writes_every_element(mode: str, names: Sequence[str] | None) -> bool:
    """Whether a round of `mode` over `names` (None: every tensor) writes every element a worker
    binds: then its shadows need not catch up first (`rl_sync.rank.shadow`)."""
    return mode in DENSE_MODES and names is None


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """Settings of one `WeightSync`."""

    name: str = "default"
    """Names this sync group in logs and Ray metrics."""
    transport: Transport = "auto"
    """`auto`: NCCL when the tensors are on CUDA and CuPy imports, Gloo otherwise."""
    colocate: Colocate = "auto"
    """`auto`: when every worker shares its GPU with a trainer, trainers write straight into the
    workers' memory through CUDA IPC (`ipc` insists on it, `off` never does)."""
    mode: Mode = "m2n"
    """Default mode of `push`: resharded dense point-to-point, the broadcast baseline, changed
    elements only (`sparse`: indices or bitmap), or per transfer whichever is smallest (`auto`)."""
    relay: Relay = "off"
    """Relay among engine replicas (`rl_sync.planning.relay`): trainers send each replicated box to one
    replica and workers forward it down a chain of the others, so each trainer sends about
    1/replicas of its shards' copies. `on` always (refused without replicas), `auto` when the
    byte model says it shortens the round (the summary's `relay` says why)."""
    sparse_baseline: BaselineDevice = "device"
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
    """Address each rank's Gloo device binds; `None`: the address of `interface`, else that
    rank's Ray node address."""
    interface: str | None = None
    """Network interface (e.g. 'eth1') whose IPv4 address each rank binds for Gloo, and the store
    listens on, on hosts with several; NCCL ranks get it as `NCCL_SOCKET_IFNAME` unless that is
    set. `bind_host` and `rendezvous_host` take precedence."""
    integrity: str = "keyed"
    """Digest on every transfer, checked before a round counts: `keyed` (keyed BLAKE3 under the group's
    secret: catches tampering and corruption), `checksum` (corruption only), `off`. See
    `docs/security.md` for what each costs. One of `Integrity`; typed `str` so a YAML value
    outside it is refused by `__post_init__`, which names the choices."""

    @property
    def init_budget_s(self) -> float:
        """Default bound on forming (or re-forming) the group, all steps together: describing
        trainers and workers, CUDA IPC exports or NCCL ids, connecting."""
        return 4 * self.init_timeout_s

    @property
    def push_budget_s(self) -> float:
        """Default bound on one push, all of it: a repair first when an earlier round failed, the
        round, and its commit or CUDA IPC steps (each round step may take the round timeout
        plus 5 s for the ranks to report)."""
        return self.init_budget_s + 2 * (self.round_timeout_s + 5)

    def __post_init__(self) -> None:
        """Every field checked where it enters: type, choice, finite range."""
        _text("name", self.name)
        for field, options in CHOICES.items():
            if getattr(self, field) not in options:
                raise ValueError(
                    f"SyncConfig.{field} must be one of {', '.join(map(repr, options))}, got {getattr(self, field)!r}"
                )
        for field in ("double_buffer", "auto_repair"):
            if not isinstance(getattr(self, field), bool):
                raise TypeError(f"SyncConfig.{field} must be True or False, got {getattr(self, field)!r}")
        check_int("SyncConfig.bucket_bytes", self.bucket_bytes, 1, MAX_BUCKET_BYTES)
        check_int("SyncConfig.coalesce_bytes", self.coalesce_bytes, 0, MAX_BUCKET_BYTES)
        check_int("SyncConfig.dense_refresh_every", self.dense_refresh_every, 0, 1 << 31)
        check_int("SyncConfig.rendezvous_port", self.rendezvous_port, 0, 65535)
        for field in ("init_timeout_s", "round_timeout_s"):
            check_seconds(f"SyncConfig.{field}", getattr(self, field))
        for field in ("rendezvous_host", "bind_host", "interface"):
            if getattr(self, field) is not None:
                _text(field, getattr(self, field))


MAX_BUCKET_BYTES = 1 << 40
"""1 TiB: far above any device's memory; bounds the sizes the planner multiplies."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
CHOICES = {
    "transport": get_args(Transport),
    "colocate": get_args(Colocate),
    "mode": get_args(Mode),
    "relay": get_args(Relay),
    "sparse_baseline": get_args(BaselineDevice),
    "integrity": get_args(Integrity),
}
"""The allowed values of each choice field, read off the `Literal` types above."""


def either(choices: tuple[str, ...]) -> str:
    """`'a', 'b' or 'c'`: a `Literal`'s choices (`typing.get_args`) as an error message names them."""
    return " or ".join(filter(None, [", ".join(map(repr, choices[:-1])), repr(choices[-1])]))


def check_int(label: str, value, low: int, high: int) -> int:
    """`value` as an int in [`low`, `high`] (a bool is not one); `label` names it in errors."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{label} must be an int, got {value!r} ({type(value).__name__})")
    if not low <= value <= high:
        raise ValueError(f"{label} must be in [{low}, {high}], got {value}")
    return value


def check_number(label: str, value, positive: bool = False) -> float:
    """`value` as a finite number, >= 0 (> 0 when `positive`); `label` names it in errors."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label} must be a number, got {value!r} ({type(value).__name__})")
    if not (0 < value < math.inf if positive else 0 <= value < math.inf):  # NaN fails both
        raise ValueError(f"{label} must be finite and {'> 0' if positive else '>= 0'}, got {value}")
    return float(value)


def check_seconds(label: str, value) -> float:
    """`value` as a timeout in seconds: a number in (0, 7 days]; `label` names it in errors."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{label} must be a number of seconds, got {value!r}")
    if not 0 < value <= MAX_TIMEOUT_S:  # NaN fails this too
        raise ValueError(f"{label} must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds, got {value}")
    return float(value)


def check_port(label: str, port: int, low: int = 0) -> None:
    """`port` is a TCP port number in [`low`, 65535]; `label` names it in errors."""
    if not low <= port <= 65535:
        raise ValueError(f"{label} must be a port in [{low}, 65535], got {port}")


def _text(field: str, value) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"SyncConfig.{field} must be a non-empty str, got {value!r}")
