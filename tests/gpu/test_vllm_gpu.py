"""An FSDP2 trainer into vLLM's CUDA build, sharing one GPU with the engine (CUDA IPC), checked
against vLLM itself.

After each of three AdamW steps and pushes, the synced engine must hold, bit for bit, every live
parameter a fresh engine holds after loading the trainer's checkpoint with the same settings, and
generate the same greedy tokens with the same log-probabilities (prefix caching on, so a prefix
cached before an update would show). Cases: bf16 with CUDA graphs (which capture the parameters'
addresses) and sparse / auto rounds; a MoE model through the engine-as-service path (vLLM's own
worker process); vLLM's online FP8 (the engine quantizes what rl-sync writes into its loader-form
buffers); a block-FP8 checkpoint (rl-sync's trainer quantizes, and must send exactly what vLLM's
`per_block_cast_to_fp8` wrote); and sleep mode (the CuMem allocator), the engine sleeping while the
trainer steps and waking before each push; and staged rounds (double buffering, CUDA graphs off),
each committed by swapping the engine's parameters with the shadows the trainer wrote, between
two generations or between two steps of one.

Needs CUDA and vLLM's CUDA build (`../shared/tools/gpu-vllm-kit.sh` on the offline GPU machine;
`pip install vllm` elsewhere); skipped without CUDA like every test in `tests/gpu`."""

from __future__ import annotations

import time

import pytest
import ray
import torch

from actors import WeightSync
from rl_sync.config.sync import SyncConfig
from rl_sync.rank.steps import CONTROL_GROUP
from rl_sync.vllm.checkpoint import write_checkpoint

from .pairs import CONFIG
from .vllm_gpu import (
    CUDA_GRAPHS,
    LLM_KWARGS,
    config,
    differing,
    fresh,
    launch,
    launch_service,
    outputs_and_params,
    trainer,
    write_block_fp8,
)

TOKENS = torch.randint(0, 1024, (4, 16), generator=torch.Generator().manual_seed(0))


def _unrelated(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Values of the right shapes unrelated to the trainer's (the engine's first weights)."""
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in state.items()}


def _sleep_and_wake(rank, trainer_actor) -> None:
    """The colocated loop of sleep mode: the engine sleeps (weights offloaded, GPU memory
    released) while the trainer steps, and wakes (its memory mapped again) before the push."""
    ray.get(rank.call.remote(lambda self: self.llm.sleep(level=1)), timeout=120)
    ray.get(trainer_actor.train_step.remote(TOKENS, 1e-2), timeout=120)
    ray.get(rank.call.remote(lambda self: self.llm.wake_up()), timeout=120)


SPARSE = [("sparse", "m2n"), ("sparse", "sparse"), ("auto", "auto")]
"""(asked, ran) per step: a sparse round first runs dense, filling the baselines later ones diff against."""
DENSE = [("m2n", "m2n")] * 3
AFTER_WAKING = [("sparse", "m2n")] * 3
"""A woken engine's memory was mapped anew: the round after carries every tensor, dense."""


def _addresses(actor) -> dict[str, int]:
    return actor.llm.apply_model(lambda model: {n: p.data_ptr() for n, p in model.named_parameters()})[0]


def _between_steps(rank_self) -> tuple[bool, int]:
    """Whether the engine has requests, and its commits made between two steps."""
    return rank_self.llm.llm_engine.has_unfinished_requests(), rank_self._rl_sync_steps().between_steps


