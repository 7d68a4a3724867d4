"""LoRA rounds into vLLM's CUDA build: an FSDP2 trainer with a PEFT adapter and a TP1 engine with
LoRA sharing one GPU, so the adapter's rounds go through CUDA IPC into the engine's LoRA slot.

After each of three AdamW steps on the adapter and push, the engine generating with the group's
adapter must generate exactly what it generates with the adapter PEFT saved that step (loaded by
vLLM's own loader into its other slot): greedy token ids and their log-probabilities. Each round
moves the adapter's bytes only (lora_A and lora_B whole in bf16, at TP1). The TP2 layout (lora_A
or lora_B sharded) is `tests/distributed/test_lora.py`'s, on CPUs; two GPUs are needed for it
here. Skipped without CUDA like every test in `tests/gpu`."""

from __future__ import annotations

import pytest
import ray
import torch

from actors import WeightSync
from actors.cluster import free_init_url
from actors.models import HFTrainer
from rl_sync.config.lora import LoraSpec
from rl_sync.config.sync import SyncConfig
from rl_sync.vllm.checkpoint import write_checkpoint
from tests.distributed.vllm_oracle import PROMPTS, SAMPLING

from .pairs import CONFIG
from .vllm_gpu import GPU_SHARE, LLM_KWARGS, config, launch

pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=8, lora_alpha=24, target_modules=TARGETS)
"""Scaling 3: vLLM folds it into lora_B in bf16, so the round's scaling must match it."""
ENGINE_LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
SPEC = LoraSpec(name="policy", lora_id=1, rank=8, alpha=24)
TOKENS = torch.randint(0, 1024, (4, 16), generator=torch.Generator().manual_seed(0))


def _lora_trainer():
    Trainer = ray.remote(HFTrainer).options(num_gpus=GPU_SHARE, num_cpus=0.5)
    actor = Trainer.remote(0, 1, config("qwen2"), free_init_url("127.0.0.1"), 0, 0.1, "float32", "cuda", LORA)
    ray.get(actor.call.remote(lambda self: None), timeout=300)
    return actor


def test_lora_rounds_through_cuda_ipc_generate_what_the_engine_loading_the_saved_adapter_does(gpu_ray, tmp_path):
    trainer, engine, sync = _lora_trainer(), None, None
    try:
        base = ray.get(trainer.base_state.remote(), timeout=120)
        engine = launch(write_checkpoint(str(tmp_path / "base"), config("qwen2"), base), {**LLM_KWARGS, **ENGINE_LORA})
        sync = WeightSync.create([trainer], engine.ranks, SyncConfig(**CONFIG), lora=SPEC)
        assert sync.summary.cuda_ipc, "trainer and engine share the GPU: rounds go through CUDA IPC"
        sources = ray.get(trainer.call.remote(lambda self: self.rl_sync_sources()), timeout=120)
        adapter_bytes = sum(t.numel() * 2 for t in sources.values())
        assert list(sync.summary.kept_bytes) == [adapter_bytes], "TP1: the whole adapter in bf16"
        untrained = engine.generate(PROMPTS, **SAMPLING)
        for step in range(1, 4):
            ray.get(trainer.train_step.remote(TOKENS, 2e-2), timeout=120)
            stats = sync.push()
            assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == [adapter_bytes], f"step {step}"
            saved = str(tmp_path / f"step{step}")
            ray.get(trainer.save_adapter.remote(saved), timeout=120)
            loaded = LoraSpec(name=f"saved-{step}", lora_id=100 + step, rank=8, alpha=24, path=saved).request()
            want = engine.generate(PROMPTS, lora_request=loaded, **SAMPLING)
            got = engine.generate(PROMPTS, lora_request=sync.lora_request("policy"), **SAMPLING)
            assert got == want, f"step {step}: the synced adapter generates otherwise than the saved one"
            assert [o["logprobs"] for o in got] != [o["logprobs"] for o in untrained], "the adapter matters"
            assert sync.versions() == [step]
    finally:
        if sync is not None:
            sync.close()
        if engine is not None:
            engine.shutdown()
        ray.kill(trainer)
