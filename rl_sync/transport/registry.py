"""Transports by name: each is imported only when a group uses it.

A transport class joins a group from the `InitInfo` every rank receives with
`join(info, bind_host=..., device=..., broadcast_ranks=...)`. Adding one means
a module here, an entry in `TRANSPORTS`, and the coordinator's choice of it.

    transport = transport_class(info.transport).join(info, bind_host=host, device=device, broadcast_ranks=ranks)
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Protocol

import torch

from .base import Transport


class Joinable(Protocol):
    """What a registered transport class provides beside `Transport`'s methods."""

    @classmethod
    def join(cls, info, *, bind_host: str, device: torch.device, broadcast_ranks: Sequence[int]) -> Transport:
        """Join the group an `InitInfo` describes as its rank (`broadcast_ranks`: the ranks of
        the broadcast baseline's group)."""
        ...

TRANSPORTS = {
    "gloo": ("rl_sync.transport.gloo", "GlooTransport"),
    "nccl": ("rl_sync.transport.nccl", "NcclTransport"),
    "local": ("rl_sync.transport.local", "LocalTransport"),
}
"""Name -> (module, class)."""


def transport_class(name: str) -> Joinable:
    """The class of transport `name`; a `ValueError` listing the known names otherwise."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; known transports: {', '.join(sorted(TRANSPORTS))}")
    module, cls = TRANSPORTS[name]
    return getattr(importlib.import_module(module), cls)
