"""LoRA rounds: FSDP2 trainers with a PEFT adapter into a TP2 vLLM engine's LoRA slot.

After every AdamW step on the adapter and push, the engine generating with the group's
adapter must generate exactly what it generates with the adapter PEFT saved that step
(`save_pretrained`, loaded from disk by vLLM's own loader through a new `LoRARequest` into
its other slot; a LoRA group never writes the base weights, so the engine is the base
checkpoint as vLLM loaded it): greedy token ids and their log-probabilities. One engine,
started once for the module. Every round moves the adapter's bytes only:
each worker receives exactly the boxes of lora_A and lora_B its slot keeps. Bad input fails
`create` with an exact error before the engine's LoRA state is touched.
"""

from __future__ import annotations

import pytest
import ray
import torch

from actors import WeightSync
from actors.cluster import free_init_url
from actors.models import HFTrainer
from rl_sync.config.lora import LoraSpec

from .conftest import loopback_config
from .harness import POOL
from .vllm_oracle import PROMPTS, SAMPLING, hf_config, launch, write_checkpoint

pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=8, lora_alpha=24, target_modules=TARGETS)
"""Scaling 3: vLLM folds it into lora_B in bf16 (inexact), so the round's scaling must match it."""
ENGINE_LORA = dict(enable_lora=True, max_lora_rank=8, max_loras=2)
"""Two slots: the group's adapter (pinned) and the saved one vLLM loads each step (evicting the last)."""
SPEC = LoraSpec(name="policy", lora_id=1, rank=8, alpha=24)
ROW_PARALLEL = ("o_proj", "down_proj")
"""vLLM shards lora_A of these along its columns and keeps lora_B whole; the others, column
parallel, the reverse."""
TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


class AlterableTrainer(HFTrainer):
    """A LoRA trainer whose sources a test can alter (`self.alter(sources)`)."""

    alter = None

    def rl_sync_sources(self):
        sources = super().rl_sync_sources()
        return sources if self.alter is None else self.alter(sources)


Trainer = ray.remote(num_cpus=0.1)(AlterableTrainer)


@pytest.fixture(scope="module")
def trainers(ray_session):
    url, config = free_init_url("127.0.0.1"), hf_config("qwen2")
    actors = POOL.take(Trainer, [(i, 2, config, url, 0, 0.1, "float32", "cpu", LORA) for i in range(2)])
    yield actors
    ray.get([t.call.remote(_alter(None)) for t in actors])
    POOL.give_back(Trainer, actors)


@pytest.fixture(scope="module")
def engine(trainers, tmp_path_factory):
    """A TP2 engine with LoRA on the trainers' base weights."""
    base = ray.get([t.base_state.remote() for t in trainers])[0]
    path = write_checkpoint(str(tmp_path_factory.mktemp("lora") / "base"), hf_config("qwen2"), base)
    engine = launch(path, 2, **ENGINE_LORA)
    yield engine
    engine.shutdown()


def _alter(alter):
    def apply(trainer):
        trainer.alter = alter

    return apply


