"""CPU benchmark: M2N against broadcast on a ~100M-parameter model over Gloo.

Four trainer actors (FSDP `Shard(0)`) push a dense Llama-shaped bf16 model to
two engines of TP2, `--repeat` rounds of each mode in one run; prints bytes and
seconds side by side (median round).

    python benchmarks/cpu_bench.py [--repeat 5] [--bucket-mb 64]
"""

from __future__ import annotations

import argparse
import statistics

import ray
from rich.console import Console
from rich.table import Table

from actors import InferenceWorker, SyncPlacement, TrainerActor, WeightSync
from actors.synthetic import trainer_build, worker_build
from rl_sync.sync_config import SyncConfig
from rl_sync.synthetic import InferenceParallel, ModelShape, TrainerParallel, model_specs

SHAPE = ModelShape(layers=8, hidden=768, intermediate=2048, vocab=32000, heads=12, kv_heads=12, head_dim=64)


def run(repeat: int, bucket_mb: int) -> Table:
    trainers_n, engines, tp = 4, 2, 2
    specs = model_specs(SHAPE, TrainerParallel(ranks=trainers_n), InferenceParallel(engines=engines, tensor_parallel=tp))
    placement = SyncPlacement.create(trainers_n, engines, tp, cpus=0.25)
    Trainer, Worker = ray.remote(TrainerActor), ray.remote(InferenceWorker)
    trainers = [Trainer.options(**placement.trainer(i)).remote(i, trainers_n, trainer_build(specs)) for i in range(trainers_n)]
    workers = [Worker.options(**placement.worker(e, j)).remote(e * tp + j, engines * tp, worker_build(specs, trainers_n))
               for e in range(engines) for j in range(tp)]
    config = SyncConfig(transport="gloo", bucket_bytes=bucket_mb << 20, rendezvous_host="127.0.0.1", bind_host="127.0.0.1")
    sync = WeightSync.create(trainers, workers, config)
    params = sum(s.nbytes for s in specs) / 2
    table = Table(title=f"CPU / Gloo: {params / 1e6:.0f}M bf16 parameters, 4 FSDP trainers -> 2 engines x TP2, "
                        f"median of {repeat} rounds")
    for column in ("mode", "max sent/trainer", "recv/worker", "wire total", "seconds", "GB/s into a worker"):
        table.add_column(column, justify="right")
    for mode in ("m2n", "broadcast"):
        rounds = [sync.push(mode=mode) for _ in range(repeat)]
        mid = sorted(rounds, key=lambda r: r.seconds)[len(rounds) // 2]
        table.add_row(mode, f"{mid.busiest_sender_bytes / 1e6:.1f} MB", f"{mid.worker_received_bytes / 1e6:.1f} MB",
                      f"{mid.total_bytes / 1e6:.1f} MB", f"{statistics.median(r.seconds for r in rounds):.3f}",
                      f"{mid.gbps:.2f}")
    sync.close()
    placement.remove()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    args = parser.parse_args()
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    Console().print(run(args.repeat, args.bucket_mb))


if __name__ == "__main__":
    main()
