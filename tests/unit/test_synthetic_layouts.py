"""One layout source: synthetic models are laid out by the binder's rules, as vLLM lays them out.

For every model family (and DeepSeek-V3's MLA / shared-expert variants) over a
grid of TP, engines, pipeline stages, expert parallelism, KV heads below TP,
tied embeddings, FP8 and a vocabulary whose padding tells vLLM's rule apart:
every synthetic checkpoint name binds through a rule (never a fallback), its
destination is the binder's layout, and each worker's box is the one vLLM's
loader keeps (a small oracle written from vLLM's layers, below); GQA families'
names also bind into the runtime `TPModel`'s storage with exactly those boxes.
The anchor guard pins the bytes each worker of the published plan configs
receives, so a layout change shows in review.
"""

from __future__ import annotations

import itertools
import math
import typing
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rl_sync.bind.binder import Binder
from rl_sync.config.load import load_config
from rl_sync.models.config import Family, ModelConfig, Parallel
from rl_sync.models.plan_report import PlanReportConfig
from rl_sync.models.synthetic import TrainerParallel, checkpoint_tensors, model_specs
from rl_sync.models.tp_model import TPModel
from rl_sync.planning.layout import Box
from rl_sync.planning.quant import scale_name
from rl_sync.wire.dtypes import itemsize


