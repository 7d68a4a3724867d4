"""Architecture and parallel configuration of the inference model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Family = Literal["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The subset of a Hugging Face config the inference model needs."""

    family: Family
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk_prob: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    fp8_block: tuple[int, int] | None = None
    """Linear and expert weights kept as block-quantized FP8 with one fp32 scale per block of
    this size (`rl_sync.planning.quant`; a Hugging Face `quantization_config` of `quant_method: fp8`
    with `weight_block_size`); `None`: every weight in the model's dtype."""

    @classmethod
    def from_hf(cls, cfg: Any) -> ModelConfig:
        family = cfg.model_type
        if family not in ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"):
            raise ValueError(f"model_type {family!r} has no built-in rules; expected llama, qwen2, qwen3, qwen3_moe or mixtral")
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0
        return cls(
            family=family, vocab=cfg.vocab_size, hidden=cfg.hidden_size, layers=cfg.num_hidden_layers,
            heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
            intermediate=cfg.intermediate_size, rms_eps=cfg.rms_norm_eps,
            rope_theta=getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"],
            experts=experts, top_k=getattr(cfg, "num_experts_per_tok", 0) or 0,
            moe_intermediate=getattr(cfg, "moe_intermediate_size", None) or (cfg.intermediate_size if experts else 0),
            norm_topk_prob=getattr(cfg, "norm_topk_prob", family == "mixtral"),
            qkv_bias=family == "qwen2", qk_norm=family in ("qwen3", "qwen3_moe"),
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
        raise ValueError(f"quantization_config {quantization} is not supported; expected quant_method 'fp8' with a "
                         "weight_block_size (block-quantized FP8)")
    return int(block[0]), int(block[1])


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """Inference parallelism: engines x pipeline stages x tensor-parallel ranks.

    Worker side rank of (engine e, stage s, TP rank t) is `(e * pp + s) * tp + t`.
    `ep`: MoE experts are split whole over an engine's TP ranks instead of TP-sharded."""

    engines: int = 1
    pp: int = 1
    tp: int = 1
    ep: bool = False
    vocab_pad: int = 64
    """Vocabulary rows are padded to a multiple of `vocab_pad * tp` (as vLLM does)."""

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
        step = self.vocab_pad * self.tp
        return -(-vocab // step) * step
