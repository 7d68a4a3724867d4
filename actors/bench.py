"""`rl-sync bench`: M2N, sparse and broadcast rounds side by side on a synthetic model.

Trainer actors hold random FSDP (`Shard(0)`) shards of a synthetic model
(`rl_sync.models.synthetic`), engine workers zeroed TP shards; each mode runs
`repeat` rounds (the sparse one after changing `density` of every tensor) and
the table shows bytes and seconds per round. `--chart out.png` draws them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import ray
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from rl_sync.config.sync import SPARSE_MODES, SyncConfig
from rl_sync.models.config import ModelConfig, Parallel
from rl_sync.models.synthetic import TrainerParallel, model_specs
from rl_sync.wire.stats import RoundStats

from .placement import SyncPlacement
from .ready import InferenceWorker, TrainerActor
from .synthetic_actors import trainer_build, worker_build
from .weight_sync import WeightSync


def _default_shape() -> ModelConfig:
    return ModelConfig(
        family="llama", layers=8, hidden=768, intermediate=2048, vocab=32000, heads=12, kv_heads=12, head_dim=64
    )


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What `rl-sync bench` runs."""

    model: ModelConfig = field(default_factory=_default_shape)
    """Synthetic model shapes (default: ~106M bf16 parameters)."""
    trainer: TrainerParallel = field(default_factory=lambda: TrainerParallel(ranks=4))
    inference: Parallel = field(default_factory=lambda: Parallel(engines=2, tp=2))
    modes: tuple[str, ...] = ("m2n", "sparse", "broadcast")
    """Modes to run, in order."""
    repeat: int = 5
    """Rounds per mode (the median is reported)."""
    density: float = 0.01
    """Fraction of every tensor changed before each sparse round."""
    cpus_per_actor: float = 0.25
    sync: SyncConfig = field(default_factory=lambda: SyncConfig(transport="gloo", bucket_bytes=64 << 20))


def perturb(actor, density: float, seed: int) -> None:
    """Run inside a trainer actor: add 1 to a `density` fraction of every held shard's elements
    (chosen by `seed`), as a training step that changes that fraction would."""
    gen = torch.Generator().manual_seed(seed)
    for sharded in actor.held.values():
        flat = sharded.local.view(-1)
        idx = torch.randperm(flat.numel(), generator=gen)[: int(flat.numel() * density)]
        flat[idx] = (flat[idx].float() + 1.0).to(flat.dtype)


def run(cfg: BenchConfig, console: Console | None = None) -> dict[str, list[RoundStats]]:
    """Run every mode `repeat` times on the connected Ray cluster; rounds by mode."""
    console = console or Console()
    if cfg.inference.pp != 1:
        raise ValueError(f"rl-sync bench places engines x tp workers; inference.pp must be 1, got {cfg.inference.pp}")
    specs = model_specs(cfg.model, cfg.trainer, cfg.inference)
    t, e, tp = cfg.trainer.ranks, cfg.inference.engines, cfg.inference.tp
    placement = SyncPlacement.create(t, e, tp, cpus=cfg.cpus_per_actor)
    Trainer, Worker = ray.remote(TrainerActor), ray.remote(InferenceWorker)
    trainers = [Trainer.options(**placement.trainer(i)).remote(i, t, trainer_build(specs)) for i in range(t)]
    workers = [
        Worker.options(**placement.worker(k // tp, k % tp)).remote(k, e * tp, worker_build(specs, t))
        for k in range(e * tp)
    ]
    rounds: dict[str, list[RoundStats]] = {}
    try:
        sync = WeightSync.create(trainers, workers, cfg.sync)
        sync.push()
        with Progress(console=console, transient=True) as progress:
            task = progress.add_task("rounds", total=len(cfg.modes) * cfg.repeat)
            for mode in cfg.modes:
                rounds[mode] = []
                for i in range(cfg.repeat):
                    if mode in SPARSE_MODES:
                        steps = [a.call.remote(perturb, cfg.density, i) for a in trainers]
                        ray.get(steps)
                    rounds[mode].append(sync.push(mode=mode))
                    progress.advance(task)
        sync.close()
    finally:
        for actor in trainers + workers:
            ray.kill(actor)  # type: ignore[arg-type]  # Ray's ActorProxy
        placement.remove()
    params = sum(s.nbytes for s in specs) / 2
    console.print(
        table(
            rounds,
            f"{params / 1e6:.0f}M bf16 parameters, {t} FSDP trainers -> {e} engines x TP{tp}, median of {cfg.repeat}",
        )
    )
    return rounds


def table(rounds: dict[str, list[RoundStats]], title: str) -> Table:
    out = Table(title=title)
    for column in ("mode", "max sent/trainer", "recv/worker", "wire total", "seconds", "GB/s into a worker"):
        out.add_column(column, justify="right")
    for mode, stats in rounds.items():
        mid = sorted(stats, key=lambda s: s.seconds)[len(stats) // 2]
        out.add_row(
            mode,
            f"{mid.busiest_sender_bytes / 1e6:.2f} MB",
            f"{mid.worker_received_bytes / 1e6:.2f} MB",
            f"{mid.total_bytes / 1e6:.2f} MB",
            f"{statistics.median(s.seconds for s in stats):.3f}",
            f"{mid.gbps:.2f}",
        )
    return out


def chart(rounds: dict[str, list[RoundStats]], path: str) -> None:
    """Per-round bytes into the busiest worker and seconds, one series per mode, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, stats in rounds.items():
        left.plot([s.worker_received_bytes / 1e6 for s in stats], marker="o", label=mode)
        right.plot([s.seconds for s in stats], marker="o", label=mode)
    left.set(title="MB into the busiest worker", xlabel="round")
    right.set(title="seconds per round", xlabel="round")
    left.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
