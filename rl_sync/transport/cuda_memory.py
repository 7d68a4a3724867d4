"""What backs a device pointer, and export / import of CUDA VMM allocations between processes.

Device memory reaches colocated IPC in two kinds:

* `legacy`: `cudaMalloc` memory (PyTorch's classic caching allocator). One
  `cudaIpcMemHandle` opens a whole allocation in another process.
* `vmm`: physical allocations made with `cuMemCreate` and mapped with
  `cuMemMap` (PyTorch's expandable segments, custom VMM allocators).
  `cudaIpcGetMemHandle` refuses them; each mapping is exported as a POSIX file
  descriptor (`cuMemExportToShareableHandle`), which the other process imports,
  maps into address space of its own and grants its device access to.

VMM memory allocated without a shareable handle type (vLLM's sleep-mode
`CuMemAllocator` creates its handles so) and stream-ordered pool memory
(`cudaMallocAsync`) cannot be shared this way: `backings` raises
`IpcUnavailable` naming why.

Driver calls go through NVIDIA's `cuda-bindings` (the `cuda12` / `cuda13`
extras). Typical use::

    chunks = backings(tensor.data_ptr(), extent_bytes(tensor))   # exporter
    fds = [export_fd(c.base) for c in chunks if c.kind == "vmm"]
    mapped = map_fds(fds, [c.size for c in chunks], device_index)   # importer
    ...; mapped.close()
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch


class IpcUnavailable(ValueError):
    """Memory that cannot be mapped into another process, and why."""


@dataclass(frozen=True)
class Backing:
    """One allocation (legacy) or one physical mapping (vmm) under a range of addresses."""

    kind: Literal["legacy", "vmm"]
    base: int
    size: int
    buffer_id: int
    """The driver's process-unique id of the backing memory: a release and re-allocation at the
    same address gets a new one."""


def driver() -> Any:
    """`cuda.bindings.driver`, or a clear error naming the extra that brings it."""
    try:
        from cuda.bindings import driver as cu
    except ImportError as exc:
        raise IpcUnavailable(
            f"colocated CUDA IPC needs cuda-bindings: pip install 'rl-sync[cuda12]' or '[cuda13]' ({exc})"
        ) from None
    return cu


def _call(what: str, result: tuple) -> Any:
    cu = driver()
    err, *out = result
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else int(err)}")
    return out[0] if len(out) == 1 else tuple(out)


def _attr(ptr: int, name: str) -> int | None:
    """A pointer attribute as an int, or None where the driver has none for `ptr`."""
    cu = driver()
    err, value = cu.cuPointerGetAttribute(getattr(cu.CUpointer_attribute, f"CU_POINTER_ATTRIBUTE_{name}"), ptr)
    return int(value) if err == cu.CUresult.CUDA_SUCCESS else None


def _known_attr(ptr: int, name: str) -> int:
    """A pointer attribute of memory known to be mapped at `ptr`; RuntimeError if the driver has none."""
    value = _attr(ptr, name)
    if value is None:
        raise RuntimeError(f"cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_{name}) failed for mapped address {ptr:#x}")
    return value


def buffer_id(ptr: int) -> int | None:
    """The id of the memory backing `ptr` now, or None if nothing is mapped there."""
    return _attr(ptr, "BUFFER_ID")


def backing(ptr: int, what: str) -> Backing:
    """The allocation or mapping that holds `ptr`; `IpcUnavailable` for memory no other process
    can map (`what` names the tensor in the message)."""
    if _attr(ptr, "IS_LEGACY_CUDA_IPC_CAPABLE"):
        start, size = _known_attr(ptr, "RANGE_START_ADDR"), _known_attr(ptr, "RANGE_SIZE")
        return Backing("legacy", start, size, _known_attr(ptr, "BUFFER_ID"))
    if _attr(ptr, "MEMPOOL_HANDLE"):
        raise IpcUnavailable(
            f"{what} is in a stream-ordered CUDA memory pool (cudaMallocAsync, e.g. "
            f"PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), which colocated IPC does not map"
        )
    cu = driver()
    err, base, size = cu.cuMemGetAddressRange(ptr)  # a VMM address: the one mapping that holds it
    if err != cu.CUresult.CUDA_SUCCESS or not size:
        raise IpcUnavailable(f"{what} is in CUDA memory that neither a cudaIpcMemHandle nor a VMM export can share")
    types = _attr(ptr, "ALLOWED_HANDLE_TYPES") or 0
    if not types & int(cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR):
        raise IpcUnavailable(
            f"{what} is in CUDA VMM memory (cuMemCreate) allocated without a POSIX file-descriptor "
            f"handle type (allowed handle types: {types}), as vLLM's sleep-mode allocator allocates; "
            f"no other process can map it"
        )
    return Backing("vmm", int(base), int(size), _known_attr(ptr, "BUFFER_ID"))


def backings(ptr: int, nbytes: int, what: str) -> list[Backing]:
    """Every allocation or mapping under `[ptr, ptr + nbytes)`, in address order."""
    out, end = [backing(ptr, what)], ptr + max(nbytes, 1)
    while out[-1].base + out[-1].size < end:
        out.append(backing(out[-1].base + out[-1].size, what))
    if len({b.kind for b in out}) > 1:
        raise IpcUnavailable(f"{what} spans cudaMalloc and VMM memory")
    return out


def extent_bytes(tensor: torch.Tensor) -> int:
    """Bytes from a strided tensor's first element to the end of its last."""
    if tensor.numel() == 0:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def export_fd(base: int) -> int:
    """A POSIX file descriptor for the physical allocation mapped at `base` (the caller owns it)."""
    cu = driver()
    handle = _call("cuMemRetainAllocationHandle", cu.cuMemRetainAllocationHandle(base))
    try:
        kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return int(_call("cuMemExportToShareableHandle", cu.cuMemExportToShareableHandle(handle, kind, 0)))
    finally:
        _call("cuMemRelease", cu.cuMemRelease(handle))


