"""CUDA IPC for colocated sync: map a worker's live parameters into its trainer.

Registered as transport `cuda_ipc`: a colocated trainer joins it from an
`IpcRendezvous` (its worker's export, and the transport and rendezvous message
of the group the trainers form among themselves). The resulting `IpcTransport`
is that group, with the worker's live weights as the rank's destinations
(`Transport.destinations`): the engine writes them as local copies, and what
other trainers send for them arrives over the group.

The worker exports, once, the memory behind its destinations as *regions*: one
per `cudaMalloc` allocation (PyTorch's classic caching allocator; a
`cudaIpcMemHandle` each), and one per run of back-to-back VMM mappings
(expandable segments, VMM allocators; one POSIX file descriptor per mapping,
handed over a Unix socket, `rl_sync.transport.fd_passing`). Both kinds may sit
in one worker. Each destination is (region, byte offset, shape, stride,
dtype). The trainer on the same GPU opens or maps each region once and
rebuilds every destination as a strided view, so the engine writes straight
into the worker's live parameters, fused slots included. Memory no other
process can map raises `IpcUnavailable` with the reason at export.

Two interprocess CUDA events order the handover on the device: the worker
records `ready` after its last read of the old weights; the trainer's stream
waits on it before writing and records `done` after; the worker's stream waits
on `done` before it reads again. A shared page orders the host steps
(`rl_sync.transport.doorbell`): the worker rings it once it checked its
bindings and recorded `ready` (or found its memory moved, or failed), the
trainer waits for that before writing and rings it once it recorded `done` (or
skipped the round), so both sides of a round may start at once. The page's
descriptor is the first the worker's offer hands over
(`rl_sync.transport.fd_passing`), before those of its VMM mappings.

A double-buffered worker whose commits swap its shadows with its live weights
(`rl_sync.rank.shadow`) exports two *faces*: the views a round writes now (its
shadows) and the views it writes after an odd number of such commits (the
live weights of the swapped storages, the same shadows elsewhere). The
trainer maps both once; the worker's word on the page says which face a round
writes (`READY` or `READY_ALTERNATE`), so a commit swaps in O(1) per storage
while another process maps the memory, with no new export.

Memory released and re-allocated between rounds (an engine's sleep and wake)
keeps its addresses but not its identity: `WorkerExport.moved()` compares
the driver's buffer id of every exported allocation with the one exported, and
the worker then exports again and its trainer maps the new export
(`IpcTransport.remap`), closing the old mapping.

Ordering contract: the group's (all ranks, same order); per colocated pair, a
round is the worker's `begin` (ringing the page), then the trainer's
`begin_round`, writes and `end_round` (ringing it), then the worker's `end`.
The worker is no rank of the group: the coordinator calls its side at the same
time as the trainers' round, or between the trainers' steps.

Typical use::

    exported = WorkerExport(views, device, timeout_s=60)                      # worker, at init
    rendezvous = IpcRendezvous(exported.export, "local", encode(LocalRendezvous()))  # coordinator
    t = join("cuda_ipc", encode(rendezvous), info, bind_host=host, device=device,
             broadcast_ranks=ranks)                                            # trainer, at init
    t.destinations()["model.layers.0.mlp.down_proj.weight"]
    exported.begin(ticket)                             # worker: ring READY
    t.await_worker(ticket, deadline); t.begin_round(); ...; t.end_round()
    t.written(ticket)                                  # trainer: ring WRITTEN
    exported.await_trainer(ticket, deadline); exported.end()     # worker
    t.close(); exported.close()
"""

from __future__ import annotations

import bisect
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..wire.dtypes import dtype_name
from ..wire.messages import check_transport
from .base import Ops, Pending, Transport, event_reached
from .cuda_memory import Backing, IpcUnavailable, MappedRange, backings, buffer_id, export_fd, extent_bytes, map_fds
from .doorbell import READIES, READY, READY_ALTERNATE, TRAINER, WORKER, Doorbell
from .fd_passing import FdOffer, receive_fds
from .registry import join


