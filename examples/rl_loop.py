"""An RLlib-style RL loop that learns: GRPO on a tiny language model, weights synced every step.

A learner group (FSDP2-sharded `transformers` policy on two learner actors) and
an env-runner group (one tensor-parallel inference engine of two rollout
workers) split the work as RLlib's LearnerGroup / EnvRunner do. Each
iteration the env runners sample completions with the weights they hold, the
reward is how many tokens match a target pattern, the learners take a GRPO
step (group-relative advantages, policy gradient), and `WeightSync.push`
moves the new weights to the rollout workers (`auto`: sparse where it pays).
The task: continue a random prompt token by counting up (`t, t+1, t+2, ...`
mod the vocabulary); the reward is the fraction of completion tokens that are
one more than the token before them. Every iteration logs the mean reward and
the weight version the rollouts used.

    python examples/rl_loop.py --config configs/rl_loop.yaml [key=value ...]
    ray job submit --working-dir . -- python examples/rl_loop.py --config configs/rl_loop.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Protocol, TypeVar

import ray
import torch

from actors import WeightSync
from actors.cluster import connect, free_init_url
from actors.demo import DemoModel
from actors.models import EngineWorker, HFTrainer, hf_config
from actors.placement import SyncPlacement
from rl_sync.config.load import load_config
from rl_sync.config.sync import SyncConfig
from rl_sync.models.config import Parallel

if __name__ != "__main__":  # imported (a test, a notebook): actors receive these functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """One RL run (see configs/rl_loop.yaml)."""

    model: DemoModel = field(
        default_factory=lambda: DemoModel(
            vocab_size=16,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
    )
    learners: int = 2
    tensor_parallel: int = 2
    iterations: int = 60
    prompts: int = 8
    """Prompts per iteration; each gets `group` samples (GRPO)."""
    group: int = 8
    length: int = 6
    """Completion tokens per sample."""
    lr: float = 1e-2
    temperature: float = 1.0
    mode: str = "auto"
    """Sync mode of every push."""
    seed: int = 0
    cpus_per_actor: float = 0.25
    sync: SyncConfig = field(default_factory=lambda: SyncConfig(transport="gloo"))


def generate(worker, prompts: torch.Tensor, length: int, seed: int, temperature: float) -> dict:
    """Inside every rollout worker of an engine (same arguments): sample `length` tokens."""
    gen = torch.Generator().manual_seed(seed)
    tokens = prompts
    for _ in range(length):
        logits = worker.forward(tokens)[:, -1] / temperature
        tokens = torch.cat([tokens, torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)], dim=1)
    return {"tokens": tokens, "version": worker._rl_sync_version_of()}


def grpo_step(learner, tokens: torch.Tensor, advantages: torch.Tensor, prompt_len: int, lr: float) -> float:
    """Inside every learner (collective): policy gradient on this rank's half of the batch."""
    if learner.optimizer is None:
        learner.optimizer = torch.optim.AdamW(learner.model.parameters(), lr=lr)
    part = torch.arange(tokens.shape[0]) % learner.size == learner.rank
    tokens, advantages = tokens[part], advantages[part]
    logits = learner.model(tokens[:, :-1]).logits[:, prompt_len - 1 :]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)
    loss = -(advantages[:, None] * logp).mean()
    learner.optimizer.zero_grad()
    loss.backward()
    learner.optimizer.step()
    return loss.item()


class LearnerSettings(Protocol):
    """What `LearnerGroup` reads of a loop's config (`LoopConfig`, `rl_loop_vllm.VllmLoopConfig`)."""

    @property
    def model(self) -> DemoModel: ...

    @property
    def learners(self) -> int: ...

    @property
    def seed(self) -> int: ...


class LearnerGroup:
    """The learners: one FSDP2 policy sharded over `n` actors."""

    def __init__(self, cfg: LearnerSettings, placement: SyncPlacement, url: str):
        Learner = ray.remote(HFTrainer)
        config = hf_config(asdict(cfg.model)).to_dict()
        self.actors = [
            Learner.options(**placement.trainer(i)).remote(i, cfg.learners, config, url, seed=cfg.seed)
            for i in range(cfg.learners)
        ]

    def update(self, tokens: torch.Tensor, advantages: torch.Tensor, prompt_len: int, lr: float) -> float:
        return ray.get([a.call.remote(grpo_step, tokens, advantages, prompt_len, lr) for a in self.actors])[0]


