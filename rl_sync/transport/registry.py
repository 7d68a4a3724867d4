"""Transports by name, each joined from its own rendezvous message.

A registered class implements `Transport`, names in `rendezvous_type` the frozen
wire dataclass that holds what a rank needs to join it (the Gloo store's address,
the NCCL unique ids, a colocated worker's CUDA IPC export), and joins with
`join(info, rendezvous, bind_host=..., device=..., broadcast_ranks=...)`. `InitInfo`
carries the name and that message encoded (`rl_sync.wire.codec`); `join` below
decodes the message strictly as the type the name selects (another transport's
message, or a missing, extra or ill-typed field, is a `ValueError` naming it) and
imports the transport's module only then. Adding a transport means a module here
(its class and its message), an entry in `TRANSPORTS`, and the coordinator's choice
of it.

Ordering contract: joining is collective: every rank of a group joins at init,
before any rank posts, and each blocks until all have joined.

Typical use::

    info = InitInfo(..., transport="gloo", rendezvous=encode(GlooRendezvous(host, port)), ...)  # coordinator
    transport = join(info.transport, info.rendezvous, info, bind_host=host, device=device,
                     broadcast_ranks=ranks)                                                    # every rank
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..wire.codec import decode
from ..wire.messages import InitInfo, check_transport
from .base import Transport


class Joinable(Protocol):
    """What a registered transport class provides beside `Transport`'s methods."""

    rendezvous_type: type
    """Its rendezvous message: a frozen wire dataclass."""

    @classmethod
    def join(
        cls, info: InitInfo, rendezvous: Any, *, bind_host: str, device: torch.device, broadcast_ranks: Sequence[int]
    ) -> Transport:
        """Join the group `info` describes as its rank, from a decoded `rendezvous_type` message
        (`broadcast_ranks`: the ranks of the broadcast baseline's group)."""
        ...


TRANSPORTS = {
    "gloo": ("rl_sync.transport.gloo", "GlooTransport"),
    "nccl": ("rl_sync.transport.nccl", "NcclTransport"),
    "local": ("rl_sync.transport.local", "LocalTransport"),
    "cuda_ipc": ("rl_sync.transport.cuda_ipc", "IpcTransport"),
}
"""Name -> (module, class), one entry for each of `rl_sync.wire.messages.TRANSPORT_NAMES`."""


def transport_class(name: str) -> Joinable:
    """The class of transport `name`; a `ValueError` listing the known names otherwise."""
    check_transport(name)
    module, cls = TRANSPORTS[name]
    return getattr(importlib.import_module(module), cls)


def join(
    name: str,
    rendezvous: bytes,
    info: InitInfo,
    *,
    bind_host: str,
    device: torch.device,
    broadcast_ranks: Sequence[int],
) -> Transport:
    """Join the group `info` describes with transport `name`, from its encoded rendezvous message."""
    cls = transport_class(name)
    return cls.join(
        info,
        decode(cls.rendezvous_type, rendezvous),
        bind_host=bind_host,
        device=device,
        broadcast_ranks=broadcast_ranks,
    )
