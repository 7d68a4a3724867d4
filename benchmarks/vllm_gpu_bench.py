"""rl-sync into vLLM's CUDA engine against vLLM's own ways in, one table, one run, one GPU.

A trainer actor and a vLLM engine rank (vLLM's external launcher) share one GPU. The model has
Llama-3-8B's shapes (291 tensors, 16.06 GB in bf16) with random weights: the engine starts on a
config alone (`load_format="dummy"`), the trainer holds random bf16 tensors of the checkpoint's
names. Each method moves the same tensors into the same engine:

* **rl-sync**: `WeightSync.push()`: CUDA IPC, the trainer writes straight into the engine's live
  weights (or, for layers vLLM processes after loading, its loader-form buffers, then vLLM's
  processing);
* **vLLM ipc**: vLLM's `ipc` weight-transfer backend as its trainer side ships it
  (`IPCWeightTransferEngine.trainer_send_weights`: a CUDA IPC handle per tensor, or `packed`
  into bounded buffers; the engine loads them through its loader and layerwise reload);
* **gather + load_weights**: the full state through host memory and Ray's object store into the
  engine's `model.load_weights` (layerwise reload), as frameworks without a device path do;
* **device-copy floor**: one device-to-device copy of the same bytes.

`--methods staged` (not in the default set) adds, per engine, staged rounds
(`SyncConfig(double_buffer=True)`: `stage()`, then `commit()`) against rl-sync's blocking round
(`push()` without double buffering) into the same engine: the commit step (the engine's stall,
`RoundStats.commit_seconds`: host time; copies it queues on the GPU run after it), the driver's
whole `commit()` call, that call plus a call into the engine rank that synchronizes its GPU (so
every copy the commit queued has run), and the commit step as a share of a blocking round.
Then `--repeat` staged rounds staged and committed while the engine generates (64 prompts x 256
tokens): the commit step, the engine's stall (`RoundStats.stall_seconds`: the commit made between
two of its steps, the Ray call that brought it having run beside the generation), as a share of a
blocking round, how many commits landed between two steps, and the generation's seconds against
the same generation with no round beside it (the transfer, the calls and the commit all count).
`bf16` runs eagerly, so commits swap the shadows in (the trainer maps both faces of the worker's
export: `rl_sync.transport.cuda_ipc`) where this process can swap storages (`rl_sync.rank.swap`),
else copy; `bf16_graphs` (CUDA graphs on decode steps, which
capture the weights' addresses) commits by copy.

Engines: bf16; online FP8 (`quantization="fp8"`: rl-sync and vLLM's backends send bf16 and the
engine quantizes); block FP8 (a `weight_block_size` [128, 128] config: rl-sync's trainer
quantizes and sends FP8 values plus scales; vLLM's backends send what the engine keeps, so they
take no part). Columns: median seconds of `--repeat` rounds (gather: one; rl-sync's with its Ray
calls, and the handover alone: the slowest rank's time in the round), GB/s of the bytes the engine
receives, those bytes, and the peak GPU memory each side allocates beyond what it held before the
method started (bind-time buffers included).

    python benchmarks/vllm_gpu_bench.py [--repeat 5] [--engines bf16,fp8,block_fp8]
                                        [--methods rl-sync,ipc,gather]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import asdict, replace

import ray
import torch
from gpu_bench import copy_floor
from gpu_common import ROOT, show, specs_8b, start_ray
from mid_generation import commit_mid_generation, generation_seconds, step_summary, time_steps

from actors import WeightSync
from actors.ready import TrainerActor
from actors.synthetic_actors import trainer_build
from actors.vllm import VllmEngine
from rl_sync.config.sync import SyncConfig

ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
LLAMA3_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
GRAPHS: dict = {
    "enforce_eager": False,
    "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]},
}
ENGINES: dict[str, dict] = {
    "bf16": {},
    "bf16_graphs": GRAPHS,
    "fp8": {"quantization": "fp8"},
    "block_fp8": {},
}
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
SYNC = SyncConfig(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", bucket_bytes=1 << 30, round_timeout_s=600)


def write_config(directory: str, block_fp8: bool) -> str:
    """A Llama-3-8B `config.json` (no weights: the engine loads dummy ones)."""
    import json
    import os

    from transformers import AutoConfig

    config = {**AutoConfig.for_model("llama", **LLAMA3_8B).to_dict(), "architectures": ["LlamaForCausalLM"]}
    config["torch_dtype"] = "bfloat16"
    if block_fp8:
        config["quantization_config"] = BLOCK_FP8
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return directory


def start_engine(path: str, extra: dict) -> VllmEngine:
    kwargs = dict(
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        gpu_memory_utilization=0.3,
        kv_cache_memory_bytes=1 << 30,
        max_model_len=1024,
        weight_transfer_config={"backend": "ipc"},
        **{"enforce_eager": True, **extra},
    )
    return VllmEngine.launch(path, tp=1, llm_kwargs=kwargs, env=ENV, actor_options=[{"num_gpus": 0.5, "num_cpus": 1}])


def _memory_mark(actor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _memory_peak(actor) -> int:
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def measured(trainer, rank, run) -> dict:
    """`run()`'s result with the peak GPU memory each side allocated beyond its start."""
    marks = ray.get([trainer.call.remote(_memory_mark), rank.call.remote(_memory_mark)])
    result = run()
    peaks = ray.get([trainer.call.remote(_memory_peak), rank.call.remote(_memory_peak)])
    return {**result, "trainer_extra": peaks[0] - marks[0], "engine_extra": peaks[1] - marks[1]}


