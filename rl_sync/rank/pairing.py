"""A trainer's steps around a colocated round: wait for its worker, agree with the other trainers.

In a colocated group (`rl_sync.transport.cuda_ipc`) the coordinator starts a
round on the trainers and on their workers at once. Before writing, each
trainer waits on its pair's shared page (`rl_sync.transport.doorbell`) until
its worker has checked its bindings and marked its last reads (`READY`, or
`READY_ALTERNATE`: write its export's alternate face), or
found its memory moved (`MOVED`: its trainer must map a new export first), or
failed (`FAILED`). The trainers then agree: every one writes only when every
worker is ready, since a trainer that stayed out would leave the others
waiting on the transfers it takes part in. A trainer with no colocated worker
(more trainers than workers) votes to go. Once done, a trainer rings its
worker: `WRITTEN`, `SKIPPED` (nothing written) or `FAILED`.

Ordering contract: every trainer of the group calls `agreed` for every round
with a ticket (`RoundInfo.ticket`), in round order, before the round's first
transfer: the agreement is one small grouped launch among them (all ranks,
same order).

    pair = Pair.of(session.joined, round_info)         # None: no colocated round
    if pair is not None and not pair.agreed():
        ...                                            # every trainer skips the round
    pair.ring(WRITTEN)                                  # after the writes (or SKIPPED / FAILED)
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from ..transport.base import Transport
from ..transport.cuda_ipc import IpcTransport
from ..transport.doorbell import READIES
from ..wire.messages import RoundInfo


def agree(group: Transport, go: bool, deadline: float) -> bool:
    """Whether every rank of `group` says `go` (each sends its word to every other rank in one
    grouped launch and waits for theirs, by `deadline`, a `time.monotonic()` value)."""
    if group.world_size == 1:
        return go
    mine = torch.tensor([int(go)], dtype=torch.uint8, device=group.device)
    peers = [p for p in range(group.world_size) if p != group.rank]
    theirs = [torch.zeros(1, dtype=torch.uint8, device=group.device) for _ in peers]
    group.post([(p, mine) for p in peers], list(zip(peers, theirs)), label="colocated agreement").wait(deadline)
    group.complete(deadline)
    return go and all(bool(t.item()) for t in theirs)


class Pair(NamedTuple):
    """One trainer's part in a colocated round (see the module docstring)."""

    group: Transport
    """The trainers' own group (the transport `cuda_ipc` wraps, or the one joined)."""
    mapped: IpcTransport | None
    """The colocated worker's mapping and page; None for a trainer with no colocated worker."""
    ticket: int
    deadline: float

    @classmethod
    def of(cls, joined: Transport, round_info: RoundInfo) -> Pair | None:
        """This trainer's part in `round_info`, or None when the round has no colocated pair."""
        if not round_info.ticket:
            return None
        deadline = time.monotonic() + round_info.timeout_s
        if isinstance(joined, IpcTransport):
            return cls(joined.group, joined, round_info.ticket, deadline)
        return cls(joined, None, round_info.ticket, deadline)

    def agreed(self) -> bool:
        """Wait for the worker's word, then agree with every trainer: True when all may write."""
        go = self.mapped is None or self.mapped.await_worker(self.ticket, self.deadline) in READIES
        return agree(self.group, go, self.deadline)

    def ring(self, state: int) -> None:
        """Tell the worker (if any) how this trainer ended the round."""
        if self.mapped is not None:
            self.mapped.ring(self.ticket, state)
