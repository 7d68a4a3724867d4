"""FP8 destinations on the GPU: the Triton quantizer against the block formula for every layout
pair of the CPU tests, and a colocated (CUDA IPC) FP8 push, bit-exact."""

from __future__ import annotations

import pytest
import torch

from rl_sync.engine.sources import Destination
from rl_sync.planning.layout import Layout, Mesh, Replicate
from rl_sync.planning.quant import dest_scale_layout, grid_shape, scale_name

from ..unit.test_quant import LAYOUTS, _random, bits, push, reference
from . import builders
from .pairs import CONFIG, pairs, release


@pytest.mark.parametrize("name, shape, src, dst, block", LAYOUTS, ids=[entry[0] for entry in LAYOUTS])
def test_triton_quantizer_delivers_the_reference_for_every_layout(name, shape, src, dst, block):
    x = _random(shape, seed=7)
    got, _ = push(x.cuda(), src, dst, block)
    want_q, want_scale = reference(x, block)
    assert torch.equal(bits(got[scale_name("w")].cpu()), bits(want_scale))
    assert torch.equal(bits(got["w"].cpu()), bits(want_q))


def test_a_nan_makes_its_block_nan_and_leaves_the_others_exact():
    x = _random((256, 256), seed=8)
    x[200, 200] = float("nan")
    got, _ = push(x.cuda(), LAYOUTS[0][2], LAYOUTS[0][3], (128, 128))
    want_q, want_scale = reference(x, (128, 128))
    q, scale = got["w"].cpu().float(), got[scale_name("w")].cpu()
    assert torch.equal(scale.isnan(), want_scale.isnan()) and scale.isnan().sum() == 1
    assert torch.equal(q.isnan(), want_q.float().isnan())
    finite = ~want_q.float().isnan()
    assert torch.equal(bits(got["w"].cpu()[finite]), bits(want_q[finite]))


def fp8_workers(block: tuple[int, int], replicated: bool):
    """`build(rank, size)`: every projection FP8 with its block scales, the norm in bf16, NaN until
    synced; TP shards (`builders.dst_layout`) or, `replicated`, whole tensors on every worker."""

    def build(rank: int, size: int) -> dict:
        out = {}
        for name, shape in builders.SHAPES.items():
            layout = Layout(Mesh((size,)), (Replicate(),)) if replicated else builders.dst_layout(name, size)
            coord = layout.mesh.coordinate(rank)
            assert coord is not None, f"worker {rank} is outside {layout}"
            box = layout.box_at(shape, coord)
            if len(shape) == 1:
                out[name] = Destination(
                    torch.full(box.sizes, float("nan"), dtype=torch.bfloat16, device="cuda"),
                    layout,
                    shape,
                    torch.bfloat16,
                )
                continue
            values = torch.full(box.sizes, float("nan"), device="cuda").to(torch.float8_e4m3fn)
            out[name] = Destination(values, layout, shape, torch.float8_e4m3fn, block=block)
            grid, scales = grid_shape(shape, block), dest_scale_layout(layout, shape, block, name)
            view = torch.full(scales.box_at(grid, coord).sizes, float("nan"), device="cuda")
            out[scale_name(name)] = Destination(view, scales, grid, torch.float32)
        return out

    return build


def _read(actor) -> dict:
    return {n: d.local.detach().cpu().contiguous().view(torch.uint8) for n, d in actor.held.items()}


@pytest.mark.parametrize(
    "count, block, replicated",
    [(1, (64, 64), False), (2, (96, 64), True)],
    ids=["one GPU", "two GPUs, trainers cutting blocks"],
)
def test_colocated_fp8_push_is_bit_exact(gpu_ray, count, block, replicated):
    """One trainer and one worker per GPU. On two GPUs the two trainers hold 128 rows each of
    every projection and the blocks are 96 rows, so the amax exchange runs over NCCL."""
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")
    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    pg, trainers, workers = pairs(gpu_ray, 0.5, count, same_gpu=True, worker_build=fp8_workers(block, replicated))
    try:
        sync = WeightSync.create(trainers, workers, SyncConfig(**CONFIG))
        assert sync.summary.cuda_ipc
        modes = []
        for version in (0, 1, 2):
            gpu_ray.get([t.call.remote(builders.set_version, version) for t in trainers])
            modes.append(sync.push(mode="sparse").mode)
            for got in gpu_ray.get([w.call.remote(_read) for w in workers]):
                for name in builders.SHAPES:
                    full = builders.full(name, version, "cpu")
                    if full.ndim == 1:
                        assert torch.equal(got[name], bits(full)), name
                        continue
                    q, scale = reference(full, block)
                    assert torch.equal(got[name], bits(q)) and torch.equal(got[scale_name(name)], bits(scale)), name
        assert modes == ["m2n", "sparse", "sparse"]
        sync.close()
    finally:
        release(gpu_ray, pg, trainers + workers)
