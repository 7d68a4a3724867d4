"""Sparse against dense: wire bytes and seconds at densities from 0.1% to 100%.

`--e2e` (CPU, Gloo, Ray actors): 2 FSDP trainers push a ~50M-parameter bf16
model to one engine of TP2; for each density, exactly that fraction of every
tensor changes, then one sparse round and one dense round run (`--repeat`
times); the table shows wire bytes, seconds and the encoding mix, and what an
`auto` round chose next, with its reason (it learns from every round before).
`--codec` (any device): diff + encode + baseline update, then validate +
decode + apply, for 1 GiB of bf16 parameters at each density as one bucket,
against a device-to-device copy of the same bytes measured in the same run
(CUDA takes the fused codec: Triton kernels, with `diff` and the busy `compact` and
`expand` in CUDA where CuPy is installed, unless `RL_SYNC_SPARSE_KERNELS=triton`;
`--reference` also times the torch codec).
On a GPU it also gives the device's own time for both (its kernels and copies,
by the torch profiler): the rest of the wall time is host work and waiting.
`--phases` adds the wall time of each step of both sides, with no
synchronization inside the round: where the host spends it, and which steps
wait for the device (the sender's counts, the receiver's flags, the tail).

    python benchmarks/sparse_bench.py --e2e
    python benchmarks/sparse_bench.py --codec --device cuda --reference
    python benchmarks/sparse_bench.py --codec --device cuda --phases
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from rl_sync.engine import sparse_codec, sparse_cuda
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, NAMES, choose, encoded_nbytes

DENSITIES = (0.001, 0.01, 0.1, 0.3, 0.5, 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WARM_UP = 2
"""Untimed runs first: compiling, and the caches of a bucket's steady state (its geometry, pinned
memory, the allocator's blocks)."""


def _timed(fn, device: torch.device, repeat: int = 3, setup=lambda: None) -> float:
    """Median seconds of `fn()` over `repeat` runs after `WARM_UP` more, `setup()` untimed before each."""
    times = []
    for _ in range(repeat + WARM_UP):
        setup()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[WARM_UP:])


def _steps(fn, device: torch.device, repeat: int, setup) -> dict[str, float]:
    """Median seconds from each of the marks `fn(mark)` makes (`mark(name)` ends step `name`) to the
    next, with no synchronization in between, then to the device being idle (`tail`); over
    `repeat` runs after `WARM_UP` more, `setup()` untimed before each."""
    runs = []
    for _ in range(repeat + WARM_UP):
        setup()
        _sync(device)
        marks = [("", time.perf_counter())]
        fn(lambda name: marks.append((name, time.perf_counter())))
        _sync(device)
        marks.append(("tail", time.perf_counter()))
        runs.append({name: at - marks[i][1] for i, (name, at) in enumerate(marks[1:])})
    return {name: statistics.median(run[name] for run in runs[WARM_UP:]) for name in runs[-1]}


def _no_mark(name: str) -> None:
    """The step marks of a plain timed run: none."""


def _device_seconds(runs, device: torch.device) -> float | None:
    """Seconds the device spends in the kernels and copies of one `fn()` of each `(fn, setup)` of
    `runs` (after its `setup()`, which is not counted), by the torch profiler; None on a CPU."""
    if device.type != "cuda":
        return None
    seconds = 0.0
    for fn, setup in runs:
        setup()
        _sync(device)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            fn()
            _sync(device)
        seconds += sum(event.device_time_total for event in profile.key_averages()) / 1e6
    return seconds