def rl_sync_rows(trainer, engine: VllmEngine, repeat: int) -> dict:
    def run() -> dict:
        sync = WeightSync.create([trainer], engine.ranks, SYNC)
        assert sync.summary.cuda_ipc and not sync.summary.fallbacks, "colocated, every tensor bound"
        sync.push()
        rounds = [sync.push() for _ in range(repeat)]
        sync.close()
        return {
            "s": statistics.median(r.seconds for r in rounds),
            "handover_s": statistics.median(max(rank.seconds for rank in r.ranks) for r in rounds),
            "bytes": sum(sync.summary.kept_bytes),
        }

    return measured(trainer, engine.ranks[0], run)


def staged_rows(trainer, engine: VllmEngine, repeat: int) -> dict:
    """Blocking rounds, then staged ones into `engine`, committed between two generations and
    during one: medians of `repeat` each (see the module docstring)."""
    sync = WeightSync.create([trainer], engine.ranks, SYNC)
    sync.push()
    blocking = [sync.push().seconds for _ in range(repeat)]
    sync.close()
    sync = WeightSync.create([trainer], engine.ranks, replace(SYNC, double_buffer=True))
    sync.push()
    commits, calls, synced, inflight = [], [], [], []
    for _ in range(repeat):
        staged = sync.stage()
        engine.generate([[1, 2, 3]] * 8, max_tokens=32, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        commits.append(staged.commit().commit_seconds)
        calls.append(time.perf_counter() - start)
        synced.append(calls[-1] + _synchronize_seconds(engine))
    idle, rank = [], engine.ranks[0]
    steps: dict[str, list[dict]] = {"idle": [], "round": []}
    ray.get(rank.call.remote(time_steps))
    for _ in range(repeat):  # interleaved: the machine's drift lands on both alike
        idle.append(generation_seconds(rank, GENERATION))
        steps["idle"].append(ray.get(rank.call.remote(step_summary)))
        inflight.append(commit_mid_generation(sync, engine.ranks, GENERATION))
        steps["round"].append(ray.get(rank.call.remote(step_summary)))
    sync.close()
    bare = [_synchronize_seconds(engine) for _ in range(repeat)]  # nothing queued: what it adds to a commit
    median = statistics.median
    return {
        "blocking_s": median(blocking),
        "commit_s": median(commits),
        "commit_call_s": median(calls),
        "synced_s": median(synced),
        "bare_sync_s": median(bare),
        "inflight_step_s": median(r["step_s"] for r in inflight),
        "inflight_stall_s": median(r["stall_s"] for r in inflight),
        "between_steps": sum(r["between_steps"] for r in inflight),
        "generation_idle_s": median(idle),
        "generation_staged_s": median(r["generation_s"] for r in inflight),
        "generation_pairs_s": [(round(a, 3), round(r["generation_s"], 3)) for a, r in zip(idle, inflight)],
        "generation_steps": steps,
        "inflight_rounds": len(inflight),
    }


GENERATION = ([[1, 2, 3]] * 64, dict(max_tokens=256, temperature=0.0, ignore_eos=True), None)
"""What the engine generates while a staged round travels and commits: 64 prompts x 256 tokens."""


def _synchronize(rank_self) -> None:
    torch.cuda.synchronize()


def _synchronize_seconds(engine: VllmEngine) -> float:
    """Seconds of a call into the engine's rank that waits for everything queued on its GPU."""
    start = time.perf_counter()
    ray.get(engine.ranks[0].call.remote(_synchronize))
    return time.perf_counter() - start


def _update(rank_self, info: dict) -> None:
    rank_self.llm.update_weights({"update_info": info})


def _send_ipc(trainer_self, rank, packed: bool) -> int:
    """vLLM's trainer side of its `ipc` backend, every tensor this trainer holds (runs in the
    trainer; returns the bytes sent)."""
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    def send(info) -> None:
        ray.get(rank.call.remote(_update, asdict(info)))

    pairs = [(name, s.local) for name, s in trainer_self.held.items()]
    # vLLM 0.26, the CUDA build this runs on (0.29+ moved the trainer side to its trainer engines)
    IPCWeightTransferEngine.trainer_send_weights(iter(pairs), {"send_mode": send, "packed": packed})  # type: ignore[attr-defined]
    return sum(t.numel() * t.element_size() for _, t in pairs)


def ipc_rows(trainer, engine: VllmEngine, repeat: int, packed: bool) -> dict:
    rank = engine.ranks[0]

    def once() -> tuple[float, int]:
        start = time.perf_counter()
        ray.get(rank.call.remote(lambda s: s.llm.start_weight_update()))
        nbytes = ray.get(trainer.call.remote(_send_ipc, rank, packed))
        ray.get(rank.call.remote(lambda s: s.llm.finish_weight_update()))
        return time.perf_counter() - start, nbytes

    def run() -> dict:
        once()
        rounds = [once() for _ in range(repeat)]
        return {"s": statistics.median(s for s, _ in rounds), "bytes": rounds[0][1]}

    return measured(trainer, rank, run)


def _host_state(trainer_self) -> dict[str, torch.Tensor]:
    return {name: s.local.cpu() for name, s in trainer_self.held.items()}


def _load(rank_self, state: dict[str, torch.Tensor]) -> None:
    """vLLM's own reload from checkpoint-format tensors (its loader, then layerwise processing)."""
    rank_self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items())})
    torch.cuda.synchronize()


