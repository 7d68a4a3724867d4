"""A LoRA round against a full round into the same vLLM engine (TP ranks as Ray actors).

One model (Qwen2-0.5B shapes, random weights, `--layers` of them), two FSDP2 trainers
(fp32, Gloo), one vLLM engine at `--tp` on the trainers' base weights:

* **full round**: `WeightSync.push()` of every weight (the engine started without LoRA);
* **LoRA round**: the same rank actors restart the engine with `enable_lora=True`, the
  trainers get a PEFT adapter (`--rank`, every linear layer of every decoder layer) and take
  one AdamW step on it, then `WeightSync.create(..., lora=spec).push()` moves the adapter only,
  into one LoRA slot of the engine.

Prints seconds per round and bytes into each vLLM rank for both.

    python benchmarks/lora_bench.py [--layers 4] [--rounds 3] [--tp 2] [--rank 16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local benchmark: Ray stays on loopback

import ray
from rich.console import Console
from rich.table import Table
from vllm_bench import LLM_KWARGS, QWEN2_05B

from actors import WeightSync
from actors.cluster import free_init_url
from actors.models import HFTrainer
from actors.vllm import VllmEngine
from rl_sync.config.lora import LoraSpec
from rl_sync.config.sync import SyncConfig
from rl_sync.vllm.checkpoint import scratch_checkpoint

HOST = "127.0.0.1"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = SyncConfig(
    rendezvous_host=HOST, bind_host=HOST, bucket_bytes=64 << 20, init_timeout_s=300, round_timeout_s=300
)


def _trainers(config: dict, lora: dict | None) -> list:
    Trainer = ray.remote(num_cpus=0.1)(HFTrainer)
    url = free_init_url(HOST)
    return [Trainer.remote(i, 2, config, url, 0, 0.1, "float32", "cpu", lora) for i in range(2)]


def _rounds(trainers: list, engine: VllmEngine, rounds: int, lora: LoraSpec | None) -> tuple[list, list, int]:
    """Seconds of each round, the bytes into each vLLM rank, and the plan's bytes."""
    sync = WeightSync.create(trainers, engine.ranks, CONFIG, lora=lora, progress=False)
    seconds, received = [], []
    for _ in range(rounds):
        stats = sync.push()
        seconds.append(stats.seconds)
        received = [r.received_bytes for r in stats.ranks if r.role == "worker"]
    plan_bytes = sync.summary.plan_bytes
    sync.close()
    return seconds, received, plan_bytes


def run(layers: int, rounds: int, tp: int, rank: int) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2", **QWEN2_05B, num_hidden_layers=layers).to_dict()
    config.update(architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    trainers = _trainers(config, None)
    state = ray.get([t.full_state.remote() for t in trainers])[0]
    path = scratch_checkpoint("rl-sync-lora-bench-", config, state)
    params = sum(v.numel() for v in state.values())
    del state
    env, options = {"GLOO_SOCKET_IFNAME": "lo"}, [{"num_cpus": 0.1}] * tp
    engine = VllmEngine.launch(path, tp=tp, llm_kwargs=LLM_KWARGS, host=HOST, env=env, actor_options=options)
    try:
        full = _rounds(trainers, engine, rounds, None)
        for t in trainers:
            ray.kill(t)
        engine.restart(path, {**LLM_KWARGS, "enable_lora": True, "max_lora_rank": rank, "max_loras": 1})
        trainers = _trainers(config, dict(r=rank, lora_alpha=2 * rank, target_modules=TARGETS))
        ray.get([t.train_step.remote(_tokens(), 1e-2) for t in trainers])
        spec = LoraSpec(name="policy", lora_id=1, rank=rank, alpha=2 * rank)
        adapter = _rounds(trainers, engine, rounds, spec)
    finally:
        engine.shutdown()
        for t in trainers:
            ray.kill(t)
    return {"params": params, "full": full, "lora": adapter}


def _tokens():
    import torch

    return torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args(argv)
    ray.init(
        _node_ip_address=HOST,
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
    )
    result = run(args.layers, args.rounds, args.tp, args.rank)
    table = Table(
        title=f"vLLM TP{args.tp}, Qwen2-0.5B shapes x {args.layers} layers ({result['params'] / 1e6:.0f}M "
        f"parameters), LoRA r={args.rank} on every linear layer, 2 FSDP2 trainers (fp32) -> bf16, Gloo on loopback"
    )
    for column in ("round", "seconds (median, min-max)", "MB into each vLLM rank", "plan MB"):
        table.add_column(column)
    for name, (seconds, received, plan_bytes) in (("full", result["full"]), ("LoRA", result["lora"])):
        table.add_row(
            name,
            f"{statistics.median(seconds):.3f} ({min(seconds):.3f}-{max(seconds):.3f})",
            ", ".join(f"{b / 1e6:.3f}" for b in received),
            f"{plan_bytes / 1e6:.3f}",
        )
    Console().print(table)
    ratio = result["lora"][2] / result["full"][2]
    speedup = statistics.median(result["full"][0]) / statistics.median(result["lora"][0])
    print(f"LoRA round: {ratio:.4f} of a full round's bytes, {speedup:.1f}x faster")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
