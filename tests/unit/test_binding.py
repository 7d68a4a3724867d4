"""Binding rules: every checkpoint tensor lands in the right slice of the right live parameter."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from rl_sync.bind.binder import Binder  # noqa: E402
from rl_sync.bind.rules import Rule  # noqa: E402
from rl_sync.models.config import ModelConfig, Parallel  # noqa: E402
from rl_sync.models.tp_model import TPModel  # noqa: E402

QWEN3 = ModelConfig(
    family="qwen3",
    vocab=100,
    hidden=32,
    layers=2,
    heads=8,
    kv_heads=2,
    head_dim=4,
    intermediate=48,
    qk_norm=True,
    tie_embeddings=True,
)
MOE = ModelConfig(
    family="qwen3_moe",
    vocab=100,
    hidden=32,
    layers=2,
    heads=4,
    kv_heads=2,
    head_dim=8,
    intermediate=48,
    experts=4,
    top_k=2,
    moe_intermediate=16,
    qk_norm=True,
)


def _checkpoint(cfg: ModelConfig, per_expert: bool = False) -> dict[str, torch.Tensor]:
    hf = {"qwen3": transformers.Qwen3Config, "qwen3_moe": transformers.Qwen3MoeConfig}[cfg.family]
    extra = (
        dict(num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, moe_intermediate_size=cfg.moe_intermediate)
        if cfg.experts
        else {}
    )
    model = transformers.AutoModelForCausalLM.from_config(
        hf(
            vocab_size=cfg.vocab,
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            intermediate_size=cfg.intermediate,
            tie_word_embeddings=cfg.tie_embeddings,
            **extra,
        )
    )
    state = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    if per_expert:
        for name in [n for n in state if ".experts." in n]:
            stacked = state.pop(name)
            prefix = name.rsplit(".", 1)[0]
            for e in range(cfg.experts):
                if name.endswith("gate_up_proj"):
                    gate, up = stacked[e].chunk(2)
                    state[f"{prefix}.{e}.gate_proj.weight"], state[f"{prefix}.{e}.up_proj.weight"] = gate, up
                else:
                    state[f"{prefix}.{e}.down_proj.weight"] = stacked[e]
    return state


def _bind_all(cfg: ModelConfig, par: Parallel, state: dict[str, torch.Tensor]) -> list[TPModel]:
    models = []
    for rank in range(par.size):
        model = TPModel(cfg, par, rank)
        binding = Binder(cfg, par).bind({n: (t.dtype, tuple(t.shape)) for n, t in state.items()}, model.params, rank)
        assert binding.fallbacks == ()
        for name, dest in binding.destinations.items():
            box = dest.layout.local_box(dest.shape, rank)
            if box is not None:
                assert dest.local is not None, f"{name}: rank {rank} holds a box but no tensor"
                dest.local.copy_(state[name][tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])
        models.append(model)
    return models


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_fused_qkv_slots_follow_gqa_with_kv_heads_replicated_past_tp(tp):
    state = _checkpoint(QWEN3)
    d, kv = QWEN3.head_dim, QWEN3.kv_heads
    for t, model in enumerate(_bind_all(QWEN3, Parallel(tp=tp), state)):
        qkv = model.params["model.layers.1.self_attn.qkv_proj.weight"]
        q_rows = QWEN3.heads * d // tp
        head = t // (tp // kv) if tp > kv else None
        k_rows = (
            slice(head * d, (head + 1) * d) if head is not None else slice(t * kv * d // tp, (t + 1) * kv * d // tp)
        )
        want = torch.cat(
            [
                state["model.layers.1.self_attn.q_proj.weight"][t * q_rows : (t + 1) * q_rows],
                state["model.layers.1.self_attn.k_proj.weight"][k_rows],
                state["model.layers.1.self_attn.v_proj.weight"][k_rows],
            ]
        )
        assert torch.equal(qkv, want)


def test_tied_embedding_and_padded_vocab_rows():
    state = _checkpoint(QWEN3)
    models = _bind_all(QWEN3, Parallel(tp=2, vocab_pad=64), state)
    embed = state["model.embed_tokens.weight"]
    assert models[0].params["model.embed_tokens.weight"].shape == (64, 32)
    assert torch.equal(models[1].params["model.embed_tokens.weight"][:36], embed[64:])
    assert (models[1].params["model.embed_tokens.weight"][36:] == 0).all()
    assert models[0].params["lm_head.weight"] is models[0].params["model.embed_tokens.weight"]


def test_tied_embedding_reaches_the_last_pipeline_stage_head():
    state = _checkpoint(QWEN3)
    models = _bind_all(QWEN3, Parallel(pp=2, tp=1), state)
    assert torch.equal(models[1].params["lm_head.weight"][:100], state["model.embed_tokens.weight"])
    assert "model.layers.0.input_layernorm.weight" in models[0].params
    assert "model.layers.0.input_layernorm.weight" not in models[1].params


@pytest.mark.parametrize("per_expert", [False, True])
def test_experts_split_whole_over_ranks(per_expert):
    state = _checkpoint(MOE, per_expert)
    models = _bind_all(MOE, Parallel(tp=2, ep=True), state)
    w13 = models[1].params["model.layers.0.mlp.experts.w13_weight"]
    if per_expert:
        want = torch.cat(
            [
                state["model.layers.0.mlp.experts.3.gate_proj.weight"],
                state["model.layers.0.mlp.experts.3.up_proj.weight"],
            ]
        )
    else:
        want = state["model.layers.0.mlp.experts.gate_up_proj"][3]
    assert torch.equal(w13[1], want)


def test_unbindable_names_are_listed_or_fall_back():
    state = _checkpoint(MOE)
    checkpoint = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    model = TPModel(MOE, Parallel(tp=2, ep=False), 0)
    with pytest.raises(
        ValueError, match=r"no rule binds 2 checkpoint tensors \['model.layers.0.mlp.experts.gate_up_proj'"
    ):
        Binder(MOE, Parallel(tp=2)).bind(checkpoint, model.params, 0)
    binding = Binder(MOE, Parallel(tp=2)).bind(checkpoint, model.params, 0, allow_fallback=True)
    assert binding.fallbacks == ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.gate_up_proj")
    assert binding.destinations[binding.fallbacks[0]].local.shape == (4, 32, 32)


def test_user_rules_come_first():
    rule = Rule(r"model\.norm\.weight", "model.layers.0.input_layernorm.weight", "replicated")
    model = TPModel(QWEN3, Parallel(), 0)
    binding = Binder(QWEN3, Parallel(), [rule]).bind({"model.norm.weight": (torch.float32, (32,))}, model.params, 0)
    assert (
        binding.destinations["model.norm.weight"].local.data_ptr()
        == model.params["model.layers.0.input_layernorm.weight"].data_ptr()
    )


def test_dtype_mismatch_is_named():
    model = TPModel(QWEN3, Parallel(), 0)
    with pytest.raises(ValueError, match=r"'model.norm.weight' is torch.bfloat16 in the checkpoint but live parameter"):
        Binder(QWEN3, Parallel()).bind({"model.norm.weight": (torch.bfloat16, (32,))}, model.params, 0)