def _staged(sync, engine, asked: str, during: bool = False):
    """A staged round, generation beside it on the version the engine holds, then its commit
    (`during`: while a generation runs, so it lands between two of its steps); checks the commit
    swapped every parameter the round wrote (they all moved)."""
    rank = engine.ranks[0]
    control = rank.call.options(concurrency_group=CONTROL_GROUP)
    before = ray.get(rank.call.remote(_addresses), timeout=120)
    staged = sync.stage(mode=asked)
    if not during:
        engine.generate([[1, 2, 3]], max_tokens=8, temperature=0.0)
        stats = staged.commit()
    else:
        made = ray.get(control.remote(_between_steps), timeout=60)[1]
        running = rank.generate.remote([[1, 2, 3]] * 16, dict(max_tokens=400, temperature=0.0, ignore_eos=True), None)
        deadline = time.monotonic() + 60
        while not ray.get(control.remote(_between_steps), timeout=60)[0]:
            assert time.monotonic() < deadline, "the generation never started"
        stats = staged.commit()
        assert not ray.wait([running], timeout=0)[0], "the generation went on after the commit"
        ray.get(running, timeout=120)
        assert ray.get(control.remote(_between_steps), timeout=60)[1] == made + 1, "made between two steps"
    after = ray.get(rank.call.remote(_addresses), timeout=120)
    kept = [n for n in before if after[n] == before[n]]
    assert kept == [], f"the commit swapped every parameter, not {kept[:4]}"
    return stats


@pytest.mark.parametrize(
    "family, trainer_dtype, llm, host, checkpoint, rounds",
    [
        pytest.param("qwen2", "float32", CUDA_GRAPHS, "ranks", "bf16", SPARSE, id="bf16-graphs"),
        pytest.param("qwen3_moe", "float32", {}, "service", "bf16", DENSE, id="moe-service"),
        pytest.param("qwen2", "bfloat16", {"quantization": "fp8"}, "ranks", "bf16", SPARSE, id="fp8"),
        pytest.param("qwen2", "bfloat16", {}, "ranks", "block_fp8", SPARSE, id="block-fp8"),
        pytest.param("qwen2", "float32", {"enable_sleep_mode": True}, "ranks", "bf16", AFTER_WAKING, id="sleep"),
        pytest.param("qwen2", "float32", {}, "staged", "bf16", SPARSE, id="staged-swaps"),
        pytest.param("qwen2", "float32", {}, "staged-during", "bf16", SPARSE, id="staged-mid-generation"),
    ],
)
def test_synced_engine_holds_and_generates_what_fresh_engines_do(
    gpu_ray, tmp_path, family, trainer_dtype, llm, host, checkpoint, rounds
):
    hf, kwargs = config(family), {**LLM_KWARGS, **llm}
    write = write_block_fp8 if checkpoint == "block_fp8" else write_checkpoint
    t = trainer(family, trainer_dtype)
    engine = None
    try:
        state = ray.get(t.full_state.remote(), timeout=120)
        init = write(str(tmp_path / "init"), hf, _unrelated(state))
        engine = launch_service(init, kwargs) if host == "service" else launch(init, kwargs)
        workers = [engine] if host == "service" else engine.ranks
        staged = host.startswith("staged")
        sync = WeightSync.create([t], workers, SyncConfig(double_buffer=staged, **CONFIG))
        assert sync.summary.cuda_ipc, "trainer and engine share the GPU: rounds go through CUDA IPC"
        assert sync.summary.fallbacks == (), "every tensor binds"
        synced, paths = [], []
        for step, (asked, ran) in enumerate(rounds, start=1):
            if llm.get("enable_sleep_mode") and step > 1:
                _sleep_and_wake(engine.ranks[0], t)
            else:
                ray.get(t.train_step.remote(TOKENS, 1e-2), timeout=120)
            stats = _staged(sync, engine, asked, host == "staged-during") if staged else sync.push(mode=asked)
            assert stats.mode == ran, f"step {step}: asked {asked}, ran {stats.mode}"
            assert sync.versions() == [step]
            synced.append(outputs_and_params(engine))
            paths.append(write(str(tmp_path / f"step{step}"), hf, ray.get(t.full_state.remote(), timeout=120)))
        sync.close()
        *references, again = fresh([*paths, paths[-1]], kwargs)
        assert again[0] == references[-1][0], "two fresh engines on one checkpoint generate differently"
        for step, ((got, params), (want, want_params)) in enumerate(zip(synced, references), start=1):
            assert differing(params, want_params) == [], f"step {step}: parameters differ from a fresh engine's"
            assert got == want, f"step {step}: generations differ from a fresh engine's"
    finally:
        if engine is not None:
            engine.shutdown()
        ray.kill(t)
