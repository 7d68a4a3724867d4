"""The quickstart demo: FSDP2 trainers push a real `transformers` model into TP engines.

Trainer actors hold a Llama-shaped model (about 66M parameters by default)
sharded with FSDP2 over their own Gloo group; engine workers hold the
inference model (`rl_sync.models.TPModel`: fused qkv and gate_up, column/row
parallel linears, padded vocab-parallel embedding and head) as engines x TP.
Each round takes a real AdamW step, pushes the weights with M2N and with the
broadcast baseline, checks every bound tensor bit-exact against the trainers
and the engines' logits against the trainer model's. `rl-sync demo` and
`examples/quickstart.py` run it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import ray
import torch
from rich.console import Console
from rich.table import Table

from rl_sync.bind.rules import Rule
from rl_sync.config.sync import SyncConfig
from rl_sync.models.config import Parallel

from .cluster import free_init_url
from .models import EngineWorker, HFTrainer, hf_config
from .placement import SyncPlacement
from .weight_sync import WeightSync


@dataclass(frozen=True, kw_only=True)
class DemoModel:
    """A Llama-family config for `transformers` (random init, no download)."""

    model_type: str = "llama"
    """Family: llama, qwen2, qwen3, qwen3_moe or mixtral."""
    vocab_size: int = 32000
    hidden_size: int = 512
    intermediate_size: int = 2048
    num_hidden_layers: int = 8
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 256


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """What `rl-sync demo` runs."""

    model: DemoModel = field(default_factory=DemoModel)
    trainers: int = 4
    """FSDP trainer ranks."""
    engines: int = 2
    """Inference engine replicas."""
    tensor_parallel: int = 2
    """Ranks per engine."""
    rounds: int = 3
    """Training steps, each followed by an M2N and a broadcast push."""
    cpus_per_actor: float = 0.25
    rules: tuple[Rule, ...] = ()
    """Extra binding rules, tried before the built-in ones (see `rl_sync.bind.rules`)."""
    sync: SyncConfig = field(default_factory=lambda: SyncConfig(transport="gloo", bucket_bytes=64 << 20))


def _bound(actor) -> dict:
    return {name: (e.origin, e.tensor.detach().clone()) for name, e in actor._rl_sync_endpoints("worker").items()}


def check_bit_exact(trainers, workers) -> int:
    """Compare every bound tensor of every worker with the trainers' full weights; bytes checked."""
    full = ray.get([t.full_state.remote() for t in trainers])[0]
    checked = 0
    for rank, bound in enumerate(ray.get([w.call.remote(_bound) for w in workers])):
        for name, (origin, value) in bound.items():
            want = full[name][tuple(slice(o, o + s) for o, s in zip(origin, value.shape))]
            if not torch.equal(value, want):
                raise AssertionError(f"worker {rank}: {name} is not bit-exact with the trainers")
            checked += value.numel() * value.element_size()
    return checked


def logits_gap(trainers, workers, par: Parallel, vocab: int) -> float:
    """Largest |engine logits - trainer logits| over a random batch, every engine."""
    tokens = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(0))
    reference = ray.get([t.logits.remote(tokens) for t in trainers])[0]
    gap = 0.0
    for e in range(par.engines):
        x = tokens
        for s in range(par.pp):
            x = ray.get([workers[par.rank(e, s, t)].forward.remote(x) for t in range(par.tp)])[0]
        gap = max(gap, float((x - reference).abs().max()))
    return gap


def start(cfg: DemoConfig, host: str):
    """Placement groups, trainer and engine actors; returns (placement, trainers, workers, parallel)."""
    par = Parallel(engines=cfg.engines, tp=cfg.tensor_parallel)
    placement = SyncPlacement.create(cfg.trainers, cfg.engines, cfg.tensor_parallel, cpus=cfg.cpus_per_actor)
    model = hf_config(dataclasses.asdict(cfg.model)).to_dict()
    train_url, infer_url = free_init_url(host), free_init_url(host)
    Trainer, Worker = ray.remote(HFTrainer), ray.remote(EngineWorker)
    trainers = [
        Trainer.options(**placement.trainer(i)).remote(i, cfg.trainers, model, train_url) for i in range(cfg.trainers)
    ]
    workers = [
        Worker.options(**placement.worker(e, t)).remote(par.rank(e, 0, t), par, model, infer_url, rules=cfg.rules)
        for e in range(cfg.engines)
        for t in range(cfg.tensor_parallel)
    ]
    return placement, trainers, workers, par


def run(cfg: DemoConfig, console: Console | None = None) -> list[dict]:
    """Run the demo on the connected Ray cluster; returns one record per push."""
    console = console or Console(width=120)
    host = cfg.sync.rendezvous_host or ray.util.get_node_ip_address()
    placement, trainers, workers, par = start(cfg, host)
    records = []
    try:
        sync = WeightSync.create(trainers, workers, cfg.sync)
        tokens = torch.randint(0, cfg.model.vocab_size, (4, 33), generator=torch.Generator().manual_seed(1))
        for step in range(1, cfg.rounds + 1):
            loss = ray.get([t.train_step.remote(tokens) for t in trainers])[0]
            for mode in ("m2n", "broadcast"):
                stats = sync.push(mode=mode)
                checked = check_bit_exact(trainers, workers)
                records.append(dict(round=step, loss=loss, mode=mode, stats=stats, checked=checked))
        gap = logits_gap(trainers, workers, par, cfg.model.vocab_size)
        console.print(_table(cfg, records, gap))
        sync.close()
    finally:
        for actor in trainers + workers:
            ray.kill(actor)
        placement.remove()
    return records


def _table(cfg: DemoConfig, records: list[dict], gap: float) -> Table:
    table = Table(
        title=f"rl-sync demo: {cfg.trainers} FSDP2 trainers -> {cfg.engines} engines x TP{cfg.tensor_parallel} "
        f"({cfg.model.model_type}); engine logits within {gap:.1e} of the trainer's"
    )
    for column in ("round", "loss", "mode", "max sent/trainer", "recv/worker", "seconds", "GB/s", "bit-exact"):
        table.add_column(column, justify="right")
    for r in records:
        s = r["stats"]
        table.add_row(
            str(r["round"]),
            f"{r['loss']:.3f}",
            r["mode"],
            f"{s.busiest_sender_bytes / 1e6:.1f} MB",
            f"{s.worker_received_bytes / 1e6:.1f} MB",
            f"{s.seconds:.2f}",
            f"{s.gbps:.2f}",
            f"yes ({r['checked'] / 1e6:.0f} MB)",
        )
    return table
