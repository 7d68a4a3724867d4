"""rl-sync into a vLLM engine (TP ranks as Ray actors) against what RL frameworks do today.

One run, one model (Qwen2-0.5B shapes, random weights, `--layers` of them),
the same two FSDP2 trainers (fp32 masters, Gloo) and the same vLLM engine at
`--tp`. Each round the trainers take no step (the weights are the same every
round, so both methods move identical bytes):

* **rl-sync**: `WeightSync.push()`: each trainer sends its shards' boxes
  straight to the ranks that keep them, cast to bf16 on the way; each vLLM rank
  receives only what it keeps (1/TP of the sharded tensors) and runs vLLM's
  post-load processing for what changed.
* **baseline** (vLLM's own `nccl` backend pattern, on Gloo here): the trainers
  gather the full state dict on trainer 0, which broadcasts every tensor (bf16)
  to every vLLM rank; each rank hands them to vLLM's loader
  (`model_runner.reload_weights(..., is_checkpoint_format=True)`, which shards,
  fuses and repacks), then resets its prefix cache.

Both end with the engine generating the same tokens (checked). Prints seconds
per update and bytes into each vLLM rank.

    python benchmarks/vllm_bench.py [--layers 12] [--rounds 3] [--tp 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local benchmark: Ray stays on loopback

import ray
import torch
from rich.console import Console
from rich.table import Table

from actors import WeightSync
from actors.cluster import free_init_url
from actors.models import HFTrainer
from actors.vllm import VllmEngine
from rl_sync.config.sync import SyncConfig
from rl_sync.rendezvous import StoreServer, new_secret
from rl_sync.transport.gloo import GlooTransport
from rl_sync.vllm.checkpoint import scratch_checkpoint

if __name__ != "__main__":
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

QWEN2_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)
LLM_KWARGS = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    enforce_eager=True,
    kv_cache_memory_bytes=64 << 20,
    max_model_len=128,
    seed=0,
)
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3, 4, 5, 6, 7, 8]]


def _gathered(trainer) -> dict[str, torch.Tensor] | None:
    """On every trainer (collective): the full state, kept by trainer 0 only, in bf16."""
    full = {n: p.full_tensor().detach().to(torch.bfloat16) for n, p in trainer.model.named_parameters()}
    return full if trainer.rank == 0 else None


def _join(actor, rank: int, size: int, host: str, port: int, secret: bytes) -> None:
    actor.baseline = GlooTransport(
        rank,
        size,
        host,
        port,
        secret,
        bind_host=host,
        prefix="baseline",
        timeout_s=300,
        broadcast_ranks=list(range(size)),
    )


def _send(trainer, names_shapes: list) -> None:
    """Trainer 0: broadcast every full tensor (bf16) to the vLLM ranks, one after another."""
    full = _gathered(trainer)
    if full is not None:  # trainer 0
        deadline = time.monotonic() + 300
        for name, _ in names_shapes:
            trainer.baseline.broadcast(full[name].reshape(-1).view(torch.uint8), 0, deadline)


def _receive(rank, names_shapes: list) -> int:
    """A vLLM rank: receive every tensor whole, hand them to vLLM's loader; returns bytes received."""
    deadline, received, pairs = time.monotonic() + 300, 0, []
    for name, shape in names_shapes:
        buffer = torch.empty(shape, dtype=torch.bfloat16)
        rank.baseline.broadcast(buffer.reshape(-1).view(torch.uint8), 0, deadline)
        received += buffer.numel() * 2
        pairs.append((name, buffer))
    runner = rank.llm.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.reload_weights(weights_iterator=iter(pairs), is_checkpoint_format=True)
    rank.llm.reset_prefix_cache()
    return received


def _store(host: str, secret: bytes) -> StoreServer:
    import socket

    sock = socket.socket()
    sock.bind((host, 0))
    sock.listen(64)
    return StoreServer(sock, secret)


