"""WeightSync on GPUs: colocated CUDA IPC on one GPU, and NCCL between GPUs where there are two."""

from __future__ import annotations

import pytest
import torch

from .pairs import CONFIG, check, pairs, pushed, release, set_versions, sparse_rounds


@pytest.mark.parametrize("count", [1, 2])
def test_colocated_cuda_ipc_bit_exact_with_fused_slots(gpu_ray, count):
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, count, same_gpu=True)
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        assert sync.summary.cuda_ipc and sync.summary.world_size == count
        for version in (1, 2):
            set_versions(ray, trainers, version)
            sync.push()
            check(ray, workers, count, version)
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


def test_m2n_over_nccl_between_gpus_bit_exact(gpu_ray):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig
    from tests.distributed.stranger import listening_ports, run_stranger

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 1, 1, same_gpu=False)
    try:
        before = ray.get([a.call.remote(listening_ports) for a in trainers + workers])
        sync = WeightSync.create(trainers, workers, SyncConfig(transport="nccl", colocate="off", **CONFIG))
        assert sync.summary.transport == "nccl" and not sync.summary.cuda_ipc
        after = ray.get([a.call.remote(listening_ports) for a in trainers + workers])
        opened = {p for old, new in zip(before, after) for p in new - old}  # NCCL's bootstrap and proxy listeners
        for version, mode in ((1, "m2n"), (2, "broadcast"), (3, "m2n")):
            set_versions(ray, trainers, version)
            sync.push(mode=mode)
            check(ray, workers, 1, version)
            if version == 1:  # a stranger floods what the ranks listen on: later rounds still land
                seen = run_stranger(0, opened)
                assert seen["listener_flood"] > 0, f"no listener of {sorted(opened)} took a connection"
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


@pytest.mark.parametrize("baseline", ["device", "pinned_cpu"])
def test_sparse_rounds_through_cuda_ipc_with_either_baseline(gpu_ray, baseline):
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True)
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(sparse_baseline=baseline, **CONFIG))
        assert sparse_rounds(ray, sync, trainers, workers) == ["m2n", "sparse", "sparse"]
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


def _rebuild_and_move(actor) -> None:
    """The engine rebuilds its fused qkv (new tensor, new Destinations for its slots) and gives
    o_proj new storage in place (`.data = ...`)."""
    from dataclasses import replace

    parts = ("q_proj.weight", "k_proj.weight", "v_proj.weight")
    fused = torch.full_like(actor.held[parts[0]].local._base, float("nan"))
    row = 0
    for name in parts:
        rows = actor.held[name].local.shape[0]
        actor.held[name] = replace(actor.held[name], local=fused[row : row + rows])
        row += rows
    o_proj = actor.held["o_proj.weight"].local
    o_proj.data = torch.full_like(o_proj, float("nan"))


def test_a_colocated_worker_that_rebuilt_or_moved_weights_exports_anew_and_gets_a_full_round(gpu_ray):
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True)
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        assert pushed(ray, sync, trainers, workers, 1) == "m2n"
        ray.get(workers[0].call.remote(_rebuild_and_move))
        assert sync.versions() == [None]
        assert pushed(ray, sync, trainers, workers, 2) == "m2n", "the worker exported anew: every tensor, dense"
        assert pushed(ray, sync, trainers, workers, 3) == "sparse"
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


def _addresses(actor) -> dict:
    return {name: d.local.data_ptr() for name, d in actor.held.items()}


def test_staged_rounds_through_cuda_ipc_land_in_the_shadows_and_each_commit_swaps_them_in(gpu_ray):
    """Colocated and double buffered: the trainer writes the worker's shadows itself while the
    worker serves the version it holds; the commit swaps them in (the worker allows it), and the
    trainer, which mapped both faces at once, writes the other face in the next round."""
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True)
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(double_buffer=True, **CONFIG))
        assert sync.summary.cuda_ipc
        first = ray.get(workers[0].call.remote(_addresses))
        assert pushed(ray, sync, trainers, workers, 1) == "m2n", "the first sparse request runs dense"
        second = ray.get(workers[0].call.remote(_addresses))
        assert all(second[n] != first[n] for n in first), "the blocking round's commit swapped"
        # dense, sparse (the spare holds the round before: it catches up first), dense again
        for version, mode in ((2, "m2n"), (3, "sparse"), (4, "m2n")):
            set_versions(ray, trainers, version)
            staged = sync.stage(mode=mode)
            check(ray, workers, 1, version - 1)
            assert sync.versions() == [version - 1], "the worker serves the version it holds in full"
            stats = staged.commit()
            assert (stats.version, stats.mode) == (version, mode) and stats.commit_seconds > 0
            check(ray, workers, 1, version)
            assert sync.versions() == [version]
            assert ray.get(workers[0].call.remote(_addresses)) == (second if version % 2 else first), "swapped"
        sync.close()
    finally:
        release(ray, pg, trainers + workers)


def test_a_staged_round_after_the_worker_rebuilt_weights_maps_its_new_export_and_carries_every_tensor(gpu_ray):
    """A staged round opens on the workers before the trainers write, one call at a time (not in
    one step with the trainers'): a worker that rebuilt or moved weights answers a new export,
    opened for the round, which its trainer maps before writing; the round carries every tensor."""
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    ray = gpu_ray
    pg, trainers, workers = pairs(ray, 0.5, 1, same_gpu=True)
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(double_buffer=True, **CONFIG))
        assert pushed(ray, sync, trainers, workers, 1) == "m2n"
        ray.get(workers[0].call.remote(_rebuild_and_move))
        for version, ran in ((2, "m2n"), (3, "sparse")):  # the first after the move carries every tensor
            set_versions(ray, trainers, version)
            stats = sync.stage(mode="sparse").commit()
            assert (stats.version, stats.mode) == (version, ran)
            check(ray, workers, 1, version)
            assert sync.versions() == [version]
        sync.close()
    finally:
        release(ray, pg, trainers + workers)