class EnvRunnerGroup:
    """The rollout side: one inference engine of `tensor_parallel` workers sampling together."""

    def __init__(self, cfg: LoopConfig, placement: SyncPlacement, url: str):
        Worker = ray.remote(EngineWorker)
        self.par = Parallel(tp=cfg.tensor_parallel)
        config = hf_config(asdict(cfg.model)).to_dict()
        self.actors = [
            Worker.options(**placement.worker(0, t)).remote(t, self.par, config, url)
            for t in range(cfg.tensor_parallel)
        ]

    def sample(self, prompts: torch.Tensor, length: int, seed: int, temperature: float) -> dict:
        return ray.get([a.call.remote(generate, prompts, length, seed, temperature) for a in self.actors])[0]


def rewards(tokens: torch.Tensor, length: int, vocab: int) -> torch.Tensor:
    """Fraction of the last `length` tokens that are one more (mod `vocab`) than the token before."""
    previous, current = tokens[:, -length - 1 : -1], tokens[:, -length:]
    return (current == (previous + 1) % vocab).float().mean(dim=1)


def train(cfg: LoopConfig, log=print) -> list[dict]:
    """Run the loop on the connected Ray cluster; one record per iteration."""
    host = cfg.sync.rendezvous_host or ray.util.get_node_ip_address()
    placement = SyncPlacement.create(cfg.learners, 1, cfg.tensor_parallel, cpus=cfg.cpus_per_actor)
    learners = LearnerGroup(cfg, placement, free_init_url(host))
    runners = EnvRunnerGroup(cfg, placement, free_init_url(host))
    history = []
    try:
        sync = WeightSync.create(learners.actors, runners.actors, cfg.sync)
        sync.push(mode=cfg.mode)
        gen = torch.Generator().manual_seed(cfg.seed)
        for it in range(1, cfg.iterations + 1):
            prompts = torch.randint(0, cfg.model.vocab_size, (cfg.prompts, 1), generator=gen).repeat_interleave(
                cfg.group, 0
            )
            batch = runners.sample(prompts, cfg.length, cfg.seed * 100_000 + it, cfg.temperature)
            reward = rewards(batch["tokens"], cfg.length, cfg.model.vocab_size)
            grouped = reward.view(cfg.prompts, cfg.group)
            advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)
            loss = learners.update(batch["tokens"], advantages, prompts.shape[1], cfg.lr)
            stats = sync.push(mode=cfg.mode)
            record = {
                "iteration": it,
                "reward": round(reward.mean().item(), 4),
                "loss": round(loss, 4),
                "rollout_version": batch["version"],
                "learner_version": stats.version,
                "sync_mode": stats.mode,
                "sync_bytes": stats.sent_bytes,
                "sync_s": round(stats.seconds, 4),
            }
            history.append(record)
            log(json.dumps(record))
        sync.close()
    finally:
        for actor in learners.actors + runners.actors:
            ray.kill(actor)  # type: ignore[arg-type]  # Ray's ActorProxy
        placement.remove()
    return history


C = TypeVar("C")
"""A loop's config type."""


def run(
    argv: list[str] | None, doc: str, config_type: type[C], train_loop: Callable[[C], list[dict]], example: str
) -> int:
    """The command line both loops share: `--config FILE [key=value ...] [--address ADDR]`, train,
    then print the mean reward over the first and last fifth of the iterations."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help=f"YAML file, e.g. {example}")
    parser.add_argument("--address", default=None, help="Ray cluster (default: RAY_ADDRESS, else local)")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_config(args.config, config_type, overrides)
    connect(args.address)
    history = train_loop(cfg)
    first, last = history[: max(1, len(history) // 5)], history[-max(1, len(history) // 5) :]
    start, end = (sum(r["reward"] for r in h) / len(h) for h in (first, last))
    print(f"mean reward: first {len(first)} iterations {start:.3f}, last {len(last)} iterations {end:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(argv, __doc__, LoopConfig, train, "configs/rl_loop.yaml")


if __name__ == "__main__":
    sys.exit(main())
