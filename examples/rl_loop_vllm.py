"""GRPO with rollouts from a real vLLM engine (TP2, ranks as Ray actors), weights pushed every step.

The same task and learners as `examples/rl_loop.py` (FSDP2 `transformers`
policy on two learner actors learning to count: continue a random token with
`t, t+1, t+2, ...` mod the vocabulary), but the env runners are the tensor-
parallel ranks of a vLLM engine: each iteration samples a group of
completions per prompt with `SamplingParams(n=group)`, the learners take a
GRPO step, and `WeightSync.push` writes the new weights straight into vLLM's
live parameters (and vLLM's loader-form buffers where vLLM repacks them),
resetting the engine's prefix cache. The engine starts from the learners'
initial weights, written once to a checkpoint directory. Every iteration logs
the mean reward and the weight version the rollouts used.

    python examples/rl_loop_vllm.py --config configs/rl_loop_vllm.yaml [key=value ...]
    ray job submit --working-dir . -- python examples/rl_loop_vllm.py --config configs/rl_loop_vllm.yaml
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import ray
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_loop import LearnerGroup, rewards, run

from actors import VllmEngine, WeightSync
from actors.cluster import free_init_url
from actors.demo import DemoModel
from actors.models import hf_config
from actors.placement import SyncPlacement
from rl_sync.config.sync import SyncConfig
from rl_sync.vllm.checkpoint import scratch_checkpoint

if __name__ != "__main__":  # imported (a test): actors receive these functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}


@dataclass(frozen=True, kw_only=True)
class VllmLoopConfig:
    """One RL run with vLLM rollouts (see configs/rl_loop_vllm.yaml)."""

    model: DemoModel = field(
        default_factory=lambda: DemoModel(
            model_type="qwen2",
            vocab_size=16,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    learners: int = 2
    tensor_parallel: int = 2
    iterations: int = 40
    prompts: int = 8
    group: int = 8
    """Completions per prompt (GRPO's group)."""
    length: int = 6
    lr: float = 1e-2
    temperature: float = 1.0
    mode: str = "auto"
    seed: int = 0
    cpus_per_actor: float = 0.25
    llm: dict[str, Any] = field(
        default_factory=lambda: {
            "dtype": "bfloat16",
            "enforce_eager": True,
            "kv_cache_memory_bytes": 64 << 20,
            "max_model_len": 64,
        }
    )
    """Extra `vllm.LLM` arguments (the engine runs without a tokenizer on token-id prompts)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment of the engine's rank actors (e.g. GLOO_SOCKET_IFNAME)."""
    sync: SyncConfig = field(default_factory=lambda: SyncConfig(transport="gloo"))


def _hf_dict(model: DemoModel) -> dict:
    config = hf_config(asdict(model)).to_dict()
    return {**config, "architectures": [ARCHITECTURES[model.model_type]], "torch_dtype": "bfloat16"}


def sample(engine: VllmEngine, prompts: torch.Tensor, cfg: VllmLoopConfig, seed: int) -> torch.Tensor:
    """`group` completions of `length` tokens per prompt, as (prompts * group, 1 + length) token ids."""
    outputs = engine.generate(
        prompts.tolist(), n=cfg.group, max_tokens=cfg.length, temperature=cfg.temperature, seed=seed, ignore_eos=True
    )
    rows = [p + c for p, out in zip(prompts.tolist(), outputs) for c in out["samples"]]
    return torch.tensor(rows)


def train(cfg: VllmLoopConfig, log=print) -> list[dict]:
    """Run the loop on the connected Ray cluster; one record per iteration."""
    host = cfg.sync.rendezvous_host or ray.util.get_node_ip_address()
    placement = SyncPlacement.create(cfg.learners, 1, cfg.tensor_parallel, cpus=cfg.cpus_per_actor)
    learners = LearnerGroup(cfg, placement, free_init_url(host))
    engine, history = None, []
    try:
        state = ray.get([a.full_state.remote() for a in learners.actors])[0]
        path = scratch_checkpoint("rl-sync-policy-", _hf_dict(cfg.model), state)
        engine = VllmEngine.launch(
            path,
            tp=cfg.tensor_parallel,
            llm_kwargs={**cfg.llm, "skip_tokenizer_init": True},
            actor_options=[placement.worker(0, t) for t in range(cfg.tensor_parallel)],
            host=host,
            env=cfg.env,
        )
        sync = WeightSync.create(learners.actors, engine.ranks, cfg.sync)
        sync.push(mode=cfg.mode)
        gen = torch.Generator().manual_seed(cfg.seed)
        for it in range(1, cfg.iterations + 1):
            prompts = torch.randint(0, cfg.model.vocab_size, (cfg.prompts, 1), generator=gen)
            rollout_version = engine.versions()[0]
            tokens = sample(engine, prompts, cfg, cfg.seed * 100_000 + it)
            reward = rewards(tokens, cfg.length, cfg.model.vocab_size)
            grouped = reward.view(cfg.prompts, cfg.group)
            advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
            loss = learners.update(tokens, advantages, 1, cfg.lr)
            stats = sync.push(mode=cfg.mode)
            record = {
                "iteration": it,
                "reward": round(reward.mean().item(), 4),
                "loss": round(loss, 4),
                "rollout_version": rollout_version,
                "learner_version": stats.version,
                "sync_mode": stats.mode,
                "sync_bytes": stats.sent_bytes,
                "sync_s": round(stats.seconds, 4),
            }
            history.append(record)
            log(json.dumps(record))
        sync.close()
    finally:
        if engine is not None:
            engine.shutdown()
        for actor in learners.actors:
            ray.kill(actor)  # type: ignore[arg-type]  # Ray's ActorProxy
        placement.remove()
    return history


def main(argv: list[str] | None = None) -> int:
    return run(argv, __doc__, VllmLoopConfig, train, "configs/rl_loop_vllm.yaml")


if __name__ == "__main__":
    sys.exit(main())
