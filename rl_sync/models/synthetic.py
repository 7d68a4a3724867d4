"""Synthetic models: realistic checkpoint tensors and layouts, without weights.

Used by the planner report (`rl-sync plan`), benchmarks and tests to describe
models from a dense 8B to a Kimi-K2-shaped 1T MoE by their shapes alone, with
Hugging Face checkpoint names, trainer layouts (FSDP `Shard(0)`, HSDP, expert
parallel groups) and inference layouts (engines x tensor parallel: column and
row parallel linears, vocab-parallel embeddings, replicated norms, GQA KV heads
replicated when TP exceeds them, experts split over an engine's ranks).

Typical use::

    specs = model_specs(ModelShape(...), TrainerParallel(ranks=8),
                        InferenceParallel(engines=2, tensor_parallel=4))
    plan = plan_model(specs)
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

from ..planning.layout import Layout, Mesh, Replicate, Shard
from ..planning.plan import TensorSpec
from ..planning.quant import FP8_DTYPE, SCALE_DTYPE, dest_scale_layout, grid_shape, scale_name, source_scale_layout


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Architecture hyper-parameters (Hugging Face config names where they exist)."""

    layers: int
    """Decoder layers."""
    hidden: int
    """Hidden size."""
    vocab: int
    """Vocabulary size."""
    heads: int
    """Attention (query) heads."""
    kv_heads: int
    """Key/value heads (GQA); ignored for MLA."""
    head_dim: int
    """Per-head dim of q/k/v (GQA)."""
    intermediate: int
    """FFN size of dense layers."""
    attention: Literal["gqa", "mla"] = "gqa"
    """GQA (Llama/Qwen) or multi-head latent attention (DeepSeek-V3/Kimi-K2)."""
    q_lora_rank: int = 0
    """MLA query compression rank."""
    kv_lora_rank: int = 0
    """MLA key/value compression rank."""
    qk_nope_head_dim: int = 0
    """MLA per-head non-rotary q/k dim."""
    qk_rope_head_dim: int = 0
    """MLA per-head rotary q/k dim."""
    v_head_dim: int = 0
    """MLA per-head value dim."""
    experts: int = 0
    """Routed experts per MoE layer (0: dense model)."""
    shared_experts: int = 0
    """Shared experts per MoE layer (one fused MLP of this many expert widths)."""
    expert_intermediate: int = 0
    """FFN size of one expert."""
    first_dense_layers: int = 0
    """Leading layers with a dense FFN in an MoE model."""
    qkv_bias: bool = False
    """Biases on q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """Per-head RMS norms on q and k (Qwen3)."""
    tie_embeddings: bool = False
    """lm_head shares embed_tokens."""
    dtype: str = "bfloat16"
    """Dtype name of every weight."""
    fp8_block: tuple[int, ...] = ()
    """Inference keeps the projection and expert weights in FP8 with fp32 scales over blocks of
    this size (e.g. [128, 128]), as DeepSeek-V3 and Kimi-K2 serve them; () keeps `dtype`."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "vocab", "heads", "intermediate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelShape.{name} must be > 0, got {getattr(self, name)}")
        if self.attention not in ("gqa", "mla"):
            raise ValueError(f"ModelShape.attention must be 'gqa' or 'mla', got {self.attention!r}")
        if self.experts and self.expert_intermediate <= 0:
            raise ValueError("ModelShape.expert_intermediate must be > 0 when experts > 0")


@dataclass(frozen=True, kw_only=True)
class TrainerParallel:
    """Trainer ranks `[0, ranks)`: FSDP `Shard(0)`, optionally HSDP and expert parallel."""

    ranks: int
    """Trainer ranks."""
    replicate: int = 1
    """HSDP replica groups (mesh `(replicate, ranks // replicate)`, `(Replicate, Shard(0))`)."""
    expert_parallel: int = 1
    """Expert groups: expert e lives on group `e * ep // experts`, FSDP inside the group."""

    def __post_init__(self) -> None:
        if self.ranks <= 0 or self.replicate <= 0 or self.expert_parallel <= 0:
            raise ValueError("TrainerParallel fields must be > 0")
        if self.ranks % (self.replicate * self.expert_parallel):
            raise ValueError(
                f"TrainerParallel.ranks ({self.ranks}) must be divisible by replicate x "
                f"expert_parallel ({self.replicate} x {self.expert_parallel})"
            )


