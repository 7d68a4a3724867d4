"""Trainer and worker builders for synthetic models (`rl_sync.models.synthetic`).

Benchmarks, the notebook and the planner's figures use them to stand up real
actors holding every tensor of, say, a dense 8B model without loading weights:
trainers hold random local shards, workers zeroed live destinations.

    specs = model_specs(shape, TrainerParallel(ranks=4), InferenceParallel(engines=2, tensor_parallel=2))
    TrainerActor.remote(i, 4, trainer_build(specs))
    InferenceWorker.remote(j, 4, worker_build(specs, num_trainers=4))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl_sync.bind.rules import QUANTIZED
from rl_sync.engine.sources import Destination, Sharded
from rl_sync.planning.layout import Layout
from rl_sync.planning.plan import TensorSpec
from rl_sync.planning.quant import dest_scale_layout, grid_shape, scale_name


def trainer_build(specs: Sequence[TensorSpec], device: str = "cpu", seed: int = 0) -> Callable:
    """`build(rank, size)`: random local shards of every tensor `rank` holds."""
    def build(rank: int, size: int) -> dict:
        gen = torch.Generator(device=device).manual_seed(seed + rank)
        out = {}
        for spec in specs:
            box = spec.src.local_box(spec.shape, rank)
            if box is not None:
                local = torch.empty(box.sizes, dtype=getattr(torch, spec.dtype), device=device)
                if local.is_floating_point():
                    local.normal_(generator=gen)
                out[spec.name] = Sharded(local, spec.src, spec.shape)
        return out
    return build


def worker_build(specs: Sequence[TensorSpec], num_trainers: int, device: str = "cpu",
                 fp8_block: tuple[int, int] | None = None) -> Callable:
    """`build(rank, size)`: zeroed live storage for every tensor worker `rank` keeps; with
    `fp8_block`, projection weights (`rl_sync.bind.rules.QUANTIZED`) block-quantized FP8 plus
    their scales."""
    def build(rank: int, size: int) -> dict:
        side = {num_trainers + j: j for j in range(size)}
        out = {}
        for spec in specs:
            layout = spec.dst.remapped(side)
            if fp8_block is not None and spec.name.endswith(QUANTIZED):
                out.update(_fp8_destinations(spec.name, spec.shape, layout, rank, fp8_block, device))
                continue
            box = layout.local_box(spec.shape, rank)
            dtype = getattr(torch, spec.dtype)
            view = None if box is None else torch.zeros(box.sizes, dtype=dtype, device=device)
            out[spec.name] = Destination(view, layout, spec.shape, dtype)
        return out
    return build


def _fp8_destinations(name: str, shape: tuple[int, ...], layout: Layout, rank: int, block: tuple[int, int],
                      device: str) -> dict:
    box, grid = layout.local_box(shape, rank), grid_shape(shape, block, name)
    scales = dest_scale_layout(layout, shape, block, name)
    values = None if box is None else torch.zeros(box.sizes, dtype=torch.float8_e4m3fn, device=device)
    scale_box = scales.local_box(grid, rank)
    view = None if scale_box is None else torch.ones(scale_box.sizes, dtype=torch.float32, device=device)
    return {name: Destination(values, layout, shape, torch.float8_e4m3fn, block=block),
            scale_name(name): Destination(view, scales, grid, torch.float32)}