def codec_tables(
    device: torch.device,
    repeat: int,
    total_bytes: int = 1 << 30,
    tensors: int = 16,
    reference: bool = False,
    phases: bool = False,
) -> list[Table]:
    """Diff + encode + baseline update, then validate + apply, for `total_bytes` of bf16 in
    `tensors` tensors, as one bucket (as a sparse round does); `reference` forces the torch codec;
    `phases` adds a table of each step's wall time (`_steps`)."""
    if reference:
        sparse_codec._on_kernel_device = lambda t: False
    n = total_bytes // 2 // tensors
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(n, generator=gen, device=device).to(torch.bfloat16) for _ in range(tensors)]
    live, baseline = [b.clone() for b in base], [b.clone() for b in base]
    copy_s = _timed(lambda: [l.copy_(b) for l, b in zip(live, base)], device, repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    kind = "torch"
    if device.type == "cuda" and not reference:
        cuda = "fused: Triton, with diff, the busy launches and the receiver's checks in CUDA"
        kind = cuda if sparse_cuda.usable(device) else "fused: Triton"
    table = Table(
        title=f"sparse codec ({kind}) on {name}: "
        f"{total_bytes / 2**30:.0f} GiB bf16 in {tensors} tensors; copy {copy_s * 1e3:.2f} ms "
        f"({total_bytes / copy_s / 1e9:.0f} GB/s)"
    )
    columns = ("density", "encoding", "wire / dense", "diff+encode ms", "decode+apply ms", "total / copy")
    for column in (*columns, "device ms", "device / copy"):
        table.add_column(column, justify="right")
    steps = Table(title=f"{table.title}: µs of each step, no synchronization inside the round")
    boxes = [(i, (0,), (n,)) for i in range(tensors)]
    for density in DENSITIES:
        cur = []
        for b in base:
            c = b.clone()
            idx = torch.randperm(n, generator=gen, device=device)[: int(n * density)]
            c[idx] = (c[idx].float() + 1.0).to(torch.bfloat16)
            cur.append(c)
        ks = [int(sparse_codec.changed(c, b).sum()) for c, b in zip(cur, base)]
        codes = [choose(n, k, 2, allow_dense=True) for k in ks]
        blocks = [
            torch.empty(encoded_nbytes(code, n, k, 2), dtype=torch.uint8, device=device) for code, k in zip(codes, ks)
        ]

        def encode_all(mark=_no_mark):  # as a sparse round does: the changes, the encodings, the baselines
            found = sparse_codec.BucketChanges(list(zip(cur, baseline)), boxes)
            mark("find (waits: counts)")
            for i, (code, blk) in enumerate(zip(codes, blocks)):
                found.encode(i, code, blk)
            mark(f"{tensors} encode")
            found.finish()
            mark("finish")

        def apply_all(mark=_no_mark):  # validate and write every box (one host sync, after the writes)
            received = sparse_codec.BucketReceiver(device, tensors)
            for slot, (blk, code, k, l) in enumerate(zip(blocks, codes, ks, live)):
                received.add(slot, code, k, n, torch.bfloat16, blk, l)
            mark(f"{tensors} add")
            received.prepare()  # (a round adds and prepares while the payloads travel)
            mark("prepare")
            assert not received.commit()
            mark("commit (waits: flags)")

        def reset(targets):
            return lambda: [t.copy_(b) for t, b in zip(targets, base)]

        encode_s = _timed(encode_all, device, repeat, setup=reset(baseline))
        apply_s = _timed(apply_all, device, repeat, setup=reset(live))
        assert all(torch.equal(t.view(torch.int16), c.view(torch.int16)) for t, c in zip(live + baseline, cur + cur))
        device_s = _device_seconds([(encode_all, reset(baseline)), (apply_all, reset(live))], device)
        wire = sum(b.numel() for b in blocks)
        table.add_row(
            f"{density:.1%}",
            NAMES[codes[0]],
            f"{wire / total_bytes:.2%}",
            f"{encode_s * 1e3:.2f}",
            f"{apply_s * 1e3:.2f}",
            f"{(encode_s + apply_s) / copy_s:.1f}x",
            "-" if device_s is None else f"{device_s * 1e3:.2f}",
            "-" if device_s is None else f"{device_s / copy_s:.1f}x",
        )
        if phases:
            sides = [("send", encode_all, reset(baseline)), ("receive", apply_all, reset(live))]
            times = {
                f"{side}: {name}": t
                for side, fn, setup in sides
                for name, t in _steps(fn, device, repeat, setup).items()
            }
            if not steps.columns:
                for column in ("density", *times):
                    steps.add_column(column, justify="right")
            steps.add_row(f"{density:.1%}", *(f"{t * 1e6:.0f}" for t in times.values()))
    return [table, steps] if phases else [table]


def e2e_table(repeat: int) -> Table:
    import ray

    from actors import WeightSync
    from actors.ready import InferenceWorker, TrainerActor
    from actors.synthetic_actors import trainer_build, worker_build
    from rl_sync.config.sync import SyncConfig
    from rl_sync.models.config import ModelConfig, Parallel
    from rl_sync.models.synthetic import TrainerParallel, model_specs

    shape = ModelConfig(
        family="llama", layers=4, hidden=512, intermediate=1536, vocab=32000, heads=8, kv_heads=8, head_dim=64
    )
    specs = model_specs(shape, TrainerParallel(ranks=2), Parallel(tp=2))
    ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    Trainer, Worker = ray.remote(num_cpus=0.25)(TrainerActor), ray.remote(num_cpus=0.25)(InferenceWorker)
    trainers = [Trainer.remote(i, 2, trainer_build(specs)) for i in range(2)]
    workers = [Worker.remote(j, 2, worker_build(specs, 2)) for j in range(2)]
    sync = WeightSync.create(
        trainers,
        workers,
        SyncConfig(transport="gloo", rendezvous_host="127.0.0.1", bind_host="127.0.0.1", bucket_bytes=64 << 20),
    )
    sync.push(mode="auto")
    params = sum(s.nbytes for s in specs) / 2
    table = Table(
        title=f"CPU / Gloo, {params / 1e6:.0f}M bf16 parameters, 2 FSDP trainers -> TP2: sparse vs dense, and "
        f"auto's choice"
    )
    for column in (
        "density",
        "transfers indices/blocked/bitmap/dense",
        "sparse wire",
        "dense wire",
        "wire ratio",
        "sparse s",
        "dense s",
        "auto ran",
    ):
        table.add_column(column, justify="right")
    reasons = []
    for density in DENSITIES:

        def perturb(actor, d=density):
            gen = torch.Generator().manual_seed(int(d * 1e6))
            for s in actor.held.values():
                flat = s.local.view(-1)
                idx = torch.randperm(flat.numel(), generator=gen)[: int(flat.numel() * d)]
                flat[idx] = (flat[idx].float() + 1.0).to(flat.dtype)

        sparse_s, dense_s, wire, dense_wire, mix = [], [], 0, 0, {}
        for _ in range(repeat):
            ray.get([t.call.remote(perturb) for t in trainers])
            stats = sync.push(mode="sparse")
            sparse_s.append(stats.seconds)
            wire = sum(r.sent_bytes for r in stats.ranks if r.role == "trainer")
            dense_wire, mix = stats.dense_bytes, stats.encodings
            dense_s.append(sync.push(mode="m2n").seconds)
        ray.get([t.call.remote(perturb) for t in trainers])
        auto = sync.push(mode="auto")
        reasons.append(f"{density:.1%}: ran {auto.mode} in {auto.seconds:.3f} s; {auto.reason}")
        counts = "/".join(str(mix.get(NAMES[c], 0)) for c in (INDICES, BLOCKED, BITMAP, DENSE))
        table.add_row(
            f"{density:.1%}",
            counts,
            f"{wire / 1e6:.2f} MB",
            f"{dense_wire / 1e6:.2f} MB",
            f"{wire / dense_wire:.2%}",
            f"{statistics.median(sparse_s):.3f}",
            f"{statistics.median(dense_s):.3f}",
            auto.mode,
        )
    table.caption = "auto, after each density's rounds:\n" + "\n".join(reasons)
    sync.close()
    ray.shutdown()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--e2e", action="store_true", help="end to end over Ray actors and Gloo (CPU)")
    parser.add_argument("--codec", action="store_true", help="codec throughput for 1 GiB on --device")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reference", action="store_true", help="with --codec: time the torch codec too")
    parser.add_argument("--phases", action="store_true", help="with --codec: the wall time of each step")
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per figure (their median)")
    args = parser.parse_args()
    console = Console(width=160)
    if args.codec:
        for table in codec_tables(torch.device(args.device), args.repeat, phases=args.phases):
            console.print(table)
        if args.reference:
            console.print(*codec_tables(torch.device(args.device), args.repeat, reference=True))
    if args.e2e:
        console.print(e2e_table(args.repeat))


if __name__ == "__main__":
    main()