def _held_bytes(trainer_self) -> int:
    return sum(s.local.numel() * s.local.element_size() for s in trainer_self.held.values())


def gather_rows(trainer, engine: VllmEngine) -> dict:
    rank = engine.ranks[0]

    def run() -> dict:
        start = time.perf_counter()
        ray.get(rank.call.remote(_load, trainer.call.remote(_host_state)))
        return {"s": time.perf_counter() - start, "bytes": ray.get(trainer.call.remote(_held_bytes))}

    return measured(trainer, rank, run)


METHODS = ("rl-sync", "ipc", "gather")
EXTRA_METHODS = ("staged",)


def bench_engine(kind: str, trainer, repeat: int, workdir: str, methods: set[str]) -> dict[str, dict]:
    """The rows of `methods` (of `METHODS`) into a fresh engine of `kind`; vLLM's own ways in only
    where they can feed it (not block FP8)."""
    engine = start_engine(write_config(f"{workdir}/{kind}", kind == "block_fp8"), ENGINES[kind])
    try:
        rows = {"rl-sync": rl_sync_rows(trainer, engine, repeat)} if "rl-sync" in methods else {}
        if kind != "block_fp8" and "ipc" in methods:
            rows["vLLM ipc"] = ipc_rows(trainer, engine, repeat, packed=False)
            rows["vLLM ipc, packed"] = ipc_rows(trainer, engine, repeat, packed=True)
        if kind != "block_fp8" and "gather" in methods:
            rows["gather + load_weights"] = gather_rows(trainer, engine)
        if "staged" in methods:
            rows["staged"] = staged_rows(trainer, engine, repeat)
        return rows
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--engines", default="bf16,fp8,block_fp8", help=f"comma-separated: {', '.join(ENGINES)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated: {', '.join(METHODS)}")
    args = parser.parse_args()
    methods = set(args.methods.split(","))
    known = METHODS + EXTRA_METHODS
    if not methods <= set(known):
        parser.error(f"--methods: {sorted(methods - set(known))} are not among {', '.join(known)}")
    start_ray()
    specs = specs_8b()
    total = sum(s.nbytes for s in specs)
    floor = copy_floor(total, args.repeat)
    Trainer = ray.remote(TrainerActor).options(num_gpus=0.5, num_cpus=1)
    trainer = Trainer.remote(0, 1, trainer_build(specs, "cuda"))
    ray.get(trainer.call.remote(lambda s: torch.cuda.synchronize()))
    results = {"floor": {"s": floor, "bytes": total, "trainer_extra": 0, "engine_extra": 0}}
    staged: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(dir=ROOT) as workdir:
        for kind in args.engines.split(","):
            for method, row in bench_engine(kind, trainer, args.repeat, workdir, methods).items():
                if method == "staged":
                    staged[kind] = row
                else:
                    results[f"{kind}: {method}"] = row
    if staged:
        show_staged(staged, args.repeat)
    rows = [
        [
            label.replace("floor", "device-to-device copy (floor)"),
            f"{r['s']:.3f}",
            f"{r['handover_s']:.3f}" if "handover_s" in r else "-",
            f"{r['bytes'] / r['s'] / 1e9:.0f}",
            f"{r['bytes'] / 1e9:.2f}",
            f"{r['s'] / floor:.2f}",
            f"{r['trainer_extra'] / 2**30:.2f}",
            f"{r['engine_extra'] / 2**30:.2f}",
        ]
        for label, r in results.items()
    ]
    show(
        f"Llama-3-8B shapes into vLLM on one {torch.cuda.get_device_name()} (median of {args.repeat})",
        ["method", "s", "handover s", "GB/s", "GB into the engine", "x copy floor", "trainer +GiB", "engine +GiB"],
        rows,
        "vllm_gpu_bench",
        results,
    )


def show_staged(staged: dict[str, dict], repeat: int) -> None:
    rows = [
        [
            kind,
            f"{r['blocking_s'] * 1e3:.2f}",
            f"{r['commit_s'] * 1e3:.2f}",
            f"{r['commit_call_s'] * 1e3:.2f}",
            f"{r['synced_s'] * 1e3:.2f} ({r['bare_sync_s'] * 1e3:.2f})",
            f"{r['commit_s'] / r['blocking_s']:.1%}",
            f"{r['inflight_step_s'] * 1e3:.2f}",
            f"{r['inflight_stall_s'] * 1e3:.3f} ({r['between_steps']}/{r['inflight_rounds']})",
            f"{r['inflight_stall_s'] / r['blocking_s']:.1%}",
            f"{r['generation_idle_s']:.3f} / {r['generation_staged_s']:.3f}",
        ]
        for kind, r in staged.items()
    ]
    show(
        f"Staged rounds, Llama-3-8B shapes, one {torch.cuda.get_device_name()} (median of {repeat})",
        [
            "engine",
            "blocking ms",
            "commit step ms",
            "commit() call ms",
            "+ synced ms (sync alone)",
            "step / blocking",
            "mid-generation: step ms",
            "stall ms (between steps)",
            "stall / blocking",
            "generation s: idle / round beside",
        ],
        rows,
        "vllm_gpu_bench_staged",
        staged,
    )


if __name__ == "__main__":
    main()