@dataclass(frozen=True)
class IpcRegion:
    """Worker memory the trainer maps as one range: a cudaMalloc allocation (`handle`) or back-to-back
    VMM mappings (`chunks`: the bytes of each, whose descriptors come over the offer in order)."""

    kind: Literal["legacy", "vmm"]
    nbytes: int
    handle: bytes = b""
    chunks: tuple[int, ...] = ()


@dataclass(frozen=True)
class IpcTensor:
    """Where one destination lives inside the exported regions (`region` -1: no bytes)."""

    name: str
    region: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IpcExport:
    """Everything a colocated trainer needs to write into a worker's memory."""

    device_uuid: str
    regions: tuple[IpcRegion, ...]
    tensors: tuple[IpcTensor, ...]
    ready_event: bytes
    done_event: bytes
    fd_path: str
    """The worker's descriptor offer: its doorbell page, then its VMM mappings' descriptors."""
    fd_token: bytes = field(repr=False)
    alternate: tuple[IpcTensor, ...] = ()
    """The same destinations in the worker's alternate face (see the module docstring); empty when
    its commits never swap."""


@dataclass(frozen=True)
class IpcRendezvous:
    """How a colocated trainer joins: its worker's export, and the group the trainers form among
    themselves, which carries what one trainer sends for another's worker."""

    export: IpcExport
    group: str
    """The trainers' own transport: a registered name other than `cuda_ipc`."""
    group_rendezvous: bytes
    """That transport's rendezvous message, encoded (`rl_sync.wire.codec`)."""

    def __post_init__(self) -> None:
        check_transport(self.group)
        if self.group == "cuda_ipc":
            raise ValueError("IpcRendezvous.group must name the trainers' own transport, not 'cuda_ipc'")


def _runtime():
    try:
        from cupy.cuda import runtime
    except ImportError as exc:
        raise IpcUnavailable(
            f"colocated CUDA IPC needs CuPy: pip install 'rl-sync[cuda12]' or '[cuda13]' ({exc})"
        ) from None
    return runtime


