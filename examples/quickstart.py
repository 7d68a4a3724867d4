"""Quickstart: FSDP2 trainers push a 66M-parameter transformer into TP workers.

Four trainer actors hold the model sharded FSDP-style (`Shard(0)`, FSDP2 over
their own Gloo group); two engines of two tensor-parallel workers hold column /
row / vocab-parallel shards. Each round takes a real AdamW step, pushes the
weights with M2N and then with the broadcast baseline, and checks every
worker's shards bit-exact against the trainers' weights.

    python examples/quickstart.py                 # local Ray on this machine
    python examples/quickstart.py --address auto  # an existing cluster
"""

from __future__ import annotations

import argparse

import ray
import torch
from rich.console import Console
from rich.table import Table

from actors import InferenceWorker, SyncPlacement, TrainerActor, WeightSync
from rl_sync.sync_config import SyncConfig
from tiny_llama import LlamaShape, build_fsdp_trainer, free_port, local_shards, tp_destinations, tp_layout, train_step, worker_shards

TRAINERS, ENGINES, TP = 4, 2, 2


def full_weights(trainers) -> dict[str, torch.Tensor]:
    """Whole parameters from the trainers' FSDP shards (dim-0 concatenation)."""
    shards = ray.get([t.call.remote(local_shards) for t in trainers])
    return {name: torch.cat([s[name] for s in shards]) for name in shards[0]}


def check_workers(workers, full: dict[str, torch.Tensor]) -> None:
    for rank, shards in enumerate(ray.get([w.call.remote(worker_shards) for w in workers])):
        for name, value in shards.items():
            box = tp_layout(name, ENGINES, TP).local_box(tuple(full[name].shape), rank)
            want = full[name][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
            if not torch.equal(value, want):
                raise AssertionError(f"worker {rank}: {name} is not bit-exact with the trainers")


def start(shape: LlamaShape, host: str):
    placement = SyncPlacement.create(TRAINERS, ENGINES, TP, cpus=0.25)
    Trainer, Worker = ray.remote(TrainerActor), ray.remote(InferenceWorker)
    trainers = [Trainer.options(**placement.trainer(i)).remote(i, TRAINERS, lambda r, s: {}) for i in range(TRAINERS)]
    init = f"tcp://{host}:{free_port(host)}"
    ray.get([t.call.remote(build_fsdp_trainer, shape, init) for t in trainers])
    workers = [Worker.options(**placement.worker(e, j)).remote(e * TP + j, ENGINES * TP, tp_destinations(shape, ENGINES, TP))
               for e in range(ENGINES) for j in range(TP)]
    return placement, trainers, workers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default=None, help="Ray cluster address (default: start a local Ray)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    local = args.address is None
    ray.init(address=args.address, **({"_node_ip_address": "127.0.0.1"} if local else {}))
    host = "127.0.0.1" if local else ray.util.get_node_ip_address()
    shape = LlamaShape()
    placement, trainers, workers = start(shape, host)
    config = SyncConfig(transport="gloo", bucket_bytes=64 << 20, rendezvous_host=host if local else None,
                        bind_host=host if local else None)
    sync = WeightSync.create(trainers, workers, config)
    params = sum(v.numel() for v in full_weights(trainers).values())
    table = Table(title=f"rl-sync quickstart: {params / 1e6:.1f}M parameters, {TRAINERS} FSDP trainers -> {ENGINES} engines x TP{TP}")
    for column in ("round", "loss", "mode", "max sent/trainer", "recv/worker", "seconds", "GB/s", "exact"):
        table.add_column(column, justify="right")
    for step in range(1, args.rounds + 1):
        loss = ray.get([t.call.remote(train_step, step) for t in trainers])[0]
        full = full_weights(trainers)
        for mode in ("m2n", "broadcast"):
            stats = sync.push(mode=mode)
            check_workers(workers, full)
            table.add_row(str(step), f"{loss:.3f}", mode, f"{stats.busiest_sender_bytes / 1e6:.1f} MB",
                          f"{stats.worker_received_bytes / 1e6:.1f} MB", f"{stats.seconds:.2f}", f"{stats.gbps:.2f}", "yes")
    Console().print(table)
    sync.close()
    placement.remove()


if __name__ == "__main__":
    main()
