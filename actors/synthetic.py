"""Trainer and worker builders for synthetic models (`rl_sync.synthetic`).

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

from rl_sync.engine.sources import Destination, Sharded
from rl_sync.plan import TensorSpec


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


def worker_build(specs: Sequence[TensorSpec], num_trainers: int, device: str = "cpu") -> Callable:
    """`build(rank, size)`: zeroed live storage for every tensor worker `rank` keeps."""
    def build(rank: int, size: int) -> dict:
        side = {num_trainers + j: j for j in range(size)}
        out = {}
        for spec in specs:
            layout = spec.dst.remapped(side)
            box = layout.local_box(spec.shape, rank)
            dtype = getattr(torch, spec.dtype)
            view = None if box is None else torch.zeros(box.sizes, dtype=dtype, device=device)
            out[spec.name] = Destination(view, layout, spec.shape, dtype)
        return out
    return build
