"""The link-model simulator against measured rounds: CPU, Gloo over loopback, Ray actors.

For each configuration, `repeat` M2N rounds run on a synthetic model (`rl-sync bench`'s
actors) and their median is set beside `rl_sync.planning.simulate.predict` for the same schedule under
`--links` (default `configs/links_cpu_loopback.yaml`), with the relative error.

    python benchmarks/simulate_bench.py [--links LINKS.yaml] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from actors.bench import BenchConfig, run
from actors.cluster import connect
from rl_sync.config.load import load_config
from rl_sync.models.config import ModelConfig, Parallel
from rl_sync.models.synthetic import TrainerParallel, model_specs
from rl_sync.planning.plan import plan_model
from rl_sync.planning.schedule import build_schedule
from rl_sync.planning.simulate import LinkModel, predict

SMALL = ModelConfig(
    family="llama", layers=4, hidden=512, intermediate=1536, vocab=32000, heads=8, kv_heads=8, head_dim=64
)
LARGE = ModelConfig(
    family="llama", layers=8, hidden=768, intermediate=2048, vocab=32000, heads=12, kv_heads=12, head_dim=64
)
CONFIGS = [  # (name, model, trainers, engines, tp)
    ("46M, 2 -> 1 x TP2", SMALL, 2, 1, 2),
    ("46M, 2 -> 2 x TP1", SMALL, 2, 2, 1),
    ("106M, 4 -> 2 x TP2", LARGE, 4, 2, 2),
    ("106M, 4 -> 1 x TP4", LARGE, 4, 1, 4),
    ("106M, 2 -> 4 x TP1", LARGE, 2, 4, 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--links", default="configs/links_cpu_loopback.yaml")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    links = load_config(args.links, LinkModel, ())
    console = Console(width=140)
    out = Table(title=f"predicted ({args.links}) against measured M2N rounds, median of {args.repeat}")
    for column in ("configuration", "MB into the busiest worker", "measured s", "predicted s", "error", "bottleneck"):
        out.add_column(column, justify="right")
    connect(None)
    for name, model, t, e, tp in CONFIGS:
        cfg = BenchConfig(
            model=model,
            trainer=TrainerParallel(ranks=t),
            inference=Parallel(engines=e, tp=tp),
            modes=("m2n",),
            repeat=args.repeat,
        )
        specs = model_specs(cfg.model, cfg.trainer, cfg.inference)
        prediction = predict(build_schedule(plan_model(specs), cfg.sync.bucket_bytes), links, t)
        rounds = run(replace(cfg), Console(quiet=True))["m2n"]
        measured = statistics.median(r.seconds for r in rounds)
        out.add_row(
            name,
            f"{rounds[0].worker_received_bytes / 1e6:.1f}",
            f"{measured:.3f}",
            f"{prediction.seconds:.3f}",
            f"{prediction.seconds / measured - 1:+.0%}",
            prediction.bottleneck,
        )
    console.print(out)


if __name__ == "__main__":
    main()
