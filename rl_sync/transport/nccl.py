"""NCCL transport through CuPy's bindings, on torch CUDA tensors.

Buffers are passed as raw pointers and byte counts (`ncclUint8`), so bf16 and
fp8 travel unchanged. A bucket is one `ncclGroupStart` / `ncclGroupEnd` on a
dedicated transfer stream that first waits for the caller's current stream
(where the engine packed); `Pending.wait` makes the current stream wait for
the transfer (no host block), so packing bucket k+1 overlaps bucket k's
transfer. `finish` is the watchdog: it polls the last event until the
deadline, then aborts the communicator (waking every peer with an error
instead of a hang) and raises `TimeoutError`.

The unique ids are created by `new_unique_id()` on one rank and handed to the
others by the coordinator in an `NcclRendezvous`, from which every rank joins
through the registry. NCCL refuses two ranks of one communicator on the same
GPU. Joining is bounded (`join_timeout_s`): a rank whose peers do not all join
raises `TimeoutError` rather than wait inside NCCL for ever. Typical use::

    rendezvous = NcclRendezvous(tuple(new_unique_id()), tuple(new_unique_id()))  # one rank, relayed
    t = NcclTransport(rank, world, rendezvous.unique_id, device, broadcast_ranks=[0, 2, 3],
                      broadcast_id=rendezvous.broadcast_id)
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .base import Ops, Pending, Transport, check_ops, event_reached, made_within

UNIQUE_ID_BYTES = 128
"""`NCCL_UNIQUE_ID_BYTES`: the length of an NCCL unique id."""
JOIN_S = 300.0
"""How long a rank waits, by default, for every rank to join its communicators."""


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        raise ValueError(
            f"the NCCL transport needs CuPy with NCCL: pip install 'rl-sync[cuda12]' or 'rl-sync[cuda13]' ({exc})"
        ) from None
    return nccl


def nccl_available() -> bool:
    """True when CuPy's NCCL bindings import and CUDA is usable."""
    try:
        _nccl()
    except (ValueError, RuntimeError, OSError):
        return False
    return torch.cuda.is_available()


def new_unique_id() -> list[int]:
    """A fresh NCCL unique id as ints in [0, 256) (travels through the coordinator)."""
    return [x & 0xFF for x in _nccl().get_unique_id()]


def _comm_id(nccl, unique_id: Sequence[int]):
    """The id in the form this CuPy takes: bytes (CuPy 14) or a tuple of signed chars."""
    if isinstance(nccl.get_unique_id(), bytes):
        return bytes(x & 0xFF for x in unique_id)
    return tuple(x - 256 if x > 127 else x for x in unique_id)


def _formed(size: int, unique_id: Sequence[int], rank: int, device: torch.device, deadline: float):
    """Rank `rank` of the `size`-rank communicator `unique_id`, formed by `deadline`.
    `ncclCommInitRank` blocks until every rank joined and takes no bound, and CuPy offers no
    non-blocking creation: it runs on a thread of its own (its device made current there), which
    a rank that never joins leaves waiting inside NCCL; a communicator formed after the deadline
    is aborted at once."""
    nccl = _nccl()

    def make():
        torch.cuda.set_device(device)
        return nccl.NcclCommunicator(size, _comm_id(nccl, unique_id), rank)

    what = f"rank {rank}: forming the NCCL communicator of {size} ranks (every rank must join)"
    return made_within(make, deadline, what, discard=lambda late: late.abort())


@dataclass(frozen=True)
class NcclRendezvous:
    """How a rank joins the NCCL communicators: the unique ids one rank created."""

    unique_id: tuple[int, ...]
    """The whole group's point-to-point communicator."""
    broadcast_id: tuple[int, ...]
    """The broadcast baseline's communicator (root and workers)."""

    def __post_init__(self) -> None:
        for name in ("unique_id", "broadcast_id"):
            value = getattr(self, name)
            if len(value) != UNIQUE_ID_BYTES or not all(0 <= x < 256 for x in value):
                raise ValueError(
                    f"NcclRendezvous.{name} must be {UNIQUE_ID_BYTES} ints in [0, 256) (new_unique_id), "
                    f"got {len(value)} ints"
                )


class _NcclPending(Pending):
    def __init__(self, done: torch.cuda.Event):
        self.done = done

    def wait(self, deadline: float) -> None:
        torch.cuda.current_stream().wait_event(self.done)