@dataclass(frozen=True, kw_only=True)
class InferenceParallel:
    """Inference ranks after the trainers: `engines` replicas of `tensor_parallel` ranks."""

    engines: int
    """Engine replicas."""
    tensor_parallel: int
    """Ranks per engine."""
    expert_parallel: bool = False
    """Split experts over an engine's ranks (whole experts) instead of TP-sharding each."""

    def __post_init__(self) -> None:
        if self.engines <= 0 or self.tensor_parallel <= 0:
            raise ValueError("InferenceParallel.engines and tensor_parallel must be > 0")


class _Layouts:
    """Trainer and inference layouts for each kind of tensor."""

    def __init__(self, model: ModelShape, trainer: TrainerParallel, infer: InferenceParallel):
        self.model, self.trainer, self.infer = model, trainer, infer
        engines = Mesh((infer.engines, infer.tensor_parallel), start_rank=trainer.ranks)
        r = trainer.replicate
        self.fsdp = Layout(Mesh((r, trainer.ranks // r)), (Replicate(), Shard(0)))
        self._column = Layout(engines, (Replicate(), Shard(0)))
        self._row = Layout(engines, (Replicate(), Shard(1)))
        self._replicated = Layout.replicated(engines)

    def column(self) -> Layout:
        return self._column

    def row(self) -> Layout:
        return self._row

    def replicated(self) -> Layout:
        return self._replicated

    @functools.lru_cache(maxsize=None)
    def kv_column(self, kv_heads: int) -> Layout:
        """KV projections: shard heads; when TP > heads, replicate each head over TP / heads ranks."""
        tp = self.infer.tensor_parallel
        if tp <= kv_heads:
            return self.column()
        if tp % kv_heads:
            raise ValueError(f"tensor_parallel {tp} must divide or be a multiple of kv_heads {kv_heads}")
        ranks = [[[e * tp + h * (tp // kv_heads) + j + self.trainer.ranks for j in range(tp // kv_heads)]
                  for h in range(kv_heads)] for e in range(self.infer.engines)]
        return Layout(Mesh.from_ranks(ranks), (Replicate(), Shard(0), Replicate()))

    @functools.lru_cache(maxsize=None)
    def expert_src(self, expert: int) -> Layout:
        """Trainer layout of `expert` (one object per expert group)."""
        return self._group_src(expert * self.trainer.expert_parallel // self.model.experts)

    @functools.lru_cache(maxsize=None)
    def _group_src(self, group: int) -> Layout:
        t = self.trainer
        size = t.ranks // t.expert_parallel
        if t.replicate > 1:
            per = size // t.replicate
            ranks = [[group * size + k * per + i for i in range(per)] for k in range(t.replicate)]
            return Layout(Mesh.from_ranks(ranks), (Replicate(), Shard(0)))
        return Layout(Mesh((size,), start_rank=group * size), (Shard(0),))

    def expert_dst(self, expert: int, dim: int) -> Layout:
        if not self.infer.expert_parallel:
            return self.column() if dim == 0 else self.row()
        return self._owner_dst(expert * self.infer.tensor_parallel // self.model.experts)

    @functools.lru_cache(maxsize=None)
    def _owner_dst(self, owner: int) -> Layout:
        tp = self.infer.tensor_parallel
        ranks = [self.trainer.ranks + e * tp + owner for e in range(self.infer.engines)]
        return Layout(Mesh.from_ranks(ranks), (Replicate(),))


def _attention(m: ModelShape, lay: _Layouts, prefix: str) -> Iterator[tuple[str, tuple[int, ...], Layout]]:
    h = m.hidden
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        yield f"{prefix}.q_a_proj.weight", (m.q_lora_rank, h), lay.replicated()
        yield f"{prefix}.q_a_layernorm.weight", (m.q_lora_rank,), lay.replicated()
        yield f"{prefix}.q_b_proj.weight", (m.heads * qk, m.q_lora_rank), lay.column()
        yield f"{prefix}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h), lay.replicated()
        yield f"{prefix}.kv_a_layernorm.weight", (m.kv_lora_rank,), lay.replicated()
        yield f"{prefix}.kv_b_proj.weight", (m.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), lay.column()
        yield f"{prefix}.o_proj.weight", (h, m.heads * m.v_head_dim), lay.row()
        return
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    yield f"{prefix}.q_proj.weight", (q, h), lay.column()
    yield f"{prefix}.k_proj.weight", (kv, h), lay.kv_column(m.kv_heads)
    yield f"{prefix}.v_proj.weight", (kv, h), lay.kv_column(m.kv_heads)
    if m.qkv_bias:
        yield f"{prefix}.q_proj.bias", (q,), lay.column()
        yield f"{prefix}.k_proj.bias", (kv,), lay.kv_column(m.kv_heads)
        yield f"{prefix}.v_proj.bias", (kv,), lay.kv_column(m.kv_heads)
    if m.qk_norm:
        yield f"{prefix}.q_norm.weight", (m.head_dim,), lay.replicated()
        yield f"{prefix}.k_norm.weight", (m.head_dim,), lay.replicated()
    yield f"{prefix}.o_proj.weight", (h, q), lay.row()


def _mlp(prefix: str, hidden: int, inter: int, lay: _Layouts) -> Iterator[tuple[str, tuple[int, ...], Layout]]:
    yield f"{prefix}.gate_proj.weight", (inter, hidden), lay.column()
    yield f"{prefix}.up_proj.weight", (inter, hidden), lay.column()
    yield f"{prefix}.down_proj.weight", (hidden, inter), lay.row()


def _layer(m: ModelShape, lay: _Layouts, i: int) -> Iterator[TensorSpec]:
    prefix, h = f"model.layers.{i}", m.hidden
    fsdp = lay.fsdp
    dense = [(f"{prefix}.input_layernorm.weight", (h,), lay.replicated())]
    dense += list(_attention(m, lay, f"{prefix}.self_attn"))
    dense += [(f"{prefix}.post_attention_layernorm.weight", (h,), lay.replicated())]
    if not m.experts or i < m.first_dense_layers:
        dense += list(_mlp(f"{prefix}.mlp", h, m.intermediate, lay))
    else:
        dense += [(f"{prefix}.mlp.gate.weight", (m.experts, h), lay.replicated())]
        if m.shared_experts:
            dense += list(_mlp(f"{prefix}.mlp.shared_experts", h, m.shared_experts * m.expert_intermediate, lay))
    for name, shape, dst in dense:
        yield from _specs(m, name, shape, fsdp, dst)
    if m.experts and i >= m.first_dense_layers:
        for e in range(m.experts):
            src, e_prefix, inter = lay.expert_src(e), f"{prefix}.mlp.experts.{e}", m.expert_intermediate
            for name, shape, dst in _mlp(e_prefix, h, inter, lay):
                dim = 1 if name.endswith("down_proj.weight") else 0
                yield from _specs(m, name, shape, src, lay.expert_dst(e, dim))


_UNQUANTIZED = ("norm.weight", "layernorm.weight", "mlp.gate.weight", "bias")
"""Norms, routers and biases stay in `dtype` on FP8 engines (as in DeepSeek-V3's checkpoint)."""


def _specs(m: ModelShape, name: str, shape: tuple[int, ...], src: Layout, dst: Layout) -> Iterator[TensorSpec]:
    """The tensor, or with `m.fp8_block` a projection's FP8 values and their scale grid."""
    if not m.fp8_block or len(shape) != 2 or name.endswith(_UNQUANTIZED):
        yield TensorSpec(name, m.dtype, shape, src, dst)
        return
    block = tuple(m.fp8_block)
    what = f"tensor {name!r}"
    yield TensorSpec(name, FP8_DTYPE, shape, src, dst, block)
    yield TensorSpec(scale_name(name), SCALE_DTYPE, grid_shape(shape, block, what),
                     source_scale_layout(src, shape, block, what), dest_scale_layout(dst, shape, block, what))


def model_specs(model: ModelShape, trainer: TrainerParallel, inference: InferenceParallel) -> list[TensorSpec]:
    """Every checkpoint tensor of `model` with its trainer and inference layout."""
    lay = _Layouts(model, trainer, inference)
    vocab_parallel = lay.column()
    specs = [TensorSpec("model.embed_tokens.weight", model.dtype, (model.vocab, model.hidden), lay.fsdp, vocab_parallel)]
    for i in range(model.layers):
        specs.extend(_layer(model, lay, i))
    specs.append(TensorSpec("model.norm.weight", model.dtype, (model.hidden,), lay.fsdp, lay.replicated()))
    if not model.tie_embeddings:
        specs.append(TensorSpec("lm_head.weight", model.dtype, (model.vocab, model.hidden), lay.fsdp, vocab_parallel))
    return specs
