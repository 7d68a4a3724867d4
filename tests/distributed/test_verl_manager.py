"""verl's own `CheckpointEngineManager` moving weights with the `rl_sync` checkpoint engine.

Actor workers are verl `Worker`s in a `RayWorkerGroup`, as verl's FSDP workers are; rollout
workers are verl's own `CheckpointEngineWorker` (a subclass that can report what it loaded),
whose server adapter keeps the tensors verl hands it instead of feeding a served engine, and
the replicas around them only answer the manager's pause and resume calls (served engines need
GPUs). Everything else is verl's: the manager's `update_weights`, its worker groups and dispatch,
the engines built from the checkpoint-engine config through verl's registry and plugin import."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray
import torch

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed")

from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry
from verl.checkpoint_engine.base import CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs, RayWorkerGroup
from verl.utils.import_utils import import_external_libs
from verl.workers.config import CheckpointEngineConfig

from actors.cluster import free_init_url

ACTORS, ROLLOUT = 2, 2
SYNC = dict(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", init_timeout_s=60.0, round_timeout_s=60.0)
CONFIG = CheckpointEngineConfig(
    backend="rl_sync",
    update_weights_bucket_megabytes=1,
    engine_kwargs={"rl_sync": SYNC},
    custom_backend_module="actors.verl",
)


def _weights(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return {"embed.weight": torch.randn(64, 32, generator=gen), "norm.weight": torch.randn(32, generator=gen)}


class ActorWorker(Worker):
    """An actor rank as verl's workers build theirs: the engine from the config, `is_master` on rank 0."""

    def __init__(self):
        super().__init__()
        import_external_libs(CONFIG.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            CONFIG.backend,
            is_master=self.rank == 0,
            bucket_size=CONFIG.update_weights_bucket_megabytes << 20,
            **CONFIG.engine_kwargs[CONFIG.backend],
        )

    @register(dispatch_mode=Dispatch["ONE_TO_ALL"], blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto"):
        assert global_steps is not None, "the test's manager passes the step"
        return await self.checkpoint_engine.send_weights(iter(_weights(global_steps).items()), global_steps)

    @register(dispatch_mode=Dispatch["DP_COMPUTE"], blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class KeepingAdapter:
    """A server adapter that keeps what verl hands it."""

    def __init__(self):
        self.loaded: dict[str, torch.Tensor] = {}

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors"):
        async for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class RolloutWorker(CheckpointEngineWorker):
    """verl's rollout-side worker, its server adapter a `KeepingAdapter`."""

    def __init__(self, rollout_config, adapter: KeepingAdapter):
        no_model: Any = None  # verl reads the model config only to build a served engine
        server: Any = adapter  # verl types it as its BaseRollout; it only calls update_weights
        super().__init__(rollout_config, no_model, server)
        self.adapter = adapter

    def loaded(self) -> dict[str, torch.Tensor]:
        return self.adapter.loaded


class Replica:
    """A rollout replica: its checkpoint-engine workers; the manager's pause and resume calls do
    nothing here (no engine is served)."""

    def __init__(self, workers):
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume_generation(self) -> None: ...


def _env(rank: int, size: int, url: str) -> dict:
    host, port = url.removeprefix("tcp://").split(":")
    return {
        "runtime_env": {
            "env_vars": {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": host, "MASTER_PORT": port}
        }
    }


@pytest.fixture(scope="module")
def manager(ray_session):
    url = free_init_url("127.0.0.1")
    actors = [ray.remote(ActorWorker).options(num_cpus=0.1, **_env(r, ACTORS, url)).remote() for r in range(ACTORS)]
    rollout = [
        ray.remote(RolloutWorker)
        .options(num_cpus=0.1, **_env(0, 1, free_init_url("127.0.0.1")))
        .remote(SimpleNamespace(checkpoint_engine=CONFIG, name="vllm"), KeepingAdapter())
        for _ in range(ROLLOUT)
    ]
    actor_wg = RayWorkerGroup(
        worker_handles=actors, ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(ActorWorker))
    )
    yield CheckpointEngineManager(CONFIG, actor_wg, [Replica(rollout[:1]), Replica(rollout[1:])]), rollout
    for handle in actors + rollout:
        ray.kill(handle)


@pytest.mark.slow  # 2 to 3 min here, nearly all of it verl's first worker-group calls (rl-sync's part: ~1 s)
def test_verls_manager_updates_every_rollout_worker_bit_exactly(manager):
    checkpoint_engines, rollout = manager
    for step in (1, 2):
        metrics = checkpoint_engines.update_weights(global_steps=step)
        assert metrics["rl_sync/version"] == step
        for r, loaded in enumerate(ray.get([w.loaded.remote() for w in rollout], timeout=60)):
            want = _weights(step)
            assert loaded.keys() == want.keys(), f"rollout worker {r}"
            assert all(torch.equal(loaded[n], t) for n, t in want.items()), f"step {step}: rollout worker {r}"