def _kept_bytes(shapes: dict[str, tuple[int, ...]], tp_rank: int, tp: int = 2) -> int:
    """The bf16 bytes of its boxes a TP rank keeps: row-parallel layers split lora_A's columns,
    column-parallel ones lora_B's rows (in torch.chunk pieces), the other matrix whole."""
    total = 0
    for name, shape in shapes.items():
        split = ("lora_A" in name) == any(f".{m}." in name for m in ROW_PARALLEL)
        dim = 1 if "lora_A" in name else 0
        start, stop = (tp_rank * shape[dim] // tp, (tp_rank + 1) * shape[dim] // tp) if split else (0, shape[dim])
        total += (stop - start) * shape[1 - dim] * 2
    return total


def test_lora_rounds_generate_what_the_engine_loading_the_saved_adapter_does(trainers, engine, tmp_path):
    sync = WeightSync.create(trainers, engine.ranks, loopback_config(bucket_bytes=1 << 16), lora=SPEC)
    shapes = {n: tuple(t.shape) for n, t in ray.get(trainers[0].call.remote(lambda s: s.rl_sync_sources())).items()}
    assert len(shapes) == 2 * len(TARGETS) * 2, "every targeted module's lora_A and lora_B, of 2 layers"
    assert set(sync.summary.modes.values()) == {"direct", "reload"}
    assert all((m == "reload") == (".lora_B." in n) for n, m in sync.summary.modes.items()), "lora_B is scaled"
    kept = [_kept_bytes(shapes, r) for r in range(2)]
    assert list(sync.summary.kept_bytes) == kept
    base = engine.generate(PROMPTS, **SAMPLING)
    model_bytes = sum(t.numel() * 2 for t in ray.get([t.base_state.remote() for t in trainers])[0].values())
    for step in range(1, 4):
        ray.get([t.train_step.remote(TOKENS, 2e-2) for t in trainers])
        stats = sync.push()
        received = [next(r.received_bytes for r in stats.ranks if r.rank == 2 + j) for j in range(2)]
        assert received == kept, f"step {step}: bytes into each rank {received}, its slot keeps {kept}"
        print(f"step {step}: {sum(received)} B into 2 ranks; the model is {model_bytes} B in bf16")
        saved = str(tmp_path / f"step{step}")
        ray.get([t.save_adapter.remote(saved) for t in trainers])
        loaded = LoraSpec(name=f"saved-{step}", lora_id=100 + step, rank=8, alpha=24, path=saved).request()
        want = engine.generate(PROMPTS, lora_request=loaded, **SAMPLING)
        got = engine.generate(PROMPTS, lora_request=sync.lora_request("policy"), **SAMPLING)
        assert got == want, f"step {step}: the synced adapter generates otherwise than the saved one"
        assert [o["logprobs"] for o in got] != [o["logprobs"] for o in base], "the adapter changes generation"
        assert sync.versions() == [step, step]
    with pytest.raises(ValueError, match=r"^lora_request: unknown adapter 'other'; this group pushes 'policy'$"):
        sync.lora_request("other")
    sync.close()


@pytest.mark.parametrize(
    "spec, alter, message",
    [
        (
            LoraSpec(name="policy", lora_id=1, rank=8, alpha=16),
            None,
            r"trainer rank 0: the adapter's PEFT config has r=8, lora_alpha=24, use_rslora=False, but LoraSpec "
            r"'policy' has rank=8, alpha=16, use_rslora=False; build the spec with LoraSpec\.of_peft",
        ),
        (
            LoraSpec(name="policy", lora_id=1, rank=16, alpha=32),
            dict,  # (sources without their PEFT config: the engine's checks)
            r"vLLM rank \d: adapter 'policy' has rank 16 but the engine's max_lora_rank is 8; start the engine with "
            r"max_lora_rank >= 16",
        ),
        (
            LoraSpec(name="policy", lora_id=1, rank=4, alpha=8),
            dict,
            r"vLLM rank \d: adapter tensor 'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' "
            r"\(8, 128\) has rank 8, but LoraSpec\.rank is 4",
        ),
        (
            SPEC,
            lambda s: {**s, "base_model.model.model.layers.0.mlp.bogus.lora_A.weight": torch.zeros(8, 128)},
            r"vLLM rank \d: adapter tensor 'base_model\.model\.model\.layers\.0\.mlp\.bogus\.lora_A\.weight' adapts "
            r"'model\.layers\.0\.mlp\.bogus', which vLLM's engine keeps no LoRA layer for \(its LoRA modules: .*\); "
            r"target only those modules",
        ),
        (
            SPEC,
            lambda s: {**s, "model.norm.weight": torch.ones(128)},
            r"vLLM rank \d: tensor 'model\.norm\.weight' is no LoRA adapter tensor: a LoRA group carries PEFT's "
            r"saved names only",
        ),
    ],
    ids=["alpha-not-the-trainers", "rank-over-max", "rank-not-the-specs", "module-vllm-lacks", "base-weight"],
)
def test_bad_adapters_fail_create_naming_what_is_wrong(trainers, engine, spec, alter, message):
    ray.get([t.call.remote(_alter(alter)) for t in trainers])
    try:
        with pytest.raises(ValueError, match=message):
            WeightSync.create(trainers, engine.ranks, loopback_config(), lora=spec)
    finally:
        ray.get([t.call.remote(_alter(None)) for t in trainers])
