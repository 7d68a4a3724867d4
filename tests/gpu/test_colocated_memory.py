"""Colocated CUDA IPC over the memory RL stacks allocate: expandable segments, VMM allocations,
memory released and re-allocated between rounds, and many groups formed and closed."""

from __future__ import annotations

import os
import re

import pytest
import torch

from . import builders
from .pairs import CONFIG, EXPANDABLE, check, pairs, pushed, release, set_versions, sparse_rounds
from .vmm import BUFFERS, VmmBuffer

MIB = 1 << 20


def vmm_worker(shareable: bool):
    """`builders.worker_build`, with the fused qkv slot in a two-chunk `VmmBuffer`, straddling
    the chunks; the other destinations stay in PyTorch's allocator."""

    def build(rank: int, size: int):
        out = builders.worker_build(rank, size)
        parts = builders.FUSED["qkv"]
        rows = sum(out[p].local.shape[0] for p in parts)
        buffer = VmmBuffer(64 * MIB, torch.cuda.current_device(), chunks=2, shareable=shareable)
        start = buffer.chunk - 64 * 1024
        fused = buffer.tensor((start // 2 + rows * builders.HIDDEN,), torch.bfloat16)[start // 2 :]
        fused = fused.view(rows, builders.HIDDEN)
        fused.fill_(float("nan"))
        row = 0
        for p in parts:
            n = out[p].local.shape[0]
            out[p] = builders.Destination(
                fused[row : row + n], builders.dst_layout(p, size), builders.SHAPES[p], torch.bfloat16
            )
            row += n
        return out

    return build


def _kinds(actor) -> list:
    return [(r.kind, r.chunks) for r in actor._rl_sync_ipc.export.regions]


def _expandable(actor) -> bool:
    return all(s["is_expandable"] for s in torch.cuda.memory_snapshot())


def _used(actor) -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def _sleep_and_wake(actor) -> None:
    for buffer in BUFFERS:
        buffer.sleep()
    for buffer in BUFFERS:
        buffer.wake()
    torch.cuda.synchronize()


def _open_fds(actor) -> int:
    """Open descriptors other than sockets (Ray's own connections come and go)."""
    return sum(
        not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    )


def _mappings(actor) -> list[tuple[int, int | None]]:
    """(address, driver buffer id) of each region the trainer has mapped."""
    from rl_sync.transport.cuda_memory import buffer_id

    mapped = actor._rl_sync_session.joined.mapped  # the trainer's `cuda_ipc` transport
    return [(a, buffer_id(a)) for a in list(mapped.opened) + [r.base for r in mapped.ranges]]


def _still_mapped(actor, mappings: list[tuple[int, int | None]]) -> list[int]:
    """The addresses of `mappings` that still hold the same mapping (a new one may reuse them)."""
    from rl_sync.transport.cuda_memory import buffer_id

    return [a for a, old in mappings if buffer_id(a) == old]


@pytest.mark.parametrize("side", ["worker", "trainer", "both"])
def test_expandable_segments_on_either_side_dense_and_sparse_bit_exact(gpu_ray, side):
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(
        ray,
        0.5,
        1,
        same_gpu=True,
        trainer_env=EXPANDABLE if side != "worker" else None,
        worker_env=EXPANDABLE if side != "trainer" else None,
    )
    try:
        assert ray.get(workers[0].call.remote(_expandable)) == (side != "trainer")
        assert ray.get(trainers[0].call.remote(_expandable)) == (side != "worker")
        sync = WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        assert sync.summary.cuda_ipc
        kinds = {kind for kind, _ in ray.get(workers[0].call.remote(_kinds))}
        assert kinds == ({"vmm"} if side != "trainer" else {"legacy"})
        assert sparse_rounds(ray, sync, trainers, workers) == ["m2n", "sparse", "sparse"]
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


def test_vmm_memory_beside_the_caching_allocator_and_released_and_reallocated_between_rounds(gpu_ray):
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True, worker_build=vmm_worker(shareable=True))
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        kinds = ray.get(workers[0].call.remote(_kinds))
        assert ("vmm", (32 * MIB, 32 * MIB)) in kinds and any(kind == "legacy" for kind, _ in kinds)
        # the first sparse push is dense: it takes the baseline
        assert sparse_rounds(ray, sync, trainers, workers, (1, 2)) == ["m2n", "sparse"]
        before = ray.get(workers[0].call.remote(_used))
        ray.get(workers[0].call.remote(_sleep_and_wake))  # new memory under the same addresses
        held = ray.get(workers[0].call.remote(_used)) - before
        assert held >= 60 * MIB, f"the trainer's mapping should still hold the old 64 MiB, {held / MIB:.1f} MiB held"
        assert sync.versions() == [None]
        assert pushed(ray, sync, trainers, workers, 3) == "m2n"  # the new memory holds what the engine put there
        after = ray.get(workers[0].call.remote(_used)) - before
        assert abs(after) < 16 * MIB, f"the old mapping was not released: {after / MIB:.1f} MiB more in use"
        assert sync.versions() == [3]
        assert pushed(ray, sync, trainers, workers, 4) == "sparse"
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


def _qkv_untouched(actor) -> bool:
    return all(bool(torch.isnan(actor.held[p].local).all()) for p in builders.FUSED["qkv"])


POOL = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}
WHY = {
    "vmm without a shareable handle": r"destination '[qkv]_proj\.weight' is in CUDA VMM memory \(cuMemCreate\) "
    r"allocated without a POSIX file-descriptor handle type \(allowed handle types: 0\)",
    "cudaMallocAsync": r"destination '[\w.]+' is in a stream-ordered CUDA memory pool \(cudaMallocAsync",
}


@pytest.mark.parametrize("memory", list(WHY))
def test_memory_no_other_process_can_map_fails_init_saying_why(gpu_ray, memory):
    from actors import SyncError, WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pool = memory == "cudaMallocAsync"
    build = builders.worker_build if pool else vmm_worker(shareable=False)
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True, worker_build=build, worker_env=POOL if pool else None)
    try:
        with pytest.raises(SyncError) as info:
            WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        text = str(info.value)
        assert re.search(WHY[memory], text), text
        assert "NCCL cannot join two ranks on one GPU" in text and "CUDA_ERROR" not in text
        assert ray.get(workers[0].call.remote(_qkv_untouched))
    finally:
        release(ray, pg, trainers + workers)


def test_fifty_groups_formed_and_closed_leave_no_descriptor_or_mapping_behind(gpu_ray):
    """Each repair closes the group's ranks and forms it again (export, descriptors, mapping),
    under one coordinator; the last cycle closes the group."""
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True, worker_build=vmm_worker(shareable=True))
    actors = trainers + workers
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        counts = []
        for cycle in range(51):
            set_versions(ray, trainers, cycle + 1)
            sync.push()
            check(ray, workers, 1, cycle + 1)
            mapped = ray.get(trainers[0].call.remote(_mappings))
            assert len(mapped) >= 2
            if cycle < 50:
                sync.repair()
            else:
                sync.close()
            assert ray.get(trainers[0].call.remote(_still_mapped, mapped)) == [], f"cycle {cycle}"
            counts.append(ray.get([a.call.remote(_open_fds) for a in actors]))
        assert counts[49] == counts[0], (
            f"open descriptors (trainer, worker) after repair 1 {counts[0]}, after 50 {counts[49]}"
        )
        assert all(last <= first for last, first in zip(counts[50], counts[0])), f"after close: {counts[50]}"
    finally:
        release(ray, pg, actors)
