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
`--against TREE` adds this tree's codec against the `rl_sync` of an older
checkout, in one process on the same buckets, round by round in alternating
order: lent hosts drift by more than most host-side changes gain, so a
comparison across runs or machines says little.

    python benchmarks/sparse_bench.py --e2e
    python benchmarks/sparse_bench.py --codec --device cuda --reference
    python benchmarks/sparse_bench.py --codec --device cuda --phases
    git worktree add /tmp/base HEAD~3
    python benchmarks/sparse_bench.py --codec --device cuda --against /tmp/base
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import importlib
import inspect
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from rl_sync.engine import sparse_codec, sparse_cuda
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, NAMES, choose, encoded_nbytes, message_layout

DENSITIES = (0.001, 0.01, 0.1, 0.3, 0.5, 1.0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WARM_UP = 2
"""Untimed runs first: compiling, and the caches of a bucket's steady state (its geometry, pinned
memory, the allocator's blocks)."""


def _once(fn, device: torch.device, setup=lambda: None) -> float:
    """Seconds of one `fn()`, after an untimed `setup()`, the device idle before and after."""
    setup()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _timed(fn, device: torch.device, repeat: int = 3, setup=lambda: None) -> float:
    """Median seconds of `fn()` over `repeat` runs after `WARM_UP` more, `setup()` untimed before each."""
    return statistics.median([_once(fn, device, setup) for _ in range(repeat + WARM_UP)][WARM_UP:])


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


def _device_times(fn, setup, device: torch.device) -> dict[str, float]:
    """Seconds the device spends in each kernel and copy of one `fn()` (after its `setup()`, which
    is not counted), by name, by the torch profiler."""
    setup()
    _sync(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        fn()
        _sync(device)
    return {_short(event.key): event.device_time_total / 1e6 for event in profile.key_averages()}


def _short(kernel: str) -> str:
    """A kernel's name without its parameter list (`void compact_sparse<unsigned short, 16384, 8>`)."""
    return kernel.split("(")[0].removeprefix("void ")


def _device_seconds(runs, device: torch.device) -> float | None:
    """Seconds the device spends in the kernels and copies of one `fn()` of each `(fn, setup)` of
    `runs` (`_device_times`); None on a CPU."""
    if device.type != "cuda":
        return None
    return sum(sum(_device_times(fn, setup, device).values()) for fn, setup in runs)


@dataclass
class _Bucket:
    """One bucket of `tensors` bf16 boxes of `n` elements at one density: the sources `cur`, the
    baselines and live views (each reset to `base` before a timed run), each box's count,
    encoding and payload buffer."""

    n: int
    base: list[torch.Tensor]
    cur: list[torch.Tensor]
    baseline: list[torch.Tensor]
    live: list[torch.Tensor]
    ks: list[int]
    codes: list[int]
    blocks: list[torch.Tensor]
    """Each box's payload: a slice of `payload`, where the host encodes it."""
    payload: torch.Tensor
    """The bucket's payloads, one after another: the one message a receiver takes."""
    placed: object = None
    """The payloads the last sender placed on the device, when it did (`sparse_fused.Placed`)."""

    def header(self) -> list[int]:
        """(code, count) of each box, as its message's header carries it (a dense box counts every
        element)."""
        return [v for code, k in zip(self.codes, self.ks) for v in (code, self.n if code == DENSE else k)]

    def reset(self, targets: list[torch.Tensor]):
        return lambda: [t.copy_(b) for t, b in zip(targets, self.base)]

    def receiving(self):
        """The receiver's setup: the live views reset, and each payload where the last sender left
        it (as the round's transport delivers it, outside the codec's time)."""
        reset = self.reset(self.live)

        def setup():
            reset()
            if self.placed is not None:
                self.blocks[:] = [self.placed.span(i, i + 1) for i in range(len(self.blocks))]
                self.payload = self.placed.span(0, len(self.blocks))

        return setup


def _bucket(bucket: _Bucket, density: float, gen: torch.Generator) -> _Bucket:
    """`bucket` with exactly `density` of each box's elements changed in its sources."""
    device, n = bucket.base[0].device, bucket.n
    cur = []
    for b in bucket.base:
        c = b.clone()
        idx = torch.randperm(n, generator=gen, device=device)[: int(n * density)]
        c[idx] = (c[idx].float() + 1.0).to(torch.bfloat16)
        cur.append(c)
    ks = [int(sparse_codec.changed(c, b).sum()) for c, b in zip(cur, bucket.base)]
    codes = [choose(n, k, 2, allow_dense=True) for k in ks]
    sizes = [encoded_nbytes(code, n, k, 2) for code, k in zip(codes, ks)]
    payload = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    blocks = list(payload.split(sizes))
    return dataclasses.replace(bucket, cur=cur, ks=ks, codes=codes, blocks=blocks, payload=payload)


def _sides(codec, bucket: _Bucket):
    """(encode_all, apply_all) of `bucket` through the codec module `codec` (`sparse_codec`, or an
    older tree's for `--against`), as a sparse round runs them; each takes `mark(name)`, called
    at the end of each step."""
    tensors, n, device = len(bucket.base), bucket.n, bucket.base[0].device
    boxes = [(i, (0,), (n,)) for i in range(tensors)]

    placing = {"allow_dense": True} if "allow_dense" in inspect.signature(codec.BucketChanges).parameters else {}
    kept = {"kept": codec.KeptTables()} if hasattr(codec, "KeptTables") else {}  # (kept by a round's bucket views)
    header = bucket.header()  # (as a round reads it before it adds the message)

    def encode_all(mark=_no_mark):  # the changes, the encodings, the baselines
        found = codec.BucketChanges(list(zip(bucket.cur, bucket.baseline)), boxes, **placing, **kept)
        mark("find (waits: counts)")
        bucket.placed = getattr(found, "placed", None)  # (encoded on the device already; older trees lack it)
        if bucket.placed is None:
            for i, (code, blk) in enumerate(zip(bucket.codes, bucket.blocks)):
                found.encode(i, code, blk)
        mark(f"{tensors} encode")
        found.finish()
        mark("finish")

    def apply_all(mark=_no_mark):  # validate and write every box (one host sync, after the writes)
        received = codec.BucketReceiver(device, tensors, **kept)
        if hasattr(received, "add_message"):  # (the whole message at once; older trees add box by box)
            layout = message_layout(header, [n] * tensors, [2] * tensors, "the benchmark's message")
            received.add_message(0, layout, [torch.bfloat16] * tensors, bucket.payload, bucket.live)
        else:
            for slot, (blk, code, k, live) in enumerate(zip(bucket.blocks, bucket.codes, bucket.ks, bucket.live)):
                received.add(slot, code, k, n, torch.bfloat16, blk, live)
        mark(f"{tensors} add")
        if hasattr(received, "prepare"):  # (a round adds and prepares while the payloads travel; older trees lack it)
            received.prepare()
        mark("prepare")
        assert not received.commit()
        mark("commit (waits: flags)")

    return encode_all, apply_all


def _empty_bucket(device: torch.device, total_bytes: int, tensors: int) -> tuple[_Bucket, torch.Generator]:
    n = total_bytes // 2 // tensors
    gen = torch.Generator(device=device).manual_seed(0)
    base = [torch.randn(n, generator=gen, device=device).to(torch.bfloat16) for _ in range(tensors)]
    bucket = _Bucket(n, base, [], [b.clone() for b in base], [b.clone() for b in base], [], [], [], torch.empty(0))
    return bucket, gen


def _copy(bucket: _Bucket):
    """A device copy of the bucket's bytes (the yardstick)."""
    return lambda: [live.copy_(b) for live, b in zip(bucket.live, bucket.base)]


def codec_tables(
    device: torch.device,
    repeat: int,
    total_bytes: int = 1 << 30,
    tensors: int = 16,
    reference: bool = False,
    phases: bool = False,
    kernels: bool = False,
    densities: tuple[float, ...] = DENSITIES,
) -> list[Table]:
    """Diff + encode + baseline update, then validate + apply, for `total_bytes` of bf16 in
    `tensors` tensors, as one bucket (as a sparse round does), at each of `densities`; `reference`
    forces the torch codec; `phases` adds a table of each step's wall time (`_steps`), `kernels` one
    of each kernel's device time (`_device_times`, on a GPU)."""
    on_kernel_device = sparse_codec._on_kernel_device
    if reference:
        sparse_codec._on_kernel_device = lambda t: False
    try:
        return _codec_tables(device, repeat, total_bytes, tensors, reference, phases, kernels, densities)
    finally:
        sparse_codec._on_kernel_device = on_kernel_device


def _codec_tables(
    device: torch.device,
    repeat: int,
    total_bytes: int,
    tensors: int,
    reference: bool,
    phases: bool,
    kernels: bool,
    densities: tuple[float, ...],
) -> list[Table]:
    empty, gen = _empty_bucket(device, total_bytes, tensors)
    copy_s = _timed(_copy(empty), device, repeat)
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
    by_kernel = Table(title=f"{table.title}: device µs of each kernel and copy in one round")
    for column in ("density", "side", "kernel or copy", "device µs"):
        by_kernel.add_column(column, justify="right")
    for density in densities:
        bucket = _bucket(empty, density, gen)
        encode_all, apply_all = _sides(sparse_codec, bucket)
        sides = [("send", encode_all, bucket.reset(bucket.baseline)), ("receive", apply_all, bucket.receiving())]
        encode_s, apply_s = (_timed(fn, device, repeat, setup=setup) for _, fn, setup in sides)
        assert all(
            torch.equal(t.view(torch.int16), c.view(torch.int16))
            for t, c in zip(bucket.live + bucket.baseline, bucket.cur + bucket.cur)
        )
        device_s = _device_seconds([(fn, setup) for _, fn, setup in sides], device)
        wire = sum(b.numel() for b in bucket.blocks)
        table.add_row(
            f"{density:.1%}",
            NAMES[bucket.codes[0]],
            f"{wire / total_bytes:.2%}",
            f"{encode_s * 1e3:.2f}",
            f"{apply_s * 1e3:.2f}",
            f"{(encode_s + apply_s) / copy_s:.1f}x",
            "-" if device_s is None else f"{device_s * 1e3:.2f}",
            "-" if device_s is None else f"{device_s / copy_s:.1f}x",
        )
        if phases:
            times = {
                f"{side}: {name}": t
                for side, fn, setup in sides
                for name, t in _steps(fn, device, repeat, setup).items()
            }
            if not steps.columns:
                for column in ("density", *times):
                    steps.add_column(column, justify="right")
            steps.add_row(f"{density:.1%}", *(f"{t * 1e6:.0f}" for t in times.values()))
        if kernels and device.type == "cuda":
            for side, fn, setup in sides:
                for name, seconds in sorted(_device_times(fn, setup, device).items(), key=lambda item: -item[1]):
                    by_kernel.add_row(f"{density:.1%}", side, name, f"{seconds * 1e6:.0f}")
    return [table, *([steps] if phases else []), *([by_kernel] if kernels and device.type == "cuda" else [])]


def _base_codec(tree: Path):
    """The `sparse_codec` module of the `rl_sync` package under `tree` (an older checkout, e.g.
    `git worktree add /tmp/base <commit>`), imported as `rl_sync_base` (its imports are relative)."""
    package = tree / "rl_sync"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"--against {tree}: no rl_sync package there (expected {package / '__init__.py'})")
    holder = Path(tempfile.mkdtemp(prefix="rl_sync_base_"))
    atexit.register(shutil.rmtree, holder, ignore_errors=True)
    shutil.copytree(package, holder / "rl_sync_base", ignore=shutil.ignore_patterns("__pycache__"))
    sys.path.insert(0, str(holder))
    return importlib.import_module("rl_sync_base.engine.sparse_codec")


def against_table(
    device: torch.device, repeat: int, tree: Path, total_bytes: int = 1 << 30, tensors: int = 16
) -> Table:
    """This tree's codec against the one under `tree`, in one process on the same buckets: each
    round runs both, in alternating order, so drifts of the host (lent machines differ by up to
    1.5x, and one machine by 0.25x over minutes) fall on both alike; the median and first quartile
    of total / copy over `repeat` rounds (a copy timed each round)."""
    codecs = {"this tree": sparse_codec, str(tree): _base_codec(tree)}
    empty, gen = _empty_bucket(device, total_bytes, tensors)
    table = Table(
        title=f"sparse codec against {tree}: {total_bytes / 2**30:.0f} GiB bf16 in {tensors} tensors, "
        f"{repeat} rounds each, alternating"
    )
    for column in ("density", "codec", "diff+encode ms", "decode+apply ms", "total / copy", "first quartile"):
        table.add_column(column, justify="right")
    for density in (0.01, 0.1):
        bucket = _bucket(empty, density, gen)
        runs = {label: _sides(codec, bucket) for label, codec in codecs.items()}
        resets = bucket.reset(bucket.baseline), bucket.receiving()
        times: dict[str, list[tuple[float, float]]] = {label: [] for label in runs}
        copies = []
        for r in range(repeat + WARM_UP):
            copies.append(_once(_copy(bucket), device))
            for label in list(runs)[:: 1 if r % 2 else -1]:
                (encode_all, apply_all), (reset_baseline, reset_live) = runs[label], resets
                times[label].append((_once(encode_all, device, reset_baseline), _once(apply_all, device, reset_live)))
        copy_s = statistics.median(copies[WARM_UP:])
        for label, pairs in times.items():
            pairs = pairs[WARM_UP:]
            totals = [(e + a) / copy_s for e, a in pairs]
            table.add_row(
                f"{density:.1%}",
                label,
                f"{statistics.median(e for e, _ in pairs) * 1e3:.3f}",
                f"{statistics.median(a for _, a in pairs) * 1e3:.3f}",
                f"{statistics.median(totals):.2f}x",
                f"{statistics.quantiles(totals, n=4)[0] if len(totals) > 1 else totals[0]:.2f}x",
            )
    return table


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
    parser.add_argument("--kernels", action="store_true", help="with --codec: each kernel's device time (GPU)")
    parser.add_argument(
        "--densities",
        type=lambda text: tuple(float(d) for d in text.split(",")),
        default=DENSITIES,
        help="with --codec: the densities of its tables, comma-separated (default: 0.001 to 1.0)",
    )
    parser.add_argument(
        "--against",
        type=Path,
        metavar="TREE",
        help="with --codec: also this tree's codec against the rl_sync under TREE",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per figure (their median)")
    args = parser.parse_args()
    console = Console(width=160)
    if args.codec:
        tables = codec_tables(
            torch.device(args.device), args.repeat, phases=args.phases, kernels=args.kernels, densities=args.densities
        )
        for table in tables:
            console.print(table)
        if args.reference:
            console.print(*codec_tables(torch.device(args.device), args.repeat, reference=True))
        if args.against:
            console.print(against_table(torch.device(args.device), args.repeat, args.against))
    if args.e2e:
        console.print(e2e_table(args.repeat))


if __name__ == "__main__":
    main()
