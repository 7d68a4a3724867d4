"""Staged rounds against blocking ones: what a vLLM engine loses to a weight update.

One model (Qwen2-0.5B shapes, random weights, `--layers` of them), FSDP2 trainers and a vLLM
engine (its TP ranks as Ray actors, external launcher). Every round moves the same tensors
(the trainers take no step), dense:

* **idle**: the engine generates `--prompts` prompts x `--tokens` tokens (greedy, no early stop)
  with no round running: tokens per second;
* **blocking**: `WeightSync.push()` without double buffering: the engine cannot generate during
  it, so the whole round is its stall;
* **staged**: `WeightSync.stage()` (double buffering), the same generation at once (the transfer
  runs beside it, on the ranks' own threads), then `StagedRound.commit()`: tokens per second
  meanwhile, the transfer's seconds (the slowest rank's), and the commit: the step the engine
  waits for (`RoundStats.commit_seconds`) and the driver's whole call (which also waits for a
  transfer the generation outlasted less);
* **Ray call**: a call that does nothing into every engine rank at once, from the driver: the
  least any commit step (such a call from the coordinator) costs.
* **mid-generation**: the same generation started first, then a round staged and committed while
  it runs (`mid_generation.py`): the commit step, the engine's stall (`RoundStats.stall_seconds`,
  the commit made between two of its steps, the same one on every TP rank, which are held from
  their arming to the commit: `actors.steps`), and the generation's tokens per second.

The same script runs on CPUs (vLLM's CPU build; defaults: 2 trainers, TP2) and on GPUs
(`--device cuda`, vLLM's CUDA build: a trainer and each engine rank on a GPU of their own,
NCCL, so 1 + TP GPUs; or `--colocate`: trainer i and engine rank i share GPU i, so TP GPUs and
as many trainers, and the trainers write the engine's shadows themselves through CUDA IPC;
`--cuda-graphs` leaves vLLM's CUDA graphs on, which capture the weights' addresses, so commits
copy instead of swapping). Prints one table; medians of `--rounds`.
`--profile` then runs `--rounds` more staged rounds with timers around the parts of a commit
inside the actors (`round_profile.py`: the shadows made live, fallbacks, vLLM's hook, the
version recorded) and prints, per actor, each part's time and the median commit's timeline.

    python benchmarks/staged_bench.py [--layers 12] [--rounds 3] [--tp 2] [--device cpu]
    python benchmarks/staged_bench.py --device cuda --colocate        # one GPU: TP1, one trainer
    python benchmarks/staged_bench.py --layers 4 --rounds 2 --profile  # where a commit's time goes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import ray
import round_profile
import torch
from mid_generation import commit_mid_generation
from rich.console import Console
from rich.table import Table
from vllm_bench import LLM_KWARGS, QWEN2_05B

from actors import WeightSync
from actors.cluster import free_init_url
from actors.models import HFTrainer
from actors.vllm import VllmEngine
from rl_sync.config.sync import SyncConfig
from rl_sync.vllm.checkpoint import scratch_checkpoint

GPU_LLM_KWARGS = dict(
    skip_tokenizer_init=True, dtype="bfloat16", gpu_memory_utilization=0.5, max_model_len=1024, seed=0
)
PROMPT_TOKENS = 8
ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


def _llm_kwargs(device: str, cuda_graphs: bool) -> dict:
    """The engine's arguments: `vllm_bench`'s on CPUs; on GPUs room for the longer generations."""
    return {**GPU_LLM_KWARGS, "enforce_eager": not cuda_graphs} if device == "cuda" else dict(LLM_KWARGS)


def _config(layers: int, device: str) -> dict:
    """The model's config: Qwen2-0.5B shapes with as many positions as the engine serves (vLLM
    refuses a `max_model_len` over them; rotary positions, so the weights are the same)."""
    from transformers import AutoConfig

    positions = _llm_kwargs(device, cuda_graphs=False)["max_model_len"]
    shapes = {**QWEN2_05B, "max_position_embeddings": positions}
    config = AutoConfig.for_model("qwen2", **shapes, num_hidden_layers=layers).to_dict()
    config.update(architectures=["Qwen2ForCausalLM"], torch_dtype="bfloat16")
    return config


def placement(args) -> list[dict]:
    """Ray options of trainer i and engine rank i: a share of a CPU; on GPUs a GPU each, or with
    `--colocate` half of GPU i each (one placement-group bundle per pair: CUDA IPC between them)."""
    count = max(args.trainers, args.tp)
    if args.device != "cuda":
        return [{"num_cpus": 0.1}] * count
    if not args.colocate:
        return [{"num_gpus": 1, "num_cpus": 1}] * count
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"GPU": 1, "CPU": 2}] * args.tp, strategy="PACK")
    ray.get(group.ready(), timeout=300)
    return [
        {"num_gpus": 0.5, "num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, i)}
        for i in range(args.tp)
    ]


def _engine(path: str, tp: int, device: str, cuda_graphs: bool, options: list[dict]) -> VllmEngine:
    return VllmEngine.launch(
        path,
        tp=tp,
        llm_kwargs=_llm_kwargs(device, cuda_graphs),
        host="127.0.0.1",
        env=ENV,
        actor_options=options[:tp],
        timeout_s=900,
    )


def start_trainers(args, config: dict, options: list[dict]) -> list:
    """`args.trainers` FSDP2 trainers of `config` (`HFTrainer`), placed by `options`."""
    url = free_init_url("127.0.0.1")
    return [
        ray.remote(HFTrainer).options(**options[i]).remote(i, args.trainers, config, url, device=args.device)
        for i in range(args.trainers)
    ]


def _generate(engine: VllmEngine, prompts: list[list[int]], tokens: int) -> float:
    """Seconds to generate `tokens` tokens for every prompt."""
    start = time.perf_counter()
    engine.generate(prompts, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return time.perf_counter() - start


def _sync(trainers, engine: VllmEngine, double_buffer: bool) -> WeightSync:
    config = SyncConfig(
        rendezvous_host="127.0.0.1",
        bind_host="127.0.0.1",
        bucket_bytes=64 << 20,
        init_timeout_s=300,
        round_timeout_s=300,
        double_buffer=double_buffer,
    )
    return WeightSync.create(trainers, engine.ranks, config, progress=False)


def measure(engine: VllmEngine, trainers, rounds: int, prompts: list[list[int]], tokens: int, profile: bool) -> dict:
    """The figures of the module docstring, each a list of `rounds` values; with `profile`, then
    the parts of `rounds` more commits (`profile_commits`)."""
    generated = len(prompts) * tokens
    _generate(engine, prompts, tokens)  # warm
    idle = [generated / _generate(engine, prompts, tokens) for _ in range(rounds)]
    sync = _sync(trainers, engine, double_buffer=False)
    sync.push()  # the first round compiles
    blocking = [sync.push().seconds for _ in range(rounds)]
    sync.close()
    sync = _sync(trainers, engine, double_buffer=True)
    sync.push()
    out: dict[str, list[float]] = {"idle": idle, "blocking": blocking, "during": [], "transfer": [], "commit": []}
    out["commit_call"] = []
    for _ in range(rounds):
        staged = sync.stage()
        out["during"].append(generated / _generate(engine, prompts, tokens))
        start = time.perf_counter()
        stats = staged.commit()
        out["commit_call"].append(time.perf_counter() - start)
        out["transfer"].append(stats.seconds)
        out["commit"].append(stats.commit_seconds)
    generation = (prompts, dict(max_tokens=tokens, temperature=0.0, ignore_eos=True), None)
    mid = [commit_mid_generation(sync, engine.ranks, generation) for _ in range(rounds)]
    out["mid_stall"] = [m["stall_s"] for m in mid]
    out["mid_step"] = [m["step_s"] for m in mid]
    out["mid_during"] = [generated / m["generation_s"] for m in mid]
    out["mid_between"] = [float(m["between_steps"]) for m in mid]
    out["ray_call"] = ray_call_floor(engine, 10 * rounds)
    if profile:
        profile_commits(sync, engine, trainers, rounds, lambda: _generate(engine, prompts, tokens))
    sync.close()
    return out


def ray_call_floor(engine: VllmEngine, calls: int) -> list[float]:
    """Seconds of `calls` Ray calls that do nothing (`_rl_sync_ping`) into every engine rank at once,
    from the driver: what any commit step, itself such a call from the coordinator, costs at least."""
    seconds = []
    for _ in range(calls):
        start = time.perf_counter()
        ray.get([rank._rl_sync_ping.remote() for rank in engine.ranks], timeout=60)
        seconds.append(time.perf_counter() - start)
    return seconds


def profile_commits(sync: WeightSync, engine: VllmEngine, trainers, rounds: int, generate) -> None:
    """`rounds` staged rounds, each staged and generated beside, then its commit timed inside
    the actors (`round_profile`); prints each part's time per actor and the median commit's
    timeline."""
    actors = {f"trainer {i}": t for i, t in enumerate(trainers)}
    actors.update({f"engine rank {i}": r for i, r in enumerate(engine.ranks)})

    def staged():
        round_ = sync.stage()
        generate()
        return round_

    calls = round_profile.timed_calls(actors, rounds, lambda round_: round_.commit().commit_seconds, staged)
    round_profile.report(calls, "StagedRound.commit()", what="commit step", nested=4)


def run(args) -> tuple[dict, int]:
    config, options = _config(args.layers, args.device), placement(args)
    trainers = start_trainers(args, config, options)
    state = ray.get([t.full_state.remote() for t in trainers])[0]
    params = sum(v.numel() for v in state.values())
    path = scratch_checkpoint("rl-sync-staged-", config, state)
    del state
    engine = _engine(path, args.tp, args.device, args.cuda_graphs, options)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(args.prompts)]
    try:
        return measure(engine, trainers, args.rounds, prompts, args.tokens, args.profile), params
    finally:
        engine.shutdown()
        for t in trainers:
            ray.kill(t)


def _median(values: list[float]) -> float:
    return statistics.median(values)


def show(args, result: dict, params: int) -> None:
    table = Table(
        title=f"vLLM TP{args.tp} ({args.device}{', CUDA graphs' if args.cuda_graphs else ''}"
        f"{', colocated: CUDA IPC' if args.colocate else ''}), Qwen2-0.5B shapes x "
        f"{args.layers} layers ({params / 1e6:.0f}M parameters), {args.trainers} FSDP2 trainers; "
        f"{args.prompts} prompts x {args.tokens} tokens; medians of {args.rounds}"
    )
    for column in ("what", "value"):
        table.add_column(column)
    blocking, commit = _median(result["blocking"]), _median(result["commit"])
    rows = [
        ("generation, idle (tokens/s)", f"{_median(result['idle']):.1f}"),
        ("generation during a staged round (tokens/s)", f"{_median(result['during']):.1f}"),
        ("blocking round, push() without double buffering (s): the engine's stall", f"{blocking:.3f}"),
        ("staged round's transfer, slowest rank (s), beside generation", f"{_median(result['transfer']):.3f}"),
        ("staged round's commit step (s): the engine's stall", f"{commit:.4f}"),
        ("StagedRound.commit() on the driver (s)", f"{_median(result['commit_call']):.4f}"),
        (
            "a Ray call doing nothing into every engine rank (s): a commit step's floor",
            f"{_median(result['ray_call']):.4f}",
        ),
        ("stall: commit against blocking round", f"{commit / blocking:.1%}"),
    ]
    stall = _median(result["mid_stall"])
    rows += [
        ("committed mid-generation: commit step (s)", f"{_median(result['mid_step']):.4f}"),
        ("... the engine's stall, between two steps (s)", f"{stall:.5f}"),
        ("... commits made between two steps (every rank: one)", f"{sum(result['mid_between']):.0f} of {args.rounds}"),
        (
            "... generation with the round staged and committed beside it (tokens/s)",
            f"{_median(result['mid_during']):.1f}",
        ),
        ("stall: mid-generation commit against blocking round", f"{stall / blocking:.1%}"),
    ]
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    print({k: [round(v, 4) for v in values] for k, values in result.items()})


def defaults(parser: argparse.ArgumentParser, args) -> None:
    """Fill in what depends on the device (TP size, trainers), check `--colocate`, then start Ray
    on loopback."""
    gpu = args.device == "cuda"
    args.tp = args.tp or (1 if gpu else 2)
    args.trainers = args.trainers or (args.tp if getattr(args, "colocate", False) else 1 if gpu else 2)
    if getattr(args, "colocate", False) and not (gpu and args.trainers == args.tp):
        parser.error(
            f"--colocate puts trainer i and engine rank i on GPU i: it needs --device cuda and as many "
            f"trainers as engine ranks (got --device {args.device}, {args.trainers} trainers, TP{args.tp})"
        )
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join(sys.path)}},
        num_cpus=None if gpu else 8,
    )


def parser_of(doc: str | None) -> argparse.ArgumentParser:
    """The arguments this benchmark shares with `elastic_bench.py` (model, rounds, placement)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=None, help="default: 2 on CPUs, 1 on GPUs")
    parser.add_argument("--trainers", type=int, default=None, help="default: 2 on CPUs, 1 on GPUs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = parser_of(__doc__)
    parser.add_argument("--cuda-graphs", action="store_true", help="GPU: leave vLLM's CUDA graphs on")
    parser.add_argument("--colocate", action="store_true", help="GPU: trainer i and engine rank i share GPU i")
    parser.add_argument("--prompts", type=int, default=None, help="default: 4 on CPUs, 64 on GPUs")
    parser.add_argument("--tokens", type=int, default=None, help="default: 64 on CPUs, 512 on GPUs")
    parser.add_argument("--profile", action="store_true", help="then time the parts of more commits inside the actors")
    args = parser.parse_args(argv)
    args.prompts = args.prompts or (64 if args.device == "cuda" else 4)
    args.tokens = args.tokens or (512 if args.device == "cuda" else 64)
    positions = _llm_kwargs(args.device, args.cuda_graphs)["max_model_len"]
    if PROMPT_TOKENS + args.tokens > positions:
        parser.error(
            f"--tokens {args.tokens}: the engine serves {positions} positions on {args.device}, "
            f"{PROMPT_TOKENS}-token prompts leave room for {positions - PROMPT_TOKENS} tokens"
        )
    defaults(parser, args)
    ray.cloudpickle.register_pickle_by_value(round_profile)
    result, params = run(args)
    show(args, result, params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