class MappedRange:
    """Imported allocations mapped back to back into one reserved range of this process."""

    def __init__(self, base: int, size: int):
        self.base, self.size = base, size
        self.handles: list = []
        self.sizes: list[int] = []
        """Bytes of each mapping, from `base` on."""

    def close(self) -> None:
        """Unmap, release every imported handle and free the address range (idempotent)."""
        cu = driver()
        while self.sizes:
            size = self.sizes.pop()
            _call("cuMemUnmap", cu.cuMemUnmap(self.base + sum(self.sizes), size))
        while self.handles:
            _call("cuMemRelease", cu.cuMemRelease(self.handles.pop()))
        if self.size:
            _call("cuMemAddressFree", cu.cuMemAddressFree(self.base, self.size))
            self.size = 0


def map_fds(fds: Sequence[int], sizes: Sequence[int], device_index: int) -> MappedRange:
    """Import each file descriptor (closing it) and map them back to back, read-write for
    `device_index`; nothing stays mapped or open if any step fails."""
    cu = driver()
    total = sum(sizes)
    kind = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    mapped = None
    try:
        mapped = MappedRange(int(_call("cuMemAddressReserve", cu.cuMemAddressReserve(total, 0, 0, 0))), total)
        for fd, size in zip(fds, sizes):
            mapped.handles.append(_call("cuMemImportFromShareableHandle", cu.cuMemImportFromShareableHandle(fd, kind)))
            _call("cuMemMap", cu.cuMemMap(mapped.base + sum(mapped.sizes), size, 0, mapped.handles[-1], 0))
            mapped.sizes.append(size)
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _call("cuMemSetAccess", cu.cuMemSetAccess(mapped.base, total, [access], 1))
        return mapped
    except BaseException:
        if mapped is not None:
            mapped.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)
