"""Real models on both sides: FSDP2 `transformers` trainers into the TP inference model.

After a sync, every bound tensor is bit-exact and the inference model's logits
match the trainer model's (fp32); dense GQA and MoE, TP 1/2/4 (4 > KV heads),
pipeline stages, expert parallelism, two engines, and the fallback hook."""

from __future__ import annotations

import pytest
import ray
import torch

transformers = pytest.importorskip("transformers")

from actors import WeightSync  # noqa: E402
from actors.cluster import free_init_url  # noqa: E402
from actors.models import EngineWorker, HFTrainer  # noqa: E402
from rl_sync.bind.binder import NO_RULE  # noqa: E402
from rl_sync.models.config import Parallel  # noqa: E402

from .conftest import loopback_config  # noqa: E402
from .harness import POOL  # noqa: E402

Trainer = ray.remote(num_cpus=0.1)(HFTrainer)
Worker = ray.remote(num_cpus=0.1)(EngineWorker)

SMALL = dict(
    vocab_size=120,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _url() -> str:
    return free_init_url("127.0.0.1")


def _bound(actor) -> dict:
    out = {}
    for name, endpoint in actor._rl_sync_endpoints("worker").items():
        out[name] = (endpoint.origin, tuple(endpoint.tensor.shape), endpoint.tensor.detach().clone())
    return out


def _drop_fallbacks(actor, pairs):
    actor.state_received = [name for name, _ in pairs]


def _forward(workers, par: Parallel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Logits of every engine: each stage's TP ranks run together, hidden states passed on."""
    outputs = []
    for e in range(par.engines):
        x = tokens
        for s in range(par.pp):
            ranks = [par.rank(e, s, t) for t in range(par.tp)]
            x = ray.get([workers[r].forward.remote(x) for r in ranks])[0]
        outputs.append(x)
    return outputs


@pytest.mark.parametrize(
    "family, par",
    [
        ("qwen3", Parallel(tp=1)),
        ("qwen3", Parallel(tp=2)),
        ("llama", Parallel(tp=4)),
        ("qwen2", Parallel(engines=2, tp=2)),
        ("qwen3", Parallel(pp=2, tp=2)),
        ("qwen3_moe", Parallel(tp=2, ep=True)),
        ("mixtral", Parallel(engines=2, tp=2, ep=True)),
    ],
)
def test_synced_inference_model_matches_the_trainer(ray_session, family, par):
    extra = {
        "qwen3": dict(head_dim=4, tie_word_embeddings=True),
        "qwen2": {},
        "llama": {},
        "qwen3_moe": dict(head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    }[family]
    config = transformers.AutoConfig.for_model(family, **SMALL, **extra).to_dict()
    url, wurl = _url(), _url()
    trainers = POOL.take(Trainer, [(i, 2, config, url) for i in range(2)])
    workers = POOL.take(Worker, [(r, par, config, wurl) for r in range(par.size)])
    try:
        sync = WeightSync.create(trainers, workers, loopback_config())
        stats = sync.push()
        assert sync.summary.fallbacks == () and sum(r.fallbacks for r in stats.ranks) == 0
        full = ray.get([t.full_state.remote() for t in trainers])[0]
        for rank, bound in enumerate(ray.get([w.call.remote(_bound) for w in workers])):
            live_bytes = 0
            for name, (origin, shape, value) in bound.items():
                want = full[name][tuple(slice(o, o + s) for o, s in zip(origin, shape))]
                assert torch.equal(value, want), f"worker {rank}: {name} is not bit-exact"
                live_bytes += value.numel() * value.element_size()
            received = next(r.received_bytes for r in stats.ranks if r.rank == 2 + rank)
            assert received == live_bytes, (
                f"worker {rank} received {received} bytes for {live_bytes} bytes of live shards"
            )
        tokens = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
        reference = ray.get([t.logits.remote(tokens) for t in trainers])[0]
        for logits in _forward(workers, par, tokens):
            torch.testing.assert_close(logits, reference, rtol=1e-4, atol=1e-4)
        sync.close()
    finally:
        POOL.give_back(Trainer, trainers)
        POOL.give_back(Worker, workers)


def test_tensors_no_rule_binds_go_through_the_load_hook(ray_session):
    config = transformers.AutoConfig.for_model(
        "qwen3_moe", **SMALL, head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    ).to_dict()
    url, wurl = _url(), _url()
    trainers = POOL.take(Trainer, [(i, 2, config, url) for i in range(2)])
    par = Parallel(tp=2, ep=False)
    workers = POOL.take(Worker, [(r, par, config, wurl, (), _drop_fallbacks) for r in range(par.size)])
    try:
        sync = WeightSync.create(trainers, workers, loopback_config())
        assert sync.summary.fallbacks == (
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.1.mlp.experts.gate_up_proj",
        )
        assert sync.summary.fallback_reasons == {NO_RULE: sync.summary.fallbacks}
        stats = sync.push()
        assert [r.fallbacks for r in stats.ranks if r.role == "worker"] == [2, 2]
        assert ray.get(workers[0].call.remote(lambda self: self.state_received)) == list(sync.summary.fallbacks)
        full = ray.get([t.full_state.remote() for t in trainers])[0]
        got = ray.get(
            workers[1].call.remote(
                lambda self: self._rl_sync_endpoints("worker")["model.layers.1.mlp.experts.gate_up_proj"].tensor
            )
        )
        assert torch.equal(got, full["model.layers.1.mlp.experts.gate_up_proj"])
        sync.close()
    finally:
        POOL.give_back(Trainer, trainers)
        POOL.give_back(Worker, workers)
