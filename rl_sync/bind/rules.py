"""Binding rules: checkpoint names to live inference parameters, as data.

A rule matches a Hugging Face checkpoint name (`pattern`, a regex with named
groups) and says where it lives on an inference worker: the live parameter
(`target`, formatted with the groups), the fused slot inside it (`slot`, one
of the target's `FUSED` slots) and how it is split across tensor-parallel
ranks (`split`):

* `column` / `row`: `Shard(0)` / `Shard(1)` over TP;
* `kv`: like `column`, but with more TP ranks than KV heads each head is
  replicated over `tp / kv_heads` ranks (as vLLM does);
* `vocab`: `Shard(0)` in blocks of `padded_vocab / tp` rows;
* `replicated`;
* `experts`: stacked `(E, ...)` expert weights: with expert parallelism whole
  experts split over TP ranks; without it, `tp_dim` is TP-sharded, or, when
  `tp_dim` is None, the tensor cannot be split in place and falls back;
* `expert_column` / `expert_row`: one expert's weight (`expert` group): with
  expert parallelism replicated on the rank owning the expert, else column /
  row split, bound at the expert's index of the stacked target.

Users add rules with `Binder(rules=...)` (or the `rules:` list of a demo
config, `configs/demo.yaml`); user rules come before the built-in tables, and
earlier rules win.

The built-in tables are also where synthetic models (`rl_sync.models.synthetic`:
the planner report, benchmarks, the notebook) get their destination layouts,
so they are written to equal what vLLM's loader resolves, parameter by
parameter (`tests/unit/test_synthetic_layouts.py`,
`tests/distributed/test_vllm_binding.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Split = Literal["column", "row", "kv", "vocab", "replicated", "experts", "expert_column", "expert_row"]

FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj.weight": ("q", "k", "v"),
    "qkv_proj.bias": ("q", "k", "v"),
    "gate_up_proj.weight": ("gate", "up"),
    "w13_weight": ("gate", "up"),
    "fused_qkv_a_proj.weight": ("q_a", "kv_a"),
}
"""Fused live parameters (by name suffix) and the order of their slots along the fused dim."""

QUANTIZED: tuple[str, ...] = ("proj.weight", "kv_a_proj_with_mqa.weight", "w13_weight", "w2_weight")
"""Live parameters (by name suffix) a block-quantized FP8 model keeps in FP8: the attention
(MLA's too), MLP and expert projections; embeddings, the head, norms and routers stay unquantized."""


@dataclass(frozen=True)
class Rule:
    """One checkpoint pattern and where it binds (see the module docstring)."""

    pattern: str
    target: str
    split: Split
    slot: str | None = None
    expert: str | None = None
    tp_dim: int | None = None


L = r"model\.layers\.(?P<layer>\d+)"

DENSE_RULES: tuple[Rule, ...] = (
    Rule(r"model\.embed_tokens\.weight", "model.embed_tokens.weight", "vocab"),
    Rule(r"lm_head\.weight", "lm_head.weight", "vocab"),
    Rule(r"model\.norm\.weight", "model.norm.weight", "replicated"),
    Rule(
        L + r"\.(?P<norm>input_layernorm|post_attention_layernorm)\.weight",
        "model.layers.{layer}.{norm}.weight",
        "replicated",
    ),
    Rule(
        L + r"\.self_attn\.q_proj\.(?P<p>weight|bias)",
        "model.layers.{layer}.self_attn.qkv_proj.{p}",
        "column",
        slot="q",
    ),
    Rule(
        L + r"\.self_attn\.(?P<s>k|v)_proj\.(?P<p>weight|bias)",
        "model.layers.{layer}.self_attn.qkv_proj.{p}",
        "kv",
        slot="{s}",
    ),
    Rule(L + r"\.self_attn\.(?P<n>q_norm|k_norm)\.weight", "model.layers.{layer}.self_attn.{n}.weight", "replicated"),
    Rule(L + r"\.self_attn\.o_proj\.weight", "model.layers.{layer}.self_attn.o_proj.weight", "row"),
    Rule(
        L + r"\.mlp\.(?P<s>gate|up)_proj\.weight", "model.layers.{layer}.mlp.gate_up_proj.weight", "column", slot="{s}"
    ),
    Rule(L + r"\.mlp\.down_proj\.weight", "model.layers.{layer}.mlp.down_proj.weight", "row"),
)
"""Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k norms) dense models."""

MOE_RULES: tuple[Rule, ...] = (
    Rule(L + r"\.(?:mlp|block_sparse_moe)\.gate\.weight", "model.layers.{layer}.mlp.gate.weight", "replicated"),
    Rule(L + r"\.mlp\.experts\.gate_up_proj", "model.layers.{layer}.mlp.experts.w13_weight", "experts", tp_dim=None),
    Rule(L + r"\.mlp\.experts\.down_proj", "model.layers.{layer}.mlp.experts.w2_weight", "experts", tp_dim=2),
    Rule(
        L + r"\.mlp\.experts\.(?P<e>\d+)\.(?P<s>gate|up)_proj\.weight",
        "model.layers.{layer}.mlp.experts.w13_weight",
        "expert_column",
        slot="{s}",
        expert="{e}",
    ),
    Rule(
        L + r"\.mlp\.experts\.(?P<e>\d+)\.down_proj\.weight",
        "model.layers.{layer}.mlp.experts.w2_weight",
        "expert_row",
        expert="{e}",
    ),
    Rule(
        L + r"\.block_sparse_moe\.experts\.(?P<e>\d+)\.w1\.weight",
        "model.layers.{layer}.mlp.experts.w13_weight",
        "expert_column",
        slot="gate",
        expert="{e}",
    ),
    Rule(
        L + r"\.block_sparse_moe\.experts\.(?P<e>\d+)\.w3\.weight",
        "model.layers.{layer}.mlp.experts.w13_weight",
        "expert_column",
        slot="up",
        expert="{e}",
    ),
    Rule(
        L + r"\.block_sparse_moe\.experts\.(?P<e>\d+)\.w2\.weight",
        "model.layers.{layer}.mlp.experts.w2_weight",
        "expert_row",
        expert="{e}",
    ),
)
"""Qwen3-MoE and Mixtral: routers, stacked (transformers 5) and per-expert (checkpoint files) experts."""

MLA_RULES: tuple[Rule, ...] = (
    Rule(
        L + r"\.self_attn\.q_a_proj\.weight",
        "model.layers.{layer}.self_attn.fused_qkv_a_proj.weight",
        "replicated",
        slot="q_a",
    ),
    Rule(
        L + r"\.self_attn\.kv_a_proj_with_mqa\.weight",
        "model.layers.{layer}.self_attn.fused_qkv_a_proj.weight",
        "replicated",
        slot="kv_a",
    ),
    Rule(
        L + r"\.self_attn\.(?P<n>q_a_layernorm|kv_a_layernorm)\.weight",
        "model.layers.{layer}.self_attn.{n}.weight",
        "replicated",
    ),
    Rule(
        L + r"\.self_attn\.(?P<n>q_b_proj|q_proj|kv_b_proj)\.weight",
        "model.layers.{layer}.self_attn.{n}.weight",
        "column",
    ),
    Rule(
        L + r"\.mlp\.gate\.e_score_correction_bias",
        "model.layers.{layer}.mlp.gate.e_score_correction_bias",
        "replicated",
    ),
)
"""DeepSeek-V3 / Kimi-K2 multi-head latent attention, as vLLM holds it: `q_a_proj` and
`kv_a_proj_with_mqa` fused into a replicated `fused_qkv_a_proj`, the up-projections column
parallel (`o_proj` is the dense row rule), and the router's score-correction bias (fp32)."""

MLA_PLAIN_Q_RULES: tuple[Rule, ...] = (
    Rule(
        L + r"\.self_attn\.kv_a_proj_with_mqa\.weight",
        "model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight",
        "replicated",
    ),
)
"""MLA without query compression (`q_lora_rank` 0): vLLM keeps `kv_a_proj_with_mqa` unfused
(`Binder` puts these before `MLA_RULES`)."""

SHARED_RULES: tuple[Rule, ...] = (
    Rule(
        L + r"\.mlp\.shared_experts\.(?P<s>gate|up)_proj\.weight",
        "model.layers.{layer}.mlp.shared_experts.gate_up_proj.weight",
        "column",
        slot="{s}",
    ),
    Rule(
        L + r"\.mlp\.shared_experts\.down_proj\.weight",
        "model.layers.{layer}.mlp.shared_experts.down_proj.weight",
        "row",
    ),
)
"""DeepSeek-V3 shared experts: one TP-sharded MLP (vLLM replicates them only under
sequence-parallel MoE, data-parallel attention, which these rules do not model)."""

BUILTIN: dict[str, tuple[Rule, ...]] = {
    "llama": DENSE_RULES,
    "qwen2": DENSE_RULES,
    "qwen3": DENSE_RULES,
    "qwen3_moe": MOE_RULES + DENSE_RULES,
    "mixtral": MOE_RULES + DENSE_RULES,
    "deepseek_v3": MLA_RULES + SHARED_RULES + MOE_RULES + DENSE_RULES,
}
