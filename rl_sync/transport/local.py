"""The transport of a one-rank group: nothing to send, so nothing to open.

A colocated group with one trainer (`cuda_ipc` over `local`: its worker's
memory mapped in through CUDA IPC) or any single-rank group runs every
transfer as a local copy; this keeps one code path for one rank and for many.
Joining takes an empty `LocalRendezvous`. Typical use::

    t = LocalTransport(torch.device("cpu"))
    t.barrier(deadline); t.finish(deadline)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Ops, Pending, Transport


@dataclass(frozen=True)
class LocalRendezvous:
    """A one-rank group needs nothing to join."""


class LocalTransport(Transport):
    """World size 1: posting any operation is a planning bug and raises."""

    rendezvous_type = LocalRendezvous

    def __init__(self, device: torch.device):
        self.rank, self.world_size, self.device = 0, 1, torch.device(device)

    @classmethod
    def join(
        cls, info, rendezvous: LocalRendezvous, *, bind_host: str, device: torch.device, broadcast_ranks: Sequence[int]
    ) -> LocalTransport:
        if info.world_size != 1:
            raise ValueError(f"transport 'local' joins one-rank groups only; this group has {info.world_size} ranks")
        return cls(device)

    def post(self, sends: Ops, recvs: Ops, label: str = "") -> Pending:
        raise ValueError("a one-rank group has no peers to send to or receive from")

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        if root != 0:
            raise ValueError(f"broadcast root {root} is not the only rank 0")

    def barrier(self, deadline: float) -> None:
        return None

    def finish(self, deadline: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        return None

    def abort(self) -> None:
        return None
