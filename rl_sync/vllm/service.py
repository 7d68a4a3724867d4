"""Messages between the driver of a vLLM engine service and its ranks, through vLLM's calls.

A vLLM engine run as a service (an `LLM` whose workers are vLLM's own
processes, or `vllm serve`) is reached only through vLLM's weight-transfer
calls: `init_weight_transfer_engine(init_info)` and
`update_weights(update_info)` take a JSON-able dict and return nothing. So
each call carries one `ServiceCall` (an operation and an rl-sync wire message,
base64 in JSON), and each rank answers through the sync group's rendezvous
store: under `reply_key(prefix, op, tag, rank)` it sets its result, or
`ERROR` and an encoded `RankFailure` (`rl_sync.wire.failure`). The driver side (`actors.service`)
waits for every rank's answer, bounded in time.

Operations: `describe` (bind and report, answer: a `RankReport`), `connect`
(join the group; answer: empty), `run` (one round; answer: `RankStats`),
`stage` (a round into the shadows on a thread of the rank's own, while the
engine generates: the call returns at once, the answer, `RankStats`, comes
when the round ends), `commit` (double buffering), `close`; and for ranks that share their GPU with
a trainer (colocated rounds through CUDA IPC, `IpcRequest`): `ipc_export`
(answer: an `IpcExport`), `ipc_begin` (answer: a new export when the memory
moved, else empty) and `ipc_end` (answer: empty).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Literal, cast, get_args

from ..config.sync import check_port, check_seconds
from ..rendezvous import MemberStore
from ..rendezvous.auth import check_secret

Op = Literal["describe", "connect", "run", "stage", "commit", "close", "ipc_export", "ipc_begin", "ipc_end"]
ERROR = b"\x00rl-sync-error\x00"


@dataclass(frozen=True)
class Rendezvous:
    """Where a service rank answers: the group's store and key prefix."""

    host: str
    port: int
    prefix: str
    timeout_s: float
    secret: bytes = field(repr=False)
    """Opens the store (`rl_sync.rendezvous`); never printed."""

    def __post_init__(self) -> None:
        check_port("Rendezvous.port", self.port, 1)
        check_seconds("Rendezvous.timeout_s", self.timeout_s)
        check_secret(self.secret)


@dataclass(frozen=True)
class DescribeRequest:
    """Bind the trainers' checkpoint: worker side ranks start at `first` of `side_size`."""

    first: int
    side_size: int
    checkpoint: dict[str, tuple[str, tuple[int, ...]]]
    sharded: dict[str, tuple[int, ...]]
    double_buffer: bool
    reply: Rendezvous
    node: str
    """The identity of the node the engine runs on, as its trainers know theirs (Ray's node id,
    filled in by the host actor): a rank on a GPU a trainer shares is colocated with it."""


@dataclass(frozen=True)
class ConnectRequest:
    """Join the group: per service rank its `InitInfo` bytes, the plan, the bind address."""

    inits: tuple[bytes, ...]
    plan: bytes
    bind_host: str | None
    reply: Rendezvous


@dataclass(frozen=True)
class RoundRequest:
    """Run or stage a round (`RoundInfo` bytes), or collect or commit a staged or double-buffered
    one (`round` empty)."""

    round: bytes
    version: int
    reply: Rendezvous


@dataclass(frozen=True)
class IpcRequest:
    """A step of a colocated round (`rl_sync.transport.cuda_ipc`): export the memory behind the
    rank's destinations (its descriptors wait `timeout_s` seconds to be taken), open round
    `version` (its `ticket`, `RoundInfo.ticket`; `writes_all`), or end it (`names`: the tensors it wrote, None
    for all); `version` keys the answer (0 for an export)."""

    version: int
    names: tuple[str, ...] | None
    timeout_s: float
    reply: Rendezvous
    ticket: int = 0
    writes_all: bool = False
    """The round writes every element of every tensor (a dense round of all): a shadow holding the
    round before need not catch up (`rl_sync.rank.shadow`)."""


@dataclass(frozen=True)
class CloseRequest:
    """Leave the group (`abort`: wake peers stuck in a failed round); `tag` keys the answer."""

    abort: bool
    tag: int
    reply: Rendezvous


def pack(op: Op, message: bytes) -> dict[str, str]:
    """The JSON-able dict one vLLM call carries."""
    return {"op": op, "payload": base64.b64encode(message).decode("ascii")}


def unpack(info: dict) -> tuple[Op, bytes]:
    op, payload = info.get("op"), info.get("payload")
    if op not in get_args(Op) or not isinstance(payload, str):
        raise ValueError(
            f"rl_sync weight transfer: expected {{'op': {'|'.join(get_args(Op))}, 'payload': "
            f"base64 str}}, got keys {sorted(info)}"
        )
    return cast(Op, op), base64.b64decode(payload, validate=True)


def reply_key(prefix: str, op: str, tag: int, rank: int) -> str:
    return f"{prefix}/service/{op}/{tag}/{rank}"


def store_client(reply: Rendezvous) -> MemberStore:
    """A member's connection to the group's rendezvous store."""
    return MemberStore(reply.host, reply.port, reply.secret, timeout_s=reply.timeout_s)
