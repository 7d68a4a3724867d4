"""CUDA IPC for colocated sync: map a worker's live parameters into its trainer.

The worker exports, once, one IPC handle per caching-allocator segment that
holds any of its destinations (a handful of segments, however many tensors),
plus each destination's (segment, byte offset, shape, stride, dtype). The
trainer on the same GPU opens each segment once and rebuilds every
destination as a strided view of mapped memory, so the engine writes straight
into the worker's live parameters, fused slots included.

Two interprocess CUDA events order the handover: the worker records `ready`
after its last read of the old weights; the trainer's stream waits on it
before writing and records `done` after; the worker's stream waits on `done`
before it reads again.

Typical use::

    exported = WorkerExport(views, device)              # worker, at init
    mapped = MappedDestinations(exported.export, device)  # trainer, at init
    mapped.views["model.layers.0.mlp.down_proj.weight"]
    exported.begin(); mapped.before_writes(); ...; mapped.after_writes(); exported.end()  # a round
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..dtypes import dtype_name


@dataclass(frozen=True)
class IpcSegment:
    """One allocator segment: its IPC handle and size in bytes."""

    handle: bytes
    nbytes: int


@dataclass(frozen=True)
class IpcTensor:
    """Where one destination lives inside the exported segments."""

    name: str
    segment: int
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class IpcExport:
    """Everything a colocated trainer needs to write into a worker's memory."""

    device_uuid: str
    segments: tuple[IpcSegment, ...]
    tensors: tuple[IpcTensor, ...]
    ready_event: bytes
    done_event: bytes


def _runtime():
    try:
        from cupy.cuda import runtime
    except ImportError as exc:
        raise ValueError(f"colocated CUDA IPC needs CuPy: pip install 'rl-sync[cuda12]' or '[cuda13]' ({exc})") from None
    return runtime


def device_uuid(device: torch.device) -> str:
    """A stable identity of a physical GPU (the same in every process that sees it)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _segments(device: torch.device) -> list[tuple[int, int]]:
    snapshot = torch.cuda.memory_snapshot()
    return sorted((s["address"], s["total_size"]) for s in snapshot if s["device"] == device.index)


class WorkerExport:
    """The worker side: the export message and the two events it shares."""

    def __init__(self, views: Mapping[str, torch.Tensor], device: torch.device):
        runtime, device = _runtime(), torch.device(device)
        segments = _segments(device)
        starts = [a for a, _ in segments]
        used: dict[int, int] = {}
        tensors = []
        for name, view in views.items():
            ptr = view.data_ptr()
            i = bisect.bisect_right(starts, ptr) - 1
            if i < 0 or ptr >= segments[i][0] + segments[i][1]:
                raise ValueError(f"destination {name!r} is not in a CUDA caching-allocator segment on {device}")
            index = used.setdefault(i, len(used))
            tensors.append(IpcTensor(name, index, ptr - segments[i][0], tuple(view.shape), tuple(view.stride()),
                                     dtype_name(view.dtype)))
        order = sorted(used, key=used.get)
        handles = tuple(IpcSegment(bytes(runtime.ipcGetMemHandle(segments[i][0])), segments[i][1]) for i in order)
        self.ready = torch.cuda.Event(interprocess=True)
        self.done = torch.cuda.Event(interprocess=True)
        self.ready.record(torch.cuda.current_stream(device))
        self.done.record(torch.cuda.current_stream(device))
        self.device = device
        self.export = IpcExport(device_uuid(device), handles, tuple(tensors),
                                bytes(self.ready.ipc_handle()), bytes(self.done.ipc_handle()))

    def begin(self) -> None:
        """Mark that every read of the old weights issued so far precedes the writes."""
        self.ready.record(torch.cuda.current_stream(self.device))

    def end(self) -> None:
        """Make this worker's later work wait for the trainer's writes."""
        torch.cuda.current_stream(self.device).wait_event(self.done)


class MappedDestinations:
    """The trainer side: each exported segment opened once, each tensor a view of it."""

    def __init__(self, export: IpcExport, device: torch.device):
        runtime, device = _runtime(), torch.device(device)
        if device_uuid(device) != export.device_uuid:
            raise ValueError(f"colocated worker memory is on GPU {export.device_uuid}, this trainer is on {device_uuid(device)}")
        self.device, self.pointers = device, []
        bases = []
        for seg in export.segments:
            ptr = runtime.ipcOpenMemHandle(seg.handle)
            self.pointers.append(ptr)
            bases.append(_wrap(ptr, seg.nbytes, device))
        self.views = {t.name: _view(bases[t.segment], t) for t in export.tensors}
        self.ready = torch.cuda.Event.from_ipc_handle(device, export.ready_event)
        self.done = torch.cuda.Event.from_ipc_handle(device, export.done_event)

    def before_writes(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.ready)

    def after_writes(self) -> None:
        self.done.record(torch.cuda.current_stream(self.device))

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        self.views = {}
        runtime = _runtime()
        for ptr in self.pointers:
            runtime.ipcCloseMemHandle(ptr)
        self.pointers = []


def _wrap(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    import cupy

    memory = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=device.index)
    array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
    return torch.as_tensor(array, device=device)


def _view(base: torch.Tensor, t: IpcTensor) -> torch.Tensor:
    dtype = getattr(torch, t.dtype)
    if t.offset % dtype.itemsize:
        raise ValueError(f"destination {t.name!r} starts at byte {t.offset}, not aligned to {t.dtype}")
    span = base.numel() - t.offset
    typed = base[t.offset : t.offset + span - span % dtype.itemsize].view(dtype)
    return typed.as_strided(t.shape, t.stride)