class NcclTransport(Transport):
    """Grouped send/recv of CUDA byte tensors through one NCCL communicator."""

    rendezvous_type = NcclRendezvous

    def __init__(
        self,
        rank: int,
        world_size: int,
        unique_id: Sequence[int],
        device: torch.device,
        *,
        broadcast_ranks: Sequence[int] = (),
        broadcast_id: Sequence[int] | None = None,
        join_timeout_s: float = JOIN_S,
    ):
        """`join_timeout_s` bounds joining: both communicators formed (every rank joined), or
        `TimeoutError` here (`_formed`)."""
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        torch.cuda.set_device(self.device)
        self.stream = torch.cuda.Stream(self.device, priority=-1)  # ahead of digest kernels for SMs
        deadline = time.monotonic() + join_timeout_s
        self.comm = _formed(world_size, unique_id, rank, self.device, deadline)
        self.bcast_ranks = list(broadcast_ranks)
        self.bcast = None
        if rank in self.bcast_ranks and broadcast_id is not None:
            try:
                self.bcast = _formed(
                    len(self.bcast_ranks), broadcast_id, self.bcast_ranks.index(rank), self.device, deadline
                )
            except BaseException:
                self.comm.abort()
                raise
        self._last: torch.cuda.Event | None = None
        self._closed = False

    @classmethod
    def join(
        cls, info, rendezvous: NcclRendezvous, *, bind_host: str, device: torch.device, broadcast_ranks: Sequence[int]
    ) -> NcclTransport:
        """NCCL takes its network interface from `NCCL_SOCKET_IFNAME` alone: `info.interface` sets
        it, unless the process already did."""
        if info.interface:
            os.environ.setdefault("NCCL_SOCKET_IFNAME", info.interface)
        return cls(
            info.rank,
            info.world_size,
            rendezvous.unique_id,
            device,
            broadcast_ranks=broadcast_ranks,
            broadcast_id=rendezvous.broadcast_id,
            join_timeout_s=info.join_timeout_s,
        )

    def post(self, sends: Ops, recvs: Ops, label: str = "") -> Pending:
        nccl = _nccl()
        check_ops(sends, self.world_size, self.rank, "send")
        check_ops(recvs, self.world_size, self.rank, "receive")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        handle = self.stream.cuda_stream
        nccl.groupStart()
        try:
            for peer, buf in sends:
                self.comm.send(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, peer, handle)
            for peer, buf in recvs:
                self.comm.recv(buf.data_ptr(), buf.numel(), nccl.NCCL_UINT8, peer, handle)
        finally:
            nccl.groupEnd()
        for _, buf in list(sends) + list(recvs):
            buf.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        self._last = done
        return _NcclPending(done)

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        nccl = _nccl()
        if self.bcast is None:
            raise ValueError(f"rank {self.rank} is not in the broadcast group {self.bcast_ranks}")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.bcast.broadcast(
            buf.data_ptr(),
            buf.data_ptr(),
            buf.numel(),
            nccl.NCCL_UINT8,
            self.bcast_ranks.index(root),
            self.stream.cuda_stream,
        )
        done = torch.cuda.Event()
        done.record(self.stream)
        self._last = done
        torch.cuda.current_stream(self.device).wait_event(done)
        self.finish(deadline)

    def barrier(self, deadline: float) -> None:
        token = torch.zeros(1, dtype=torch.uint8, device=self.device)
        nccl = _nccl()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.comm.allReduce(
            token.data_ptr(), token.data_ptr(), 1, nccl.NCCL_UINT8, nccl.NCCL_SUM, self.stream.cuda_stream
        )
        done = torch.cuda.Event()
        done.record(self.stream)
        self._last = done
        self.finish(deadline)

    def finish(self, deadline: float) -> None:
        """Watchdog: poll the last transfer until `deadline` (abort and raise past it), then let
        the caller's stream (unpacking after that transfer) drain."""
        if self._last is not None:
            try:
                event_reached(self._last, deadline, f"rank {self.rank}: NCCL transfers")
            except TimeoutError:
                self.abort()
                raise TimeoutError(
                    f"rank {self.rank}: NCCL transfers did not complete in time; communicator aborted"
                ) from None
            self._last = None
        torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            torch.cuda.synchronize(self.device)
            for comm in (self.comm, self.bcast):
                if comm is not None:
                    comm.destroy()

    def abort(self) -> None:
        if not self._closed:
            self._closed = True
            for comm in (self.comm, self.bcast):
                if comm is not None:
                    comm.abort()
