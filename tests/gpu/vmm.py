"""A test allocator on the CUDA VMM API, shaped like an engine's sleep-mode allocator.

`VmmBuffer` reserves addresses once and backs them with `chunks` physical
allocations (`cuMemCreate`) mapped back to back; `sleep()` unmaps and releases
them, keeping the addresses, and `wake()` creates and maps new ones there, so
tensors over the buffer keep their pointers while the memory under them
changes. `shareable=False` creates handles with no shareable type, as vLLM's
`CuMemAllocator` does. Buffers live in `BUFFERS` of the process that made them.
"""

from __future__ import annotations

import torch

from rl_sync.transport.cuda_memory import _call, driver

BUFFERS: list[VmmBuffer] = []


class VmmBuffer:
    def __init__(self, nbytes: int, device_index: int, chunks: int = 2, shareable: bool = True):
        cu = driver()
        self.prop = cu.CUmemAllocationProp()
        self.prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = device_index
        self.prop.requestedHandleTypes = (
            cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
            if shareable
            else cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_NONE
        )
        granularity = _call(
            "granularity",
            cu.cuMemGetAllocationGranularity(
                self.prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            ),
        )
        self.chunk = -(-nbytes // chunks // granularity) * granularity
        self.nbytes, self.count, self.device_index = self.chunk * chunks, chunks, device_index
        self.base = int(_call("reserve", cu.cuMemAddressReserve(self.nbytes, 0, 0, 0)))
        self.handles: list = []
        self.wake()
        BUFFERS.append(self)

    def wake(self) -> None:
        cu = driver()
        for i in range(self.count):
            self.handles.append(_call("create", cu.cuMemCreate(self.chunk, self.prop, 0)))
            _call("map", cu.cuMemMap(self.base + i * self.chunk, self.chunk, 0, self.handles[-1], 0))
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _call("access", cu.cuMemSetAccess(self.base, self.nbytes, [access], 1))

    def sleep(self) -> None:
        cu = driver()
        torch.cuda.synchronize()
        for i, handle in enumerate(self.handles):
            _call("unmap", cu.cuMemUnmap(self.base + i * self.chunk, self.chunk))
            _call("release", cu.cuMemRelease(handle))
        self.handles = []

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor over the start of the buffer (its pointer outlives sleep and wake)."""
        import cupy

        memory = cupy.cuda.UnownedMemory(self.base, self.nbytes, owner=self, device_id=self.device_index)
        raw = torch.as_tensor(
            cupy.ndarray((self.nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)), device="cuda"
        )
        count = 1
        for n in shape:
            count *= n
        return raw[: count * dtype.itemsize].view(dtype).view(shape)
