"""Two GPUs over NCCL: raw point-to-point rate, M2N sync, and the broadcast baseline.

A trainer actor on one GPU pushes a 16 GB bf16 model with Llama-3-8B tensor
shapes to a worker actor on the other. In the same run: (a) the raw CuPy NCCL
send/recv rate between the two GPUs (4 GiB messages), (b) rl-sync M2N with each
digest asked for (`--integrity`), (c) the broadcast baseline (gather on trainer
0, broadcast in packed buckets). NVLink
multicast stays off (NCCL_NVLS_ENABLE=0).

    NCCL_NVLS_ENABLE=0 python benchmarks/nccl_bench.py [--repeat 5] [--integrity off,checksum,keyed]
"""

from __future__ import annotations

import argparse
import os
import statistics

import ray
import torch
from gpu_common import median_round, pair, show, specs_8b, start_ray

from actors import WeightSync
from rl_sync.config.sync import SyncConfig
from rl_sync.engine.runner import deadline_in


def _open(actor, rank: int, uid, nbytes: int) -> None:
    from rl_sync.transport.nccl import NcclTransport

    actor.state["p2p"] = NcclTransport(rank, 2, uid, torch.device("cuda", 0))
    actor.state["buf"] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")


def _move(actor, rank: int) -> float:
    t, buf = actor.state["p2p"], actor.state["buf"]
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    pending = t.post([(1, buf)], []) if rank == 0 else t.post([], [(0, buf)])
    pending.wait(deadline_in(60))
    end.record()
    t.finish(deadline_in(60))
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def raw_p2p(trainer, worker, nbytes: int, repeat: int) -> float:
    from rl_sync.transport.nccl import new_unique_id

    uid = ray.get(trainer.call.remote(lambda self: new_unique_id()))
    ray.get([trainer.call.remote(_open, 0, uid, nbytes), worker.call.remote(_open, 1, uid, nbytes)])
    times = []
    for _ in range(repeat + 1):
        times.append(max(ray.get([trainer.call.remote(_move, 0), worker.call.remote(_move, 1)])))
    ray.get([a.call.remote(lambda self: self.state.pop("p2p").close()) for a in (trainer, worker)])
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--integrity", default="off,keyed", help="comma-separated SyncConfig.integrity values to run")
    args = parser.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    start_ray()
    specs = specs_8b()
    pg, trainer, worker = pair(specs, same_gpu=False)
    raw_bytes = 4 << 30
    raw_s = raw_p2p(trainer, worker, raw_bytes, args.repeat)
    raw_rate = raw_bytes / raw_s
    results = {}
    for integrity in args.integrity.split(","):
        config = SyncConfig(
            transport="nccl",
            colocate="off",
            bucket_bytes=1 << 30,
            rendezvous_host="127.0.0.1",
            bind_host="127.0.0.1",
            round_timeout_s=600,
            integrity=integrity,
        )
        sync = WeightSync.create([trainer], [worker], config)
        sync.push()
        results[f"rl-sync M2N, integrity={integrity}"] = median_round(sync, args.repeat, mode="m2n")
        if integrity == "off":
            results["broadcast baseline"] = median_round(sync, args.repeat, mode="broadcast")
        sync.close()
    ray.util.remove_placement_group(pg)
    rows = [
        [
            "raw NCCL send/recv (4 GiB)",
            f"{raw_bytes / 1e9:.2f}",
            f"{raw_s * 1e3:.1f}",
            "-",
            f"{raw_rate / 1e9:.0f}",
            "1.00",
        ]
    ]
    for label, r in results.items():
        rate = r["bytes"] / r["rank_s"]
        rows.append(
            [
                label,
                f"{r['bytes'] / 1e9:.2f}",
                f"{r['rank_s'] * 1e3:.1f}",
                f"{r['round_s'] * 1e3:.1f}",
                f"{rate / 1e9:.0f}",
                f"{rate / raw_rate:.2f}",
            ]
        )
    m2n, bcast = next(iter(results.values())), results.get("broadcast baseline")
    ratio = f"; broadcast / M2N time: {bcast['rank_s'] / m2n['rank_s']:.2f}x" if bcast else ""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "GPU"
    show(
        f"NCCL between two {gpu}s: 16 GB bf16, 8B shapes (median of {args.repeat}){ratio}",
        ["case", "GB into the worker", "transfer ms", "round ms (with Ray RPC)", "GB/s per receiving GPU", "x raw p2p"],
        rows,
        "nccl_bench",
        {"raw_s": raw_s, "raw_bytes": raw_bytes, **results},
    )


if __name__ == "__main__":
    main()
