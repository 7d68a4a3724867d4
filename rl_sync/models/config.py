"""Architecture and parallel configuration of the inference model.

One model-shape type and one parallelism type for the runtime (`TPModel`, the
binder) and for synthetic models (`rl_sync.models.synthetic`, the planner
report, benchmarks): the binder derives every destination layout from them.

Typical use::

    cfg = ModelConfig.from_hf(hf_config)                   # or ModelConfig(family="llama", ...) from YAML
    par = Parallel(engines=2, tp=4)
    par.padded_vocab(cfg.vocab)                            # vLLM's padded vocabulary rows
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, Literal

from ..config.sync import check_int, check_number
from ..planning.layout import MAX_MESH_RANKS

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3"]

HF_FAMILIES: dict[str, Family] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
}
"""Hugging Face `model_type` -> the family whose binding rules serve it (Kimi-K2 is DeepSeek-V3-shaped)."""


MAX_DIM = 1 << 24
"""Bound on every size of a model (vocabulary, hidden, FFN, head and rank dims): far above any
model's, so shapes and their products stay small."""
MAX_COUNT = 1 << 12
"""Bound on every count of a model (layers, heads, experts)."""
_BOUNDS = {
    **dict.fromkeys(
        ("layers", "heads", "kv_heads", "experts", "top_k", "shared_experts", "first_dense_layers"), MAX_COUNT
    ),
    **dict.fromkeys(
        ("vocab", "hidden", "intermediate", "head_dim", "moe_intermediate", "q_lora_rank", "kv_lora_rank")
        + ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        MAX_DIM,
    ),
}
"""Each int field of `ModelConfig` and its upper bound."""
_POSITIVE = ("layers", "hidden", "vocab", "heads", "intermediate")
"""The int fields that must be > 0 (the rest may be 0: unused)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The subset of a Hugging Face config the inference model needs (its names where they differ)."""

    family: Family
    """Which built-in binding rules apply (`rl_sync.bind.rules.BUILTIN`)."""
    vocab: int
    """Vocabulary size (`vocab_size`)."""
    hidden: int
    """Hidden size."""
    layers: int
    """Decoder layers."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (GQA); unused by MLA."""
    head_dim: int
    """Per-head dim of q/k/v (GQA); unused by MLA."""
    intermediate: int
    """FFN size of dense layers."""
    rms_eps: float = 1e-6
    """RMS norm epsilon."""
    rope_theta: float = 10000.0
    """Rotary base."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    top_k: int = 0
    """Experts each token is routed to."""
    moe_intermediate: int = 0
    """FFN size of one routed (or shared) expert."""
    norm_topk_prob: bool = True
    """Renormalise the top-k routing weights."""
    shared_experts: int = 0
    """Shared experts per MoE layer (DeepSeek-V3: one MLP of this many expert widths)."""
    first_dense_layers: int = 0
    """Leading layers with a dense FFN in an MoE model (`first_k_dense_replace`)."""
    q_lora_rank: int = 0
    """MLA query compression rank (0: no compression, a plain `q_proj`)."""
    kv_lora_rank: int = 0
    """MLA key/value compression rank."""
    qk_nope_head_dim: int = 0
    """MLA per-head non-rotary q/k dim."""
    qk_rope_head_dim: int = 0
    """MLA per-head rotary q/k dim."""
    v_head_dim: int = 0
    """MLA per-head value dim."""
    qkv_bias: bool = False
    """Biases on q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMS norms on q and k (Qwen3)."""
    tie_embeddings: bool = False
    """lm_head shares embed_tokens."""
    dtype: str = "bfloat16"
    """Dtype name of the checkpoint's weights."""
    fp8_block: tuple[int, int] | None = None
    """Linear and expert weights kept as block-quantized FP8 with one fp32 scale per block of
    this size (`rl_sync.planning.quant`; a Hugging Face `quantization_config` of `quant_method: fp8`
    with `weight_block_size`); `None`: every weight in the model's dtype."""

    def __post_init__(self) -> None:
        if self.family not in typing.get_args(Family):
            raise ValueError(
                f"ModelConfig.family must be one of {', '.join(typing.get_args(Family))}, got {self.family!r}"
            )
        for name, high in _BOUNDS.items():
            check_int(f"ModelConfig.{name}", getattr(self, name), 1 if name in _POSITIVE else 0, high)
        check_number("ModelConfig.rms_eps", self.rms_eps)
        check_number("ModelConfig.rope_theta", self.rope_theta, positive=True)
        if self.fp8_block is not None:
            for size in self.fp8_block:
                check_int("ModelConfig.fp8_block", size, 1, MAX_DIM)
        if self.experts and self.moe_intermediate <= 0:
            raise ValueError("ModelConfig.moe_intermediate must be > 0 when experts > 0")
        if self.attention == "gqa" and (self.kv_heads <= 0 or self.head_dim <= 0):
            raise ValueError(
                f"ModelConfig.kv_heads and head_dim must be > 0 for {self.family}, "
                f"got {self.kv_heads} and {self.head_dim}"
            )
        mla = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if self.attention == "mla" and any(getattr(self, name) <= 0 for name in mla):
            raise ValueError(
                f"ModelConfig: deepseek_v3 (MLA) needs {', '.join(mla)} > 0, got "
                f"{', '.join(str(getattr(self, name)) for name in mla)}"
            )

    @property
    def attention(self) -> Literal["gqa", "mla"]:
        """Multi-head latent attention (DeepSeek-V3, Kimi-K2) or grouped-query attention (the rest)."""
        return "mla" if self.family == "deepseek_v3" else "gqa"

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelConfig:
        family = HF_FAMILIES.get(cfg.model_type)
        if family is None:
            raise ValueError(
                f"model_type {cfg.model_type!r} has no built-in rules; expected one of {', '.join(HF_FAMILIES)}"
            )
        experts = (
            getattr(cfg, "num_experts", None)
            or getattr(cfg, "num_local_experts", None)
            or getattr(cfg, "n_routed_experts", None)
            or 0
        )
        return cls(
            family=family,
            vocab=cfg.vocab_size,
            hidden=cfg.hidden_size,
            layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads,
            kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            intermediate=cfg.intermediate_size,
            rms_eps=cfg.rms_norm_eps,
            rope_theta=getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"],
            experts=experts,
            top_k=getattr(cfg, "num_experts_per_tok", 0) or 0,
            moe_intermediate=getattr(cfg, "moe_intermediate_size", None) or (cfg.intermediate_size if experts else 0),
            norm_topk_prob=getattr(cfg, "norm_topk_prob", family == "mixtral"),
            shared_experts=getattr(cfg, "n_shared_experts", None) or 0,
            first_dense_layers=getattr(cfg, "first_k_dense_replace", None) or 0,
            q_lora_rank=getattr(cfg, "q_lora_rank", None) or 0,
            kv_lora_rank=getattr(cfg, "kv_lora_rank", None) or 0,
            qk_nope_head_dim=getattr(cfg, "qk_nope_head_dim", None) or 0,
            qk_rope_head_dim=getattr(cfg, "qk_rope_head_dim", None) or 0,
            v_head_dim=getattr(cfg, "v_head_dim", None) or 0,
            qkv_bias=family == "qwen2",
            qk_norm=family in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            fp8_block=_fp8_block(getattr(cfg, "quantization_config", None)),
        )


