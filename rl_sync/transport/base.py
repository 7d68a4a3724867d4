"""The transport interface: grouped point-to-point byte transfers between ranks.

A transport connects the ranks `[0, world_size)` of one sync group (trainers
first, then workers). The engine hands it contiguous `uint8` tensors only, so
every dtype (bf16, fp8, ints) travels as bytes.

Ordering contract: all ranks post their buckets in the same order; within one
`post` call a rank's sends to a peer and that peer's receives from it are
listed in the same order. `post` returns without waiting; `Pending.wait` makes
later work (host code for Gloo, the current CUDA stream for NCCL) wait for the
bucket; `finish` blocks the host until everything posted has completed or the
deadline passes, and then raises `TimeoutError` after aborting the group, so
no rank hangs. The engine opens each round with `begin_round` and, once the
round succeeded, closes it with `end_round` (both nothing to transports that
only move bytes between ranks).

A rank joins by the transport's registered name and its own rendezvous
message (`rl_sync.transport.registry`). Typical use::

    transport.begin_round()
    pending = transport.post(sends=[(peer, buf)], recvs=[(peer, out)])
    pending.wait(deadline)
    transport.finish(deadline)
    transport.end_round()
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, wait
from typing import TypeVar

import torch

Ops = Sequence[tuple[int, torch.Tensor]]
Made = TypeVar("Made")


def check_ops(ops: Ops, world_size: int, rank: int, what: str) -> None:
    """Refuse a peer outside the group, or a buffer that is not contiguous bytes."""
    for peer, buf in ops:
        if not 0 <= peer < world_size or (peer == rank and world_size > 1):
            raise ValueError(f"rank {rank}: {what} peer {peer} is not another rank of a group of {world_size}")
        if buf.dtype != torch.uint8 or not buf.is_contiguous():
            raise ValueError(f"rank {rank}: {what} buffers must be contiguous uint8, got {buf.dtype}")


def remaining(deadline: float, what: str) -> float:
    """Seconds left before `deadline` (a `time.monotonic()` value), or `TimeoutError`."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(f"{what}: deadline passed")
    return left


POLL_S = 0.0005
"""How often a host wait polls a CUDA event."""


def event_reached(event, deadline: float, what: str) -> None:
    """Block the host until CUDA `event` completed, or `TimeoutError` (`remaining`'s) at
    `deadline`: it polls, never an unbounded CUDA synchronize."""
    while not event.query():
        remaining(deadline, what)
        time.sleep(POLL_S)


def made_within(make: Callable[[], Made], deadline: float, what: str, discard: Callable[[Made], None]) -> Made:
    """`make()` run on a daemon thread of its own, waited for until `deadline`: for a call that
    blocks without a bound of its own (an NCCL communicator's creation waits for every rank).
    Past the deadline, `TimeoutError` naming `what`; the call is abandoned, and what it makes
    if it ever returns goes to `discard`."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(make())
        except BaseException as exc:  # (raised to the waiting caller)
            future.set_exception(exc)

    threading.Thread(target=run, name=f"rl-sync: {what}", daemon=True).start()
    bound = max(0.0, deadline - time.monotonic())
    if not wait([future], timeout=bound).done:

        def discard_late(late: Future) -> None:
            if late.exception() is None:
                discard(late.result())

        future.add_done_callback(discard_late)
        raise TimeoutError(f"{what}: not done within {bound:.1f} s; abandoned")
    return future.result()


class Pending(ABC):
    """One posted bucket."""

    @abstractmethod
    def wait(self, deadline: float) -> None:
        """Order later work after this bucket (see the module docstring)."""


class Transport(ABC):
    """Grouped point-to-point transfers plus broadcast, barrier and teardown."""

    rank: int
    world_size: int
    device: torch.device

    @abstractmethod
    def post(self, sends: Ops, recvs: Ops, label: str = "") -> Pending:
        """Start every send and receive of one bucket as one grouped launch; `label` names the
        bucket in errors."""

    @abstractmethod
    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        """Broadcast `buf` from `root` over the broadcast group (root + workers)."""

    @abstractmethod
    def barrier(self, deadline: float) -> None:
        """Block until every rank of the group reaches the barrier."""

    def finish(self, deadline: float) -> None:  # noqa: B027 (optional hook: a no-op unless overridden)
        """Block the host until everything posted has completed, and run the checks that close
        a round (digests); call it at the end of every round."""

    def complete(self, deadline: float) -> None:
        """Block the host until everything posted has completed, within a round (before the host
        reads what arrived); the round-closing checks wait for `finish`."""
        self.finish(deadline)

    def destinations(self) -> Mapping[str, torch.Tensor]:
        """Live destination tensors by name that this transport reaches for this rank itself (a
        colocated worker's weights mapped into this process, `cuda_ipc`): the engine writes a
        round's destinations into these instead of the rank's own. The same mapping object until
        they change, or one of two that alternate (a worker whose commits swap its shadows with
        its live weights). Empty for transports that only move bytes between ranks."""
        return {}

    def begin_round(self) -> None:  # noqa: B027 (optional hook: a no-op unless overridden)
        """Order this rank's writes of a round after what must precede them (a colocated worker's
        last reads of its old weights); the engine calls it before a round's first operation."""

    def end_round(self) -> None:  # noqa: B027 (optional hook: a no-op unless overridden)
        """Hand a round's writes to whoever reads them next (a colocated worker); the engine calls
        it once a round has succeeded."""

    @abstractmethod
    def close(self) -> None:
        """Release the group after a clean round, or what `abort` left (a colocated worker's
        mapped memory); idempotent."""

    @abstractmethod
    def abort(self) -> None:
        """Tear the group down now, failing any operation in flight; idempotent."""