def device_uuid(device: torch.device) -> str:
    """A stable identity of a physical GPU (the same in every process that sees it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _regions(
    faces: Sequence[Mapping[str, torch.Tensor]],
) -> tuple[list[list[Backing]], list[dict[str, tuple[int, int]]]]:
    """The backings of every face's views grouped into regions, and each face's (region, offset)
    of each view."""
    chunks: dict[int, Backing] = {}
    for views in faces:
        for name, view in views.items():
            if view.numel():
                found = backings(view.data_ptr(), extent_bytes(view), f"destination {name!r}")
                chunks.update((b.base, b) for b in found)
    regions: list[list[Backing]] = []
    for b in sorted(chunks.values(), key=lambda b: b.base):
        last = regions[-1][-1] if regions else None
        if last is not None and b.kind == last.kind == "vmm" and last.base + last.size == b.base:
            regions[-1].append(b)
        else:
            regions.append([b])
    starts = [r[0].base for r in regions]
    return regions, [_where(views, starts) for views in faces]


def _where(views: Mapping[str, torch.Tensor], starts: list[int]) -> dict[str, tuple[int, int]]:
    """Each view's (region, byte offset), given the regions' first addresses (-1: no bytes)."""
    where = {}
    for name, view in views.items():
        i = bisect.bisect_right(starts, view.data_ptr()) - 1
        where[name] = (i, view.data_ptr() - starts[i]) if view.numel() else (-1, 0)
    return where


def _tensors(views: Mapping[str, torch.Tensor], where: dict[str, tuple[int, int]]) -> tuple[IpcTensor, ...]:
    return tuple(
        IpcTensor(name, *where[name], tuple(v.shape), tuple(v.stride()), dtype_name(v.dtype))
        for name, v in views.items()
    )


def _swappable(exported: list[Backing], device: torch.device) -> list[Backing]:
    """The backings whose memory may change under a live tensor: VMM mappings outside PyTorch's
    own expandable segments (a VMM allocator's, which may release and re-map at the same
    addresses, as sleep modes do). A cudaMalloc allocation, or PyTorch's expandable memory under
    a live tensor, is never released while the group holds the tensor."""
    torch_owned = [
        (s["address"], s["address"] + s["total_size"])
        for s in torch.cuda.memory_snapshot()
        if s.get("is_expandable") and s["device"] == device.index
    ]
    return [b for b in exported if b.kind == "vmm" and not any(lo <= b.base < hi for lo, hi in torch_owned)]


class WorkerExport:
    """The worker side: the export message, the two events and the doorbell it shares, and the
    descriptor offer. `alternate`: the views rounds write after an odd number of commits that
    swapped (the same names as `views`), when commits swap."""

    def __init__(
        self,
        views: Mapping[str, torch.Tensor],
        device: torch.device,
        timeout_s: float,
        alternate: Mapping[str, torch.Tensor] | None = None,
    ):
        device = torch.device(device)
        torch.cuda.synchronize(device)
        if alternate is not None and list(alternate) != list(views):
            raise ValueError("an export's alternate face must hold the same destinations, in the same order")
        regions, where = _regions([views] if alternate is None else [views, alternate])
        self.watched = _swappable([b for region in regions for b in region], device)
        self.bell = Doorbell.create()
        fds: list[int] = [os.dup(self.bell.fd)]
        try:
            exported = tuple(self._region(region, fds) for region in regions)
        except BaseException:
            for fd in fds:
                os.close(fd)
            self.bell.close()
            raise
        self.offer = FdOffer(fds, timeout_s)
        self.ready = torch.cuda.Event(interprocess=True)
        self.done = torch.cuda.Event(interprocess=True)
        self.ready.record(torch.cuda.current_stream(device))
        self.done.record(torch.cuda.current_stream(device))
        self.device = device
        self.export = IpcExport(
            device_uuid(device),
            exported,
            _tensors(views, where[0]),
            bytes(self.ready.ipc_handle()),
            bytes(self.done.ipc_handle()),
            self.offer.path,
            self.offer.token,
            () if alternate is None else _tensors(alternate, where[1]),
        )

    @staticmethod
    def _region(region: list[Backing], fds: list[int]) -> IpcRegion:
        size = sum(b.size for b in region)
        if region[0].kind == "legacy":
            return IpcRegion("legacy", size, handle=bytes(_runtime().ipcGetMemHandle(region[0].base)))
        for b in region:
            fds.append(export_fd(b.base))
        return IpcRegion("vmm", size, chunks=tuple(b.size for b in region))

    def moved(self) -> bool:
        """Whether memory that can change under a live tensor was released (and perhaps
        re-allocated) since the export."""
        return any(buffer_id(b.base) != b.buffer_id for b in self.watched)

    @property
    def alternates(self) -> bool:
        """Whether this export has an alternate face (its worker's commits may swap)."""
        return bool(self.export.alternate)

    def begin(self, ticket: int, face: int = 0) -> None:
        """Mark that every read of the old weights issued so far precedes the writes, and tell the
        trainer it may write round `ticket`, into `face` (1: the alternate one)."""
        if face and not self.alternates:
            raise RuntimeError("a colocated round names the alternate face of an export that has none")
        self.ready.record(torch.cuda.current_stream(self.device))
        self.bell.ring(WORKER, ticket, READY_ALTERNATE if face else READY)

    def refuse(self, ticket: int, state: int) -> None:
        """Tell the trainer to write nothing in round `ticket`: `MOVED` or `FAILED`."""
        self.bell.ring(WORKER, ticket, state)

    def await_trainer(self, ticket: int, deadline: float) -> int:
        """The trainer's state once it is done with round `ticket` (`rl_sync.transport.doorbell`)."""
        return self.bell.wait(TRAINER, ticket, deadline)

    def end(self, on_host_within: float | None = None) -> None:
        """Make this worker's later work wait for the trainer's writes: the work this thread
        queues on the device, or, given `on_host_within` seconds, all of it (returns once the
        writes ended, `TimeoutError` past that: a staged round, which another thread may commit,
        `rl_sync.rank.steps`)."""
        if on_host_within is None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
            return
        what = f"the trainer's writes into GPU {self.device}, waited for {on_host_within:.0f} s"
        event_reached(self.done, time.monotonic() + on_host_within, what)

    def close(self) -> None:
        """Withdraw descriptors the trainer has not taken, and unmap the doorbell."""
        self.offer.close()
        self.bell.close()


class MappedDestinations:
    """The trainer side: each exported region opened or mapped once, each tensor a view of it, in
    each face (`views`: the face the worker's last word named)."""

    def __init__(self, export: IpcExport, device: torch.device, timeout_s: float):
        device = torch.device(device)
        if device_uuid(device) != export.device_uuid:
            raise ValueError(
                f"colocated worker memory is on GPU {export.device_uuid}, this trainer is on {device_uuid(device)}"
            )
        self.device = device
        self.opened: list[int] = []
        """Pointers of the legacy allocations opened from their `cudaIpcMemHandle`."""
        self.ranges: list[MappedRange] = []
        """VMM allocations imported and mapped."""
        self.bell: Doorbell | None = None
        try:
            bases = self._map(export, timeout_s)
        except BaseException:
            self.close()
            raise
        first = _views(bases, export.tensors, device)
        self.faces = (first, _views(bases, export.alternate, device) if export.alternate else first)
        self.views = first
        self.ready = torch.cuda.Event.from_ipc_handle(device, export.ready_event)
        self.done = torch.cuda.Event.from_ipc_handle(device, export.done_event)

    def _map(self, export: IpcExport, timeout_s: float) -> list[torch.Tensor]:
        fds = receive_fds(export.fd_path, export.fd_token, 1 + sum(len(r.chunks) for r in export.regions), timeout_s)
        try:
            self.bell = Doorbell.attach(fds.pop(0), TRAINER)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        bases = []
        for region in export.regions:
            if region.kind == "legacy":
                self.opened.append(_runtime().ipcOpenMemHandle(region.handle))
                ptr = self.opened[-1]
            else:
                mine, fds = fds[: len(region.chunks)], fds[len(region.chunks) :]
                try:
                    self.ranges.append(map_fds(mine, region.chunks, self.device.index))
                except BaseException:
                    for fd in fds:
                        os.close(fd)
                    raise
                ptr = self.ranges[-1].base
            bases.append(_wrap(ptr, region.nbytes, self.device))
        return bases

    def use(self, state: int) -> None:
        """The worker is ready (`state`, its word): later rounds write the face it names."""
        if state == READY_ALTERNATE and self.faces[1] is self.faces[0]:
            raise RuntimeError("the colocated worker names its alternate face, which its export did not map")
        self.views = self.faces[state == READY_ALTERNATE]

    def before_writes(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready)

    def after_writes(self) -> None:
        self.done.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        """Close every opened handle and unmap every mapped range and the doorbell (idempotent)."""
        torch.cuda.synchronize(self.device)
        self.views = {}
        self.faces = ({}, {})
        if self.bell is not None:
            self.bell.close()
        while self.opened:
            _runtime().ipcCloseMemHandle(self.opened.pop())
        while self.ranges:
            self.ranges.pop().close()


class IpcTransport(Transport):
    """The trainers' group, with this rank's colocated worker's live weights mapped in as its
    destinations; transfers between ranks go over the group."""

    rendezvous_type = IpcRendezvous

    def __init__(self, group: Transport, export: IpcExport, device: torch.device, timeout_s: float):
        self.group, self.mapped_device, self.timeout_s = group, torch.device(device), timeout_s
        self.rank, self.world_size, self.device = group.rank, group.world_size, group.device
        self.mapped: MappedDestinations | None = None
        self.remap(export)

    @classmethod
    def join(
        cls, info, rendezvous: IpcRendezvous, *, bind_host: str, device: torch.device, broadcast_ranks: Sequence[int]
    ) -> IpcTransport:
        """Join the trainers' group, then map the worker's export (aborting the group if that fails)."""
        group = join(
            rendezvous.group,
            rendezvous.group_rendezvous,
            info,
            bind_host=bind_host,
            device=device,
            broadcast_ranks=broadcast_ranks,
        )
        try:
            return cls(group, rendezvous.export, device, info.timeout_s)
        except BaseException:
            group.abort()
            raise

    def remap(self, export: IpcExport) -> None:
        """Map the worker's export (at join, and again after its memory moved), closing the mapping
        of the one before."""
        self._unmap()
        self.mapped = MappedDestinations(export, self.mapped_device, self.timeout_s)

    def _unmap(self) -> None:
        if self.mapped is not None:
            self.mapped.close()
            self.mapped = None

    def _mapping(self) -> MappedDestinations:
        if self.mapped is None:
            raise RuntimeError(
                f"rank {self.rank}: the colocated worker's memory is not mapped (closed, or its last "
                "export failed to map)"
            )
        return self.mapped

    def destinations(self) -> Mapping[str, torch.Tensor]:
        return {} if self.mapped is None else self.mapped.views

    def await_worker(self, ticket: int, deadline: float) -> int:
        """The worker's state once it opened round `ticket`: `READY` or `READY_ALTERNATE` to write
        (`destinations` is then that face), or `MOVED` / `FAILED` (`rl_sync.transport.doorbell`)."""
        mapped = self._mapping()
        assert mapped.bell is not None  # mapped with its export
        state = mapped.bell.wait(WORKER, ticket, deadline)
        if state in READIES:
            mapped.use(state)
        return state

    def ring(self, ticket: int, state: int) -> None:
        """Tell the worker this rank is done with round `ticket`: `WRITTEN`, `SKIPPED` or `FAILED`."""
        bell = self._mapping().bell
        assert bell is not None  # mapped with its export
        bell.ring(TRAINER, ticket, state)

    def begin_round(self) -> None:
        self._mapping().before_writes()

    def end_round(self) -> None:
        self._mapping().after_writes()

    def post(self, sends: Ops, recvs: Ops, label: str = "") -> Pending:
        return self.group.post(sends, recvs, label=label)

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        self.group.broadcast(buf, root, deadline)

    def barrier(self, deadline: float) -> None:
        self.group.barrier(deadline)

    def finish(self, deadline: float) -> None:
        self.group.finish(deadline)

    def complete(self, deadline: float) -> None:
        self.group.complete(deadline)

    def close(self) -> None:
        """Unmap the worker's memory, then release the group."""
        self._unmap()
        self.group.close()

    def abort(self) -> None:
        """Abort the group; the mapping stays until `close` (no host wait for the device here)."""
        self.group.abort()


def _wrap(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device.index)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=device)


def _views(bases: list[torch.Tensor], tensors: Sequence[IpcTensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {t.name: _view(bases[t.region] if t.region >= 0 else None, t, device) for t in tensors}


def _view(base: torch.Tensor | None, t: IpcTensor, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, t.dtype)
    if base is None:  # a destination with no elements
        return torch.empty(0, dtype=dtype, device=device).as_strided(t.shape, t.stride)
    if t.offset % dtype.itemsize:
        raise ValueError(f"destination {t.name!r} starts at byte {t.offset}, not aligned to {t.dtype}")
    span = base.numel() - t.offset
    typed = base[t.offset : t.offset + span - span % dtype.itemsize].view(dtype)
    return typed.as_strided(t.shape, t.stride)
