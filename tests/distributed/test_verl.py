"""rl-sync as verl's `rl_sync` checkpoint engine, driven in the order verl's manager drives it.

verl (0.9) is not among rl-sync's test dependencies (its pins would replace
the `transformers` vLLM runs with): these tests run where it imports. Each
actor and rollout rank is a thread here (rl-sync's Gloo groups are per
object), built through verl's own registry after verl's own plugin import
(`custom_backend_module`), and called as `CheckpointEngineManager.update_weights`
calls them: `prepare` on all, `build_topology`, `init_process_group`, the
actors' `send_weights` with the rollout ranks' `receive_weights` at once,
`finalize`. Ray is not needed: the manager's Ray worker groups only carry
these calls."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("verl.checkpoint_engine", reason="verl is not installed")

from verl.checkpoint_engine import CheckpointEngine, CheckpointEngineRegistry
from verl.utils.import_utils import import_external_libs

ACTORS, ROLLOUT = 2, 2
SHAPES = {"embed.weight": (64, 32), "layers.0.proj.weight": (48, 32), "norm.weight": (32,)}
LOOPBACK = dict(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", init_timeout_s=30.0, round_timeout_s=30.0)


def _engines(**sync):
    """The engines verl builds: actors with `is_master` on rank 0, rollout ranks without."""
    import_external_libs("actors.verl")
    cls = CheckpointEngineRegistry.get("rl_sync")
    assert issubclass(cls, CheckpointEngine)
    actors = [
        CheckpointEngineRegistry.new("rl_sync", is_master=r == 0, bucket_size=1 << 12, **LOOPBACK, **sync)
        for r in range(ACTORS)
    ]
    rollout = [CheckpointEngineRegistry.new("rl_sync", bucket_size=1 << 12, **LOOPBACK, **sync) for _ in range(ROLLOUT)]
    return cls, actors, rollout


def _connect(cls, actors, rollout) -> None:
    metadata = [e.prepare() for e in actors + rollout]
    actor_kwargs, rollout_kwargs = cls.build_topology(ACTORS, ROLLOUT, metadata)
    for engines, kwargs in ((actors, actor_kwargs), (rollout, rollout_kwargs)):
        for i, engine in enumerate(engines):
            engine.init_process_group(**{k: v[i] for k, v in kwargs.items()})


async def _received(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() async for name, tensor in engine.receive_weights(global_steps=None)}


def _update(cls, actors, rollout, weights: dict[str, torch.Tensor]):
    """One `update_weights` of verl's manager: every rank at once; returns actor 0's metrics and
    what each rollout rank yielded."""
    _connect(cls, actors, rollout)
    with ThreadPoolExecutor(ACTORS + ROLLOUT) as pool:
        sends = [pool.submit(asyncio.run, a.send_weights(iter(dict(weights).items()))) for a in actors]
        receives = [pool.submit(asyncio.run, _received(r)) for r in rollout]
        metrics, got = sends[0].result(timeout=120), [f.result(timeout=120) for f in receives]
        [f.result(timeout=120) for f in sends]
    for engine in actors + rollout:
        engine.finalize()
    return metrics, got


def _close(actors, rollout) -> None:
    with ThreadPoolExecutor(ACTORS + ROLLOUT) as pool:
        [f.result(timeout=60) for f in [pool.submit(e.close) for e in actors + rollout]]


@pytest.mark.parametrize("mode", ["m2n", "sparse"])
def test_every_update_lands_bit_exactly_on_every_rollout_rank(mode):
    """Three updates; the whole tensors verl's generator yields are sent in parts by both actor
    ranks; sparse updates after the first send only what changed."""
    cls, actors, rollout = _engines(mode=mode)
    gen = torch.Generator().manual_seed(0)
    weights = {n: torch.randn(s, generator=gen).to(torch.bfloat16) for n, s in SHAPES.items()}
    dense = sum(t.numel() * t.element_size() for t in weights.values())
    try:
        for step in range(1, 4):
            if step > 1:
                weights = {n: t.clone() for n, t in weights.items()}
                weights["layers.0.proj.weight"][step, :4] += 1.0
            metrics, got = _update(cls, actors, rollout, weights)
            for r, received in enumerate(got):
                assert received.keys() == weights.keys(), f"rollout rank {r}"
                for name, tensor in weights.items():
                    assert torch.equal(received[name], tensor), f"step {step}: rollout rank {r}, {name}"
            assert metrics["rl_sync/version"] == step
            if mode == "m2n" or step == 1:
                assert metrics["rl_sync/sent_bytes"] == ROLLOUT * dense, "every byte once to every rollout rank"
            else:
                assert metrics["rl_sync/sent_bytes"] < dense, f"step {step}: a sparse update sent {metrics}"
    finally:
        _close(actors, rollout)


def test_a_changed_topology_is_refused_naming_both():
    cls, actors, rollout = _engines()
    try:
        _update(cls, actors, rollout, {"w": torch.ones(8)})
        with pytest.raises(ValueError, match=r"joined as \('worker', 0, 2, 2\).*now asked \('worker', 0, 2, 3\)"):
            master = actors[0].prepare()
            rollout[0].init_process_group(side="worker", rank=0, trainers=2, workers=3, master=master)
    finally:
        _close(actors, rollout)


def test_topology_without_a_master_names_the_fix():
    cls, _, rollout = _engines()
    with pytest.raises(ValueError, match="must be built with is_master=True on rank 0"):
        cls.build_topology(1, 2, [e.prepare() for e in rollout])