class _Base(typing.TypedDict):
    """`ModelConfig` keywords every family shares (TypedDicts so `**` unpacking stays type-checked)."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int


class _Moe(typing.TypedDict):
    experts: int
    top_k: int
    moe_intermediate: int


class _Mla(_Moe):
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    shared_experts: int
    first_dense_layers: int


TRAINERS = 2
BASE = _Base(vocab=1030, hidden=64, layers=3, heads=8, kv_heads=2, head_dim=8, intermediate=64)
"""vocab 1030 pads to 1088 = 64 x 17 (vLLM's rule), not to a multiple of 64 x tp."""
MOE = _Moe(experts=8, top_k=2, moe_intermediate=64)
MLA = _Mla(
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    shared_experts=1,
    first_dense_layers=1,
    **MOE,
)
MODELS: dict[str, ModelConfig] = {
    "llama": ModelConfig(family="llama", **BASE),
    "qwen2": ModelConfig(family="qwen2", qkv_bias=True, **BASE),
    "qwen3": ModelConfig(family="qwen3", qk_norm=True, **BASE),
    "qwen3_moe": ModelConfig(family="qwen3_moe", qk_norm=True, first_dense_layers=1, **BASE, **MOE),
    "mixtral": ModelConfig(family="mixtral", **BASE, **MOE),
    "deepseek_v3": ModelConfig(family="deepseek_v3", **BASE, **MLA),
    "deepseek_v3-no-q-lora": ModelConfig(family="deepseek_v3", **BASE, **(MLA | {"q_lora_rank": 0})),
    "deepseek_v3-no-shared": ModelConfig(family="deepseek_v3", **BASE, **(MLA | {"shared_experts": 0})),
    "deepseek_v3-2-shared": ModelConfig(family="deepseek_v3", **BASE, **(MLA | {"shared_experts": 2})),
    "deepseek_v3-all-moe": ModelConfig(family="deepseek_v3", **BASE, **(MLA | {"first_dense_layers": 0})),
}


def _grid(cfg: ModelConfig) -> list[tuple[ModelConfig, Parallel]]:
    """Every tp x pp (x ep for MoE), with engines, tied embeddings and FP8 turned in rotation."""
    out = []
    eps = (False, True) if cfg.experts else (False,)
    for i, (tp, pp, ep) in enumerate(itertools.product((1, 2, 4, 8), (1, 2), eps)):
        model = replace(cfg, tie_embeddings=bool(i % 2), fp8_block=(8, 8) if i // 2 % 2 else None)
        out.append((model, Parallel(engines=1 + i // 4 % 2, pp=pp, tp=tp, ep=ep)))
    return out


def test_every_family_is_covered():
    assert {m.family for m in MODELS.values()} == set(typing.get_args(Family))


_COLUMN = {"q_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj", "w1", "w3"}
_ROW = {"o_proj", "down_proj", "w2"}


def _chunk(shape: tuple[int, ...], dim: int, parts: int, index: int, step: int = 0) -> Box:
    """Position `index` of `parts` along `dim`: torch.chunk sizes, or blocks of `step`."""
    n = shape[dim]
    step = step or -(-n // parts)
    start = min(index * step, n)
    size = max(0, min(step, n - start))
    offsets = [0] * len(shape)
    offsets[dim] = start if size else n
    return Box(tuple(offsets), tuple(size if d == dim else s for d, s in enumerate(shape)))


def _vllm_box(name: str, shape: tuple[int, ...], cfg: ModelConfig, par: Parallel, rank: int) -> Box | None:
    """The box of checkpoint tensor `name` vLLM's loader keeps on worker side rank `rank`
    (written from vLLM's layers, independently of the binder's rules)."""
    _, stage, t = par.coords(rank)
    parts = name.split(".")
    if parts[1] == "layers":
        stages = {par.stage_of(int(parts[2]), cfg.layers)}
    elif name.startswith("model.embed_tokens"):
        stages = {0, par.pp - 1} if cfg.tie_embeddings else {0}
    else:
        stages = {par.pp - 1}
    if stage not in stages:
        return None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):  # VocabParallelEmbedding: pad to 64, split evenly
        return _chunk(shape, 0, par.tp, t, -(-cfg.vocab // 64) * 64 // par.tp)
    module = parts[-2]
    if "experts" in parts and parts[parts.index("experts") + 1].isdigit() and par.ep:  # FusedMoE, linear placement
        return (
            Box((0,) * len(shape), shape)
            if int(parts[parts.index("experts") + 1]) // (cfg.experts // par.tp) == t
            else None
        )
    if module in ("k_proj", "v_proj") and par.tp > cfg.kv_heads:  # QKVParallelLinear: a head per tp / kv ranks
        return _chunk(shape, 0, cfg.kv_heads, t // (par.tp // cfg.kv_heads))
    if module in _COLUMN or module in ("k_proj", "v_proj"):
        return _chunk(shape, 0, par.tp, t)
    if module in _ROW:
        return _chunk(shape, 1, par.tp, t)
    return Box((0,) * len(shape), shape)  # norms, routers, MLA's a-projections, biases of replicated layers


def _unquantized(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) != 2 or name.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight"))


@pytest.mark.parametrize("model", list(MODELS))
def test_synthetic_layouts_are_the_binders_and_vllms(model):
    for cfg, par in _grid(MODELS[model]):
        where = f"{model} {par} tied={cfg.tie_embeddings} fp8={cfg.fp8_block}"
        binder = Binder(cfg, par)
        specs = {s.name: s for s in model_specs(cfg, TrainerParallel(ranks=TRAINERS), par)}
        checkpoint = list(checkpoint_tensors(cfg))
        assert {t.name for t in checkpoint} | {scale_name(t.name) for t in checkpoint} >= set(specs), where
        for t in checkpoint:
            spec, layout = specs[t.name], binder.destination(t.name, t.shape)  # raises if a name falls back
            quantized = cfg.fp8_block is not None and not _unquantized(t.name, t.shape)
            assert bool(spec.block) == quantized, (where, t.name)
            for rank in range(par.size):
                box = spec.dst.local_box(t.shape, TRAINERS + rank)
                assert box == layout.local_box(t.shape, rank), (where, t.name, rank)
                assert box == _vllm_box(t.name, t.shape, cfg, par, rank), (where, t.name, rank, box)


@pytest.mark.parametrize("model", [m for m, cfg in MODELS.items() if cfg.attention == "gqa"])
def test_synthetic_names_bind_into_the_runtime_model(model):
    """`TPModel` holds exactly the synthetic boxes: values, FP8 values and their scales."""
    for cfg, par in _grid(MODELS[model]):
        specs = {s.name: s for s in model_specs(cfg, TrainerParallel(ranks=TRAINERS), par)}
        checkpoint = {t.name: (getattr(torch, t.dtype), t.shape) for t in checkpoint_tensors(cfg)}
        binder = Binder(cfg, par)
        for rank in range(par.size):
            binding = binder.bind(checkpoint, TPModel(cfg, par, rank, dtype=torch.bfloat16).params, rank)
            assert binding.fallbacks == ()
            assert set(binding.destinations) == set(specs), (model, par)
            for name, dest in binding.destinations.items():
                box = specs[name].dst.local_box(specs[name].shape, TRAINERS + rank)
                held = None if dest.local is None else tuple(dest.local.shape)
                assert held == (None if box is None else box.sizes), (model, par, name)
                assert str(dest.dtype).removeprefix("torch.") == specs[name].dtype, (model, par, name)


def test_padded_vocab_is_vllms_rule():
    assert Parallel(tp=8).padded_vocab(151936) == 151936  # Qwen3 at TP8: 64 x tp would give 152064
    assert Parallel(tp=2).padded_vocab(1030) == 1088
    with pytest.raises(ValueError, match=r"vocabulary 100 pads to 128 rows .* which tp 3 does not divide"):
        Parallel(tp=3).padded_vocab(100)


def test_a_tensor_no_rule_binds_is_refused():
    binder = Binder(MODELS["llama"], Parallel(tp=2))
    with pytest.raises(ValueError, match=r"llama checkpoint tensor 'model.layers.0.mlp.experts.0.w1.weight' .*no rule"):
        binder.destination("model.layers.0.mlp.experts.0.w1.weight", (64, 64))
    with pytest.raises(ValueError, match=r"TPModel has no forward for deepseek_v3"):
        TPModel(MODELS["deepseek_v3"], Parallel(), 0)


CONFIGS = Path(__file__).parents[2] / "configs"
ANCHORS = {  # config: (tensors, GB into each worker)
    "plan_kimi_k2": (139_583, 65.50),
    "plan_deepseek_v3": (90_427, 85.14),
    "plan_qwen3_235b": (36_945, 58.96),
    "plan_llama_70b_fleet": (723, 17.64),
    "plan_dense_8b": (291, 4.02),
}


@pytest.mark.parametrize("name", list(ANCHORS))
def test_anchor_configs_keep_their_bytes_per_worker(name):
    """What every worker of a published plan config receives (its boxes' bytes): a layout change
    moves these figures and the predictions in docs/benchmarks.md."""
    cfg = load_config(CONFIGS / f"{name}.yaml", PlanReportConfig)
    specs = model_specs(cfg.model, cfg.trainer, cfg.inference)
    groups = Counter((s.dst, s.shape, s.dtype) for s in specs)
    received = Counter()
    for (dst, shape, dtype), count in groups.items():
        for rank in set(dst.mesh.ranks):
            received[rank] += count * math.prod(dst.local_box(shape, rank).sizes) * itemsize(dtype)
    assert len(received) == cfg.inference.size
    tensors, gb = ANCHORS[name]
    most, least = max(received.values()), min(received.values())
    assert (len(specs), round(most / 1e9, 2), round(least / 1e9, 2)) == (tensors, gb, gb)
