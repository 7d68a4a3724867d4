"""Colocated sync on one GPU: CUDA IPC handover against the copy floor and a naive baseline.

One trainer actor and one worker actor share the GPU (0.5 GPU each). Three
models of ~16 GB bf16: Llama-3-8B shapes (291 tensors) and the same bytes in
30,000 small tensors. For each: rl-sync's colocated push (segment IPC handles
mapped once, batched copies), against the device-to-device copy rate measured
in the same run and a naive per-tensor baseline (every round: one IPC handle
per tensor, rebuilt and copied one by one on the worker, as frameworks that
share tensors with `torch.multiprocessing` do). "round / handover" is the whole
push (driver -> coordinator -> actors, the ranks' per-round checks of what
moved included) over the trainer's handover alone. `--allocators classic,expandable`
runs every case once per PyTorch allocator setting of the actors (expandable:
`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`, exported as VMM mappings).
`--profile` then runs `repeat` more rounds of each case with timers around the
parts of a round inside the actors (`round_profile.py`) and prints, per actor,
each part's time and the round's timeline (the gaps being Ray calls, the
coordinator and the driver).

    python benchmarks/gpu_bench.py [--repeat 5] [--allocators classic,expandable] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import ray
import round_profile
import torch
from gpu_common import median_round, pair, show, specs_8b, specs_small, start_ray
from torch.multiprocessing.reductions import reduce_tensor

from actors import WeightSync
from rl_sync.config.sync import SyncConfig
from rl_sync.rank import native


def copy_floor(nbytes: int, repeat: int) -> float:
    """Seconds of one device-to-device copy of `nbytes` (median)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeat + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


def _share(actor) -> list:
    torch.cuda.synchronize()
    return [(name, reduce_tensor(s.local)) for name, s in actor.held.items()]


def _rebuild_and_copy(actor, handles) -> None:
    for name, (rebuild, args) in handles:
        actor.held[name].local.copy_(rebuild(*args))
    torch.cuda.synchronize()


def naive_round(trainer, worker) -> float:
    start = time.perf_counter()
    ray.get(worker.call.remote(_rebuild_and_copy, trainer.call.remote(_share)))
    return time.perf_counter() - start


ALLOCATORS = {"classic": {}, "expandable": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}


def bench(specs, repeat: int, allocator: str, profile: str | None = None) -> dict:
    pg, trainer, worker = pair(specs, same_gpu=True, env=ALLOCATORS[allocator])
    sync = WeightSync.create(
        [trainer],
        [worker],
        SyncConfig(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", bucket_bytes=1 << 30, round_timeout_s=600),
    )
    assert sync.summary.cuda_ipc, "expected colocated CUDA IPC"
    sync.push()
    result = median_round(sync, repeat)
    if profile is not None:
        rounds = round_profile.profiled_rounds(sync, {"trainer": trainer, "worker": worker}, repeat)
        round_profile.report(rounds, profile)
    naive_round(trainer, worker)
    result["naive_s"] = statistics.median(naive_round(trainer, worker) for _ in range(repeat))
    result["tensors"] = len(specs)
    sync.close()
    for actor in (trainer, worker):
        ray.kill(actor)
    ray.util.remove_placement_group(pg)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--allocators", default="classic", help="comma-separated: classic, expandable")
    parser.add_argument("--profile", action="store_true", help="time the parts of a round inside the actors")
    args = parser.parse_args()
    watch = "C scan" if native.scan() else "Python pass (the log says why)"
    print(f"torch {torch.__version__}; the ranks' watch: {watch}")
    start_ray()
    ray.cloudpickle.register_pickle_by_value(round_profile)
    big = specs_8b()
    total = sum(s.nbytes for s in big)
    floor = copy_floor(total, args.repeat)
    results = {
        f"{label}, {alloc}": bench(specs, args.repeat, alloc, f"{label}, {alloc}" if args.profile else None)
        for alloc in args.allocators.split(",")
        for label, specs in (("8B shapes", big), ("30k small", specs_small(total, 30000)))
    }
    rows = [
        [
            "device-to-device copy (floor)",
            "1",
            f"{total / 1e9:.2f}",
            f"{floor * 1e3:.1f}",
            "-",
            "-",
            f"{total / floor / 1e9:.0f}",
            "1.00",
            "-",
        ]
    ]
    for label, r in results.items():
        rows.append(
            [
                f"rl-sync colocated, {label}",
                f"{r['tensors']:,}",
                f"{r['bytes'] / 1e9:.2f}",
                f"{r['rank_s'] * 1e3:.1f}",
                f"{r['round_s'] * 1e3:.1f}",
                f"{r['round_s'] / r['rank_s']:.2f}",
                f"{r['bytes'] / r['rank_s'] / 1e9:.0f}",
                f"{r['rank_s'] / floor:.2f}",
                f"{r['naive_s'] * 1e3:.1f}",
            ]
        )
    show(
        f"Colocated CUDA-IPC sync on {torch.cuda.get_device_name()} (median of {args.repeat})",
        [
            "case",
            "tensors",
            "GB",
            "handover ms",
            "round ms (with Ray RPC)",
            "round / handover",
            "GB/s",
            "x copy floor",
            "naive per-tensor ms",
        ],
        rows,
        "gpu_bench",
        {"floor_s": floor, "bytes": total, **results},
    )


if __name__ == "__main__":
    main()
