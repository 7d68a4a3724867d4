"""Shared pieces of the GPU benchmarks: Ray start, actor pairs, model shapes, tables."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path

import ray
import torch
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from actors.ready import InferenceWorker, TrainerActor  # noqa: E402
from actors.synthetic_actors import trainer_build, worker_build  # noqa: E402
from rl_sync.models.config import ModelConfig, Parallel  # noqa: E402
from rl_sync.models.synthetic import TrainerParallel, model_specs  # noqa: E402
from rl_sync.planning.layout import Layout, Mesh, Replicate  # noqa: E402
from rl_sync.planning.plan import TensorSpec  # noqa: E402

LLAMA_8B = ModelConfig(
    family="llama", layers=32, hidden=4096, intermediate=14336, vocab=128256, heads=32, kv_heads=8, head_dim=128
)


def start_ray() -> None:
    """Ray on loopback; actors import what this process does (the repository, `benchmarks/`)."""
    pythonpath = os.environ.get("PYTHONPATH", "")
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks"), pythonpath])}},
    )


def specs_8b(fp8_block: tuple[int, int] | None = None) -> list[TensorSpec]:
    """Llama-3-8B shapes (291 tensors, 16.06 GB bf16), one trainer to one worker, unsharded; with
    `fp8_block`, an engine keeping the projections block-quantized FP8."""
    model = dataclasses.replace(LLAMA_8B, fp8_block=fp8_block)
    return model_specs(model, TrainerParallel(ranks=1), Parallel())


def specs_small(total_bytes: int, count: int) -> list[TensorSpec]:
    """`count` bf16 tensors of equal shape adding up to about `total_bytes`."""
    cols = 1024
    rows = max(1, total_bytes // (count * 2 * cols))
    src, dst = Layout(Mesh((1,)), (Replicate(),)), Layout(Mesh((1,), start_rank=1), (Replicate(),))
    return [TensorSpec(f"small.{i}.weight", "bfloat16", (rows, cols), src, dst) for i in range(count)]


def pair(specs, same_gpu: bool, env: dict | None = None):
    """One trainer and one worker actor holding `specs` on CUDA: sharing one GPU (one
    placement-group bundle, 0.5 GPU each) or on two GPUs (one bundle each); `env`: environment
    variables of both (e.g. `PYTORCH_CUDA_ALLOC_CONF`). FP8 specs (`spec.block`) give a worker
    keeping those tensors block-quantized."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg = placement_group([{"GPU": 1, "CPU": 1}] * (1 if same_gpu else 2), strategy="PACK")
    ray.get(pg.ready(), timeout=300)
    gpus = 0.5 if same_gpu else 1

    def opts(bundle: int) -> dict:
        return {
            "num_gpus": gpus,
            "num_cpus": 0.5,
            **({"runtime_env": {"env_vars": env}} if env else {}),
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
        }

    Trainer, Worker = ray.remote(TrainerActor), ray.remote(InferenceWorker)
    trainer = Trainer.options(**opts(0)).remote(0, 1, trainer_build(specs, "cuda"))
    worker = Worker.options(**opts(0 if same_gpu else 1)).remote(0, 1, worker_build(specs, 1, "cuda"))
    ray.get(
        [
            trainer.call.remote(lambda self: torch.cuda.synchronize()),
            worker.call.remote(lambda self: torch.cuda.synchronize()),
        ]
    )
    return pg, trainer, worker


def median_round(sync, repeat: int, **push) -> dict:
    rounds = [sync.push(**push) for _ in range(repeat)]
    rank_s = [max(r.seconds for r in s.ranks) for s in rounds]
    mid = sorted(rounds, key=lambda s: s.seconds)[len(rounds) // 2]
    return {
        "round_s": statistics.median(s.seconds for s in rounds),
        "rank_s": statistics.median(rank_s),
        "bytes": mid.worker_received_bytes,
    }


def show(title: str, columns: list[str], rows: list[list[str]], name: str, raw: dict) -> None:
    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for row in rows:
        table.add_row(*row)
    Console(width=160).print(table)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(json.dumps(raw, indent=2))