def _fp8_block(quantization: Any) -> tuple[int, int] | None:
    """The weight block size of a block-quantized FP8 `quantization_config`, else None."""
    if not quantization:
        return None
    quantization = dict(quantization)
    block = quantization.get("weight_block_size")
    if quantization.get("quant_method") != "fp8" or not block:
        raise ValueError(
            f"quantization_config {quantization} is not supported; expected quant_method 'fp8' with a "
            "weight_block_size (block-quantized FP8)"
        )
    return int(block[0]), int(block[1])


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Inference parallelism: engines x pipeline stages x tensor-parallel ranks.

    Worker side rank of (engine e, stage s, TP rank t) is `(e * pp + s) * tp + t`. The layouts
    assume vLLM's TP placement: no data-parallel attention, linear expert placement, no EPLB."""

    engines: int = 1
    """Engine replicas."""
    pp: int = 1
    """Pipeline stages per engine."""
    tp: int = 1
    """Tensor-parallel ranks per stage."""
    ep: bool = False
    """Split MoE experts whole over an engine's TP ranks (vLLM's `enable_expert_parallel`) instead
    of TP-sharding each."""
    vocab_pad: int = 64
    """Vocabulary rows are padded to a multiple of `vocab_pad`, then split evenly over TP ranks
    (vLLM's `VocabParallelEmbedding`)."""

    def __post_init__(self) -> None:
        for name in ("engines", "pp", "tp"):
            check_int(f"Parallel.{name}", getattr(self, name), 1, MAX_MESH_RANKS)
        check_int("Parallel.vocab_pad", self.vocab_pad, 1, MAX_DIM)
        if self.size > MAX_MESH_RANKS:
            raise ValueError(
                f"Parallel: engines x pp x tp = {self.engines} x {self.pp} x {self.tp} = {self.size} ranks, more "
                f"than the {MAX_MESH_RANKS} a mesh may hold"
            )

    @property
    def size(self) -> int:
        return self.engines * self.pp * self.tp

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(engine, stage, tp rank) of worker side rank `rank`."""
        return rank // (self.pp * self.tp), rank // self.tp % self.pp, rank % self.tp

    def rank(self, engine: int, stage: int, tp_rank: int) -> int:
        return (engine * self.pp + stage) * self.tp + tp_rank

    def stage_of(self, layer: int, layers: int) -> int:
        """Pipeline stage holding `layer` (contiguous, `torch.chunk` split)."""
        per = -(-layers // self.pp)
        return layer // per

    def padded_vocab(self, vocab: int) -> int:
        """`vocab` padded to a multiple of `vocab_pad`; `ValueError` unless `tp` divides it (vLLM
        asserts the same)."""
        padded = -(-vocab // self.vocab_pad) * self.vocab_pad
        if padded % self.tp:
            raise ValueError(
                f"vocabulary {vocab} pads to {padded} rows (a multiple of {self.vocab_pad}), which "
                f"tp {self.tp} does not divide; vLLM refuses it too: pick a tp that divides {padded}"
            )
        return padded