def run(layers: int, rounds: int, tp: int) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.for_model("qwen2", **QWEN2_05B, num_hidden_layers=layers).to_dict()
    config.update(architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    host = "127.0.0.1"
    Trainer = ray.remote(num_cpus=0.1)(HFTrainer)
    url = free_init_url(host)
    trainers = [Trainer.remote(i, 2, config, url) for i in range(2)]
    state = ray.get([t.full_state.remote() for t in trainers])[0]
    params = sum(v.numel() for v in state.values())
    path = scratch_checkpoint("rl-sync-bench-", config, {k: torch.zeros_like(v) for k, v in state.items()})
    del state
    engine = VllmEngine.launch(
        path,
        tp=tp,
        llm_kwargs=LLM_KWARGS,
        host=host,
        env={"GLOO_SOCKET_IFNAME": "lo"},
        actor_options=[{"num_cpus": 0.1}] * tp,
    )
    try:
        sync = WeightSync.create(
            trainers,
            engine.ranks,
            SyncConfig(
                rendezvous_host=host, bind_host=host, bucket_bytes=64 << 20, init_timeout_s=300, round_timeout_s=300
            ),
            progress=False,
        )
        m2n, m2n_bytes = [], []
        for _ in range(rounds):
            stats = sync.push()
            m2n.append(stats.seconds)
            m2n_bytes = [r.received_bytes for r in stats.ranks if r.role == "worker"]
        after_m2n = engine.generate(PROMPTS, max_tokens=4, temperature=0.0, logprobs=1)
        sync.close()

        names_shapes = [
            (n, tuple(p.shape))
            for n, p in ray.get(trainers[0].call.remote(lambda t: [(n, p) for n, p in t.model.named_parameters()]))
        ]
        secret = new_secret()
        store = _store(host, secret)
        members = trainers[:1] + engine.ranks
        ray.get([a.call.remote(_join, i, len(members), host, store.port, secret) for i, a in enumerate(members)])
        baseline, base_bytes = [], []
        for _ in range(rounds):
            start = time.perf_counter()
            refs = [t.call.remote(_send, names_shapes) for t in trainers]
            base_bytes = ray.get([r.call.remote(_receive, names_shapes) for r in engine.ranks])
            ray.get(refs)
            baseline.append(time.perf_counter() - start)
        after_baseline = engine.generate(PROMPTS, max_tokens=4, temperature=0.0, logprobs=1)
        store.close()
    finally:
        engine.shutdown()
        for t in trainers:
            ray.kill(t)  # type: ignore[arg-type]  # Ray's ActorProxy
    return {
        "params": params,
        "m2n": m2n,
        "m2n_bytes": m2n_bytes,
        "baseline": baseline,
        "baseline_bytes": base_bytes,
        "same_tokens": [o["tokens"] for o in after_m2n] == [o["tokens"] for o in after_baseline],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args(argv)
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
    )
    result = run(args.layers, args.rounds, args.tp)
    table = Table(
        title=f"vLLM TP{args.tp}, Qwen2-0.5B shapes x {args.layers} layers, {result['params'] / 1e6:.0f}M "
        f"parameters, 2 FSDP2 trainers (fp32) -> bf16 engine, Gloo on loopback"
    )
    for column in ("method", "seconds per update (median, min-max)", "MB into each vLLM rank"):
        table.add_column(column)
    for name, seconds, received in (
        ("rl-sync m2n", result["m2n"], result["m2n_bytes"]),
        ("gather + broadcast + load_weights", result["baseline"], result["baseline_bytes"]),
    ):
        table.add_row(
            name,
            f"{statistics.median(seconds):.3f} ({min(seconds):.3f}-{max(seconds):.3f})",
            ", ".join(f"{b / 1e6:.1f}" for b in received),
        )
    Console().print(table)
    speedup = statistics.median(result["baseline"]) / statistics.median(result["m2n"])
    print(
        f"speed-up {speedup:.2f}x; bytes per rank {result['m2n_bytes'][0] / result['baseline_bytes'][0]:.3f} of the "
        f"baseline's; same greedy tokens after both: {result['same_tokens']}"
    )
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
