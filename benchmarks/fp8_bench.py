"""FP8 destinations: the quantizer against the copy floor, and pushes into FP8 engines against bf16.

    python benchmarks/fp8_bench.py --quantize [--device cuda]   # Llama-3-8B shapes (--layers on CPU)
    python benchmarks/fp8_bench.py --colocated                  # one GPU: trainer and worker share it
    python benchmarks/fp8_bench.py --nccl                       # two GPUs: NCCL from trainer to worker
    python benchmarks/fp8_bench.py --e2e                        # CPU: the quickstart model, 4 -> 2 x TP2

`--quantize` times one trainer rank's whole quantize step (block amax, scales, FP8 values) over
every projection of the model, against one device copy of the same bf16 bytes in the same
run. `--colocated` pushes Llama-3-8B shapes through CUDA IPC into a bf16 worker and into an FP8
one, `--nccl` the same over NCCL between two GPUs. `--e2e` runs bf16 FSDP2 trainers into bf16 and into FP8
(128 x 128 blocks) engines.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch
from gpu_common import LLAMA_8B, median_round, pair, show, specs_8b, start_ray

from rl_sync.engine.endpoint import Endpoint
from rl_sync.engine.quantize import QuantStage
from rl_sync.models.config import Parallel
from rl_sync.models.synthetic import TrainerParallel, model_specs
from rl_sync.planning.layout import Layout, Mesh
from rl_sync.planning.plan import SideSpec, join_specs, plan_model
from rl_sync.planning.quant import dest_scale_layout, grid_shape, scale_name
from rl_sync.transport.local import LocalTransport

BLOCK = (128, 128)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device, repeat: int) -> float:
    times = []
    for _ in range(repeat + 1):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def quantize(device: torch.device, layers: int, repeat: int) -> dict:
    shape = dataclasses.replace(LLAMA_8B, layers=layers, fp8_block=BLOCK)
    specs = [s for s in model_specs(shape, TrainerParallel(ranks=1), Parallel()) if s.block]
    src, dst = Layout.replicated(Mesh((1,))), Layout.replicated(Mesh((1,), start_rank=1))
    dests = [
        d
        for s in specs
        for d in (
            SideSpec(s.name, "float8_e4m3fn", s.shape, dst, BLOCK),
            SideSpec(
                scale_name(s.name),
                "float32",
                grid_shape(s.shape, BLOCK),
                dest_scale_layout(dst, s.shape, BLOCK, s.name),
            ),
        )
    ]
    plan = plan_model(join_specs([SideSpec(s.name, "bfloat16", s.shape, src) for s in specs], dests))
    sources = {s.name: Endpoint(torch.randn(s.shape, dtype=torch.bfloat16, device=device), (0, 0)) for s in specs}
    stage = QuantStage(plan, plan.blocks, 0)
    stage.endpoints(sources)
    transport = LocalTransport(device)
    nbytes = sum(e.tensor.numel() * 2 for e in sources.values())
    seconds = _timed(lambda: stage.run(sources, transport, time.monotonic() + 600, None), device, repeat)
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    other = torch.empty_like(flat)
    floor = _timed(lambda: other.copy_(flat), device, repeat)
    return {"tensors": len(specs), "bf16_bytes": nbytes, "quantize_s": seconds, "copy_s": floor}


def pushes(repeat: int, same_gpu: bool) -> dict:
    import ray

    from actors import WeightSync
    from rl_sync.config.sync import SyncConfig

    out = {}
    for label, block in (("bf16", None), ("fp8", BLOCK)):
        pg, trainer, worker = pair(specs_8b(block), same_gpu=same_gpu)
        sync = WeightSync.create(
            [trainer],
            [worker],
            SyncConfig(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", bucket_bytes=1 << 30, round_timeout_s=600),
        )
        assert sync.summary.cuda_ipc == same_gpu, "expected CUDA IPC exactly when the GPU is shared"
        sync.push()
        out[label] = median_round(sync, repeat)
        sync.close()
        for actor in (trainer, worker):
            ray.kill(actor)
        ray.util.remove_placement_group(pg)
    return out


def e2e(rounds: int) -> dict:
    import ray
    import yaml

    from actors import WeightSync
    from actors.cluster import free_init_url
    from actors.models import EngineWorker, HFTrainer
    from rl_sync.config.sync import SyncConfig
    from rl_sync.models.config import Parallel

    model = yaml.safe_load(Path(__file__).resolve().parents[1].joinpath("configs", "demo.yaml").read_text())["model"]
    par, out = Parallel(engines=2, tp=2), {}
    Trainer, Worker = ray.remote(num_cpus=0.1)(HFTrainer), ray.remote(num_cpus=0.1)(EngineWorker)
    for label, block in (("bf16", None), ("fp8", BLOCK)):
        url, wurl = free_init_url("127.0.0.1"), free_init_url("127.0.0.1")
        trainers = [Trainer.remote(i, 4, model, url, 0, 0.1, "bfloat16") for i in range(4)]
        workers = [Worker.remote(r, par, model, wurl, (), None, block, "bfloat16") for r in range(par.size)]
        sync = WeightSync.create(
            trainers,
            workers,
            SyncConfig(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", bucket_bytes=64 << 20, round_timeout_s=600),
        )
        sync.push()
        pushes = [sync.push() for _ in range(rounds)]
        out[label] = {
            "round_s": statistics.median(p.seconds for p in pushes),
            "worker_bytes": pushes[0].worker_received_bytes,
        }
        sync.close()
        for actor in trainers + workers:
            ray.kill(actor)  # type: ignore[arg-type]  # Ray's ActorProxy
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantize", action="store_true")
    parser.add_argument("--colocated", action="store_true")
    parser.add_argument("--nccl", action="store_true", help="trainer and worker on two GPUs (NCCL)")
    parser.add_argument("--e2e", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=LLAMA_8B.layers)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.quantize:
        r = quantize(torch.device(args.device), args.layers, args.repeat)
        gb = r["bf16_bytes"] / 1e9
        show(
            f"FP8 block quantization on {args.device} ({r['tensors']} projections, median of {args.repeat})",
            ["case", "bf16 GB", "ms", "bf16 GB/s", "x copy"],
            [
                [
                    "device copy of the bf16 bytes (floor)",
                    f"{gb:.2f}",
                    f"{r['copy_s'] * 1e3:.1f}",
                    f"{gb / r['copy_s']:.0f}",
                    "1.00",
                ],
                [
                    "quantize (amax, scales, FP8 values)",
                    f"{gb:.2f}",
                    f"{r['quantize_s'] * 1e3:.1f}",
                    f"{gb / r['quantize_s']:.0f}",
                    f"{r['quantize_s'] / r['copy_s']:.2f}",
                ],
            ],
            "fp8_quantize",
            r,
        )
    if args.colocated or args.nccl or args.e2e:
        start_ray()
    for wanted, same_gpu, label in ((args.colocated, True, "colocated"), (args.nccl, False, "nccl")):
        if wanted:
            r = pushes(args.repeat, same_gpu)
            show(
                f"{label} push, Llama-3-8B shapes, on {torch.cuda.get_device_name()} (median of {args.repeat})",
                ["worker", "GB into the worker", "slowest rank ms", "round ms (with Ray RPC)"],
                [
                    [k, f"{v['bytes'] / 1e9:.2f}", f"{v['rank_s'] * 1e3:.1f}", f"{v['round_s'] * 1e3:.1f}"]
                    for k, v in r.items()
                ],
                f"fp8_{label}",
                r,
            )
    if args.e2e:
        r = e2e(args.rounds)
        show(
            f"Quickstart model, 4 bf16 FSDP2 trainers -> 2 engines x TP2 (median of {args.rounds})",
            ["engine", "MB into the workers", "round s"],
            [[k, f"{v['worker_bytes'] / 1e6:.1f}", f"{v['round_s']:.3f}"] for k, v in r.items()],
            "fp8_e2e",
            r,
        )


if __name__ == "__main__":
    main()
