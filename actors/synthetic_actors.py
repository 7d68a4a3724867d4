"""Trainer and worker builders for synthetic models (`rl_sync.models.synthetic`).

Benchmarks, the notebook and the planner's figures use them to stand up real
actors holding every tensor of, say, a dense 8B model without loading weights:
trainers hold random local shards, workers zeroed live destinations. A model
with `fp8_block` gives an FP8 engine: tensors the binder keeps quantized
(`spec.block`) are bf16 on the trainers and FP8 plus fp32 scales on the workers.

    specs = model_specs(model_config, TrainerParallel(ranks=4), Parallel(engines=2, tp=2))
    TrainerActor.remote(i, 4, trainer_build(specs))
    InferenceWorker.remote(j, 4, worker_build(specs, num_trainers=4))
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rl_sync.engine.sources import Destination, Sharded
from rl_sync.planning.plan import TensorSpec
from rl_sync.planning.quant import scale_name


def _scale_names(specs: Sequence[TensorSpec]) -> set[str]:
    return {scale_name(spec.name) for spec in specs if spec.block}


def trainer_build(specs: Sequence[TensorSpec], device: str = "cpu", seed: int = 0, dtype: str = "bfloat16") -> Callable:
    """`build(rank, size)`: random local shards of every tensor `rank` holds; a tensor the engine
    keeps block-quantized (`spec.block`) in `dtype` (the trainers quantize it; its scales are
    theirs to compute, not to hold)."""
    scales = _scale_names(specs)

    def build(rank: int, size: int) -> dict:
        gen = torch.Generator(device=device).manual_seed(seed + rank)
        out = {}
        for spec in specs:
            box = spec.src.local_box(spec.shape, rank)
            if box is not None and spec.name not in scales:
                local = torch.empty(box.sizes, dtype=getattr(torch, dtype if spec.block else spec.dtype), device=device)
                if local.is_floating_point():
                    local.normal_(generator=gen)
                out[spec.name] = Sharded(local, spec.src, spec.shape)
        return out

    return build


def worker_build(specs: Sequence[TensorSpec], num_trainers: int, device: str = "cpu") -> Callable:
    """`build(rank, size)`: zeroed live storage for every tensor worker `rank` keeps; a tensor
    kept block-quantized (`spec.block`) as FP8 values, its scales (`scale_name`) as fp32 ones."""
    scales = _scale_names(specs)

    def build(rank: int, size: int) -> dict:
        side = {num_trainers + j: j for j in range(size)}
        out = {}
        for spec in specs:
            layout = spec.dst.remapped(side)
            box = layout.local_box(spec.shape, rank)
            dtype = getattr(torch, spec.dtype)
            fill = torch.ones if spec.name in scales else torch.zeros
            view = None if box is None else fill(box.sizes, dtype=dtype, device=device)
            out[spec.name] = Destination(view, layout, spec.shape, dtype, block=tuple(spec.block))
        return out

    return build
