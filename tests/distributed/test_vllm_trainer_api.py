"""rl-sync selected through vLLM's trainer-side weight-transfer API, as a framework drives it.

The engine is a framework's Ray actor owning an `LLM` (TP2, vLLM's own worker
processes) built with `weight_transfer_config={"backend": "rl_sync"}`; two
FSDP2 trainer actors build their trainer engines with vLLM's factory
(`WeightTransferTrainerFactory.trainer_init`, vLLM's `RayVLLMWeightSyncClient`)
and call `send_weights()` after each AdamW step. Nothing in the loop calls
rl-sync: only the init info names it. After every step the engine must
generate exactly what a fresh engine on the trainers' checkpoint generates."""

from __future__ import annotations

import pytest
import ray
import torch

from actors.cluster import free_init_url
from actors.models import HFTrainer
from actors.service import VllmServiceActor
from rl_sync.lead.follower import LeaderClosed

from .conftest import loopback_config
from .harness import POOL
from .vllm_oracle import LLM_KWARGS, PROMPTS, SAMPLING, SERVICE_ENV, References, hf_config, write_checkpoint

TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
Trainer = ray.remote(num_cpus=0.1)(HFTrainer)


class FrameworkEngine(VllmServiceActor):
    """A framework's engine actor: vLLM's weight-sync calls (what `RayVLLMWeightSyncClient`
    calls), its prefix-cache reset and generation."""

    def init_weight_transfer_engine(self, request) -> None:
        self.llm.init_weight_transfer_engine(request)

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, request) -> None:
        self.llm.update_weights(request)

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()

    def reset_prefix_cache(self) -> bool:
        return self.llm.reset_prefix_cache()


def _trainer_init(trainer, engine, config, alter=None) -> None:
    """What a framework runs on each trainer rank at startup."""
    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient, WeightTransferTrainerFactory

    from rl_sync.vllm.trainer import RlSyncTrainerInitInfo, ShardedModuleSource

    source = ShardedModuleSource(trainer.model)
    if alter is not None:
        source = alter(source)
    info = RlSyncTrainerInitInfo(rank=trainer.rank, num_trainer_ranks=2, engine_ranks=2, sync=config)
    trainer.weight_transfer = WeightTransferTrainerFactory.trainer_init(
        info, client=RayVLLMWeightSyncClient(engine), source=source
    )


def _send(trainer, mode=None):
    trainer.weight_transfer.send_weights(mode)
    return trainer.weight_transfer.stats


def _shutdown(trainer) -> None:
    engine = getattr(trainer, "weight_transfer", None)
    trainer.weight_transfer = None
    if engine is not None:
        engine.shutdown()


@pytest.fixture(scope="module")
def framework(ray_session, tmp_path_factory):
    """The engine actor (on an unrelated checkpoint), its trainers, and a reference engine."""
    config = hf_config("qwen2")
    url = free_init_url("127.0.0.1")
    trainers = POOL.take(Trainer, [(i, 2, config, url) for i in range(2)])
    gen = torch.Generator().manual_seed(7)
    state = ray.get([t.full_state.remote() for t in trainers])[0]
    init = write_checkpoint(
        str(tmp_path_factory.mktemp("init")), config, {k: torch.randn(v.shape, generator=gen) for k, v in state.items()}
    )
    engine = (
        ray.remote(FrameworkEngine)
        .options(num_cpus=0.1, runtime_env={"env_vars": SERVICE_ENV})
        .remote(init, 2, LLM_KWARGS, SERVICE_ENV)
    )
    ray.get(engine._rl_sync_service_ping.remote(), timeout=600)  # the engine is up
    references = References()
    yield config, trainers, engine, references
    references.shutdown()
    ray.kill(engine)
    POOL.give_back(Trainer, trainers)


def test_trainer_api_rounds_match_a_fresh_engine_after_every_step(framework, tmp_path):
    """M2N first (dense, every tensor), then a sparse round asked for by `send_weights` (the group's
    mode is `auto`); each writes the engine's live weights at TP2, versions counting the steps."""
    config, trainers, engine, references = framework
    sync = loopback_config(bucket_bytes=1 << 18, mode="auto")
    ray.get([t.call.remote(_trainer_init, engine, sync) for t in trainers], timeout=300)
    try:
        summary = ray.get(trainers[0].call.remote(lambda t: t.weight_transfer.summary))
        assert summary.world_size == 4 and summary.transport == "gloo" and summary.fallbacks == ()
        for step, (mode, ran) in enumerate([(None, "m2n"), ("sparse", "sparse")], start=1):
            ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
            stats = ray.get([t.call.remote(_send, mode) for t in trainers], timeout=300)[0]
            ray.get(engine.reset_prefix_cache.remote())  # the framework's own step after a weight update
            assert (stats.version, stats.mode) == (step, ran), f"step {step}: {stats.mode} {stats.reason}"
            workers = sorted((r for r in stats.ranks if r.role == "worker"), key=lambda r: r.rank)
            assert [r.rank for r in workers] == [2, 3]
            if ran == "m2n":
                assert [r.received_bytes for r in workers] == list(summary.kept_bytes)
            state = ray.get([t.full_state.remote() for t in trainers])[0]  # collective: every trainer
            path = write_checkpoint(str(tmp_path / f"step{step}"), config, state)
            want = references.outputs(path, 2)
            assert ray.get(engine.generate.remote(PROMPTS, SAMPLING)) == want, f"step {step} differs"
    finally:
        ray.get([t.call.remote(_shutdown) for t in trainers], timeout=120)


def _extra_tensor(source):
    from rl_sync.vllm.trainer import ShardedModuleSource

    class Extra(ShardedModuleSource):
        def __iter__(self):
            yield from super().__iter__()
            yield "model.layers.0.mlp.bogus.weight", torch.zeros(4, 4)

    return Extra(source.module)


def test_a_checkpoint_the_engine_refuses_fails_trainer_init_on_every_rank(framework):
    """Rank 0 raises the engine ranks' `ValueError` naming the tensor; rank 1 is told the
    group is gone; the engine generates what it did before."""
    _, trainers, engine, _ = framework
    before = ray.get(engine.generate.remote(PROMPTS, SAMPLING))
    calls = [t.call.remote(_trainer_init, engine, loopback_config(), _extra_tensor) for t in trainers]
    with pytest.raises(ValueError, match=r"vLLM rank \d: checkpoint tensor 'model.layers.0.mlp.bogus.weight'"):
        ray.get(calls[0], timeout=300)
    with pytest.raises(LeaderClosed, match="trainer rank 0 closed the group"):
        ray.get(calls[1], timeout=300)
    assert ray.get(engine.generate.remote(PROMPTS, SAMPLING)) == before
