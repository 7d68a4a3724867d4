"""Synthetic models: realistic checkpoint tensors and layouts, without weights.

Used by the planner report (`rl-sync plan`), benchmarks, the notebook and tests
to describe models from a dense 8B to a Kimi-K2-shaped 1T MoE by their shapes
alone: Hugging Face checkpoint names and shapes (`checkpoint_tensors`), trainer
layouts (FSDP `Shard(0)`, HSDP, expert parallel groups: `TrainerParallel`) and
inference layouts from the binder's rules (`Binder.destination`), the code a
worker binds with at runtime, so a synthetic model is laid out exactly as an
engine would hold it (vocab-parallel embeddings padded as vLLM pads them, GQA
KV heads replicated when TP exceeds them, MLA, shared and routed experts).

Typical use::

    specs = model_specs(ModelConfig(family="llama", ...), TrainerParallel(ranks=8),
                        Parallel(engines=2, tp=4))
    plan = plan_model(specs)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..bind.binder import Binder
from ..config.sync import check_int
from ..planning.layout import MAX_MESH_RANKS, Layout, Mesh, Replicate, Shard
from ..planning.plan import TensorSpec
from ..planning.quant import FP8_DTYPE, SCALE_DTYPE, dest_scale_layout, grid_shape, scale_name, source_scale_layout
from .config import ModelConfig, Parallel


class CheckpointTensor(NamedTuple):
    """One tensor of a Hugging Face checkpoint: name, shape, dtype name, the routed expert it
    belongs to (None for the rest), and whether the model holds it as a buffer (FSDP shards
    parameters only: every trainer rank holds a buffer whole)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    expert: int | None = None
    buffer: bool = False


@dataclass(frozen=True, kw_only=True)
class TrainerParallel:
    """Trainer ranks `[0, ranks)`: FSDP `Shard(0)`, optionally HSDP and expert parallel."""

    ranks: int
    """Trainer ranks."""
    replicate: int = 1
    """HSDP replica groups (mesh `(replicate, ranks // replicate)`, `(Replicate, Shard(0))`)."""
    expert_groups: int = 1
    """Expert groups: expert e lives on group `e * expert_groups // experts`, FSDP inside the group."""

    def __post_init__(self) -> None:
        check_int("TrainerParallel.ranks", self.ranks, 1, MAX_MESH_RANKS)
        check_int("TrainerParallel.replicate", self.replicate, 1, self.ranks)
        check_int("TrainerParallel.expert_groups", self.expert_groups, 1, self.ranks)
        if self.ranks % (self.replicate * self.expert_groups):
            raise ValueError(
                f"TrainerParallel.ranks ({self.ranks}) must be divisible by replicate x "
                f"expert_groups ({self.replicate} x {self.expert_groups})"
            )


class _Sources:
    """Trainer layouts: FSDP (or HSDP) over every trainer rank, routed experts inside their group,
    buffers whole on every rank."""

    def __init__(self, model: ModelConfig, trainer: TrainerParallel):
        self.model, self.trainer = model, trainer
        r = trainer.replicate
        self.fsdp = Layout(Mesh((r, trainer.ranks // r)), (Replicate(), Shard(0)))
        self.whole = Layout.replicated(self.fsdp.mesh)
        self._groups: dict[int, Layout] = {}

    def of(self, tensor: CheckpointTensor) -> Layout:
        if tensor.buffer:
            return self.whole
        expert = tensor.expert
        if expert is None:
            return self.fsdp
        group = expert * self.trainer.expert_groups // self.model.experts
        if group not in self._groups:
            self._groups[group] = self._group(group)
        return self._groups[group]

    def _group(self, group: int) -> Layout:
        t = self.trainer
        size = t.ranks // t.expert_groups
        if t.replicate > 1:
            per = size // t.replicate
            ranks = [[group * size + k * per + i for i in range(per)] for k in range(t.replicate)]
            return Layout(Mesh.from_ranks(ranks), (Replicate(), Shard(0)))
        return Layout(Mesh((size,), start_rank=group * size), (Shard(0),))


def _attention(m: ModelConfig, prefix: str) -> Iterator[tuple[str, tuple[int, ...]]]:
    h = m.hidden
    if m.attention == "mla":
        q = m.heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        if m.q_lora_rank:
            yield f"{prefix}.q_a_proj.weight", (m.q_lora_rank, h)
            yield f"{prefix}.q_a_layernorm.weight", (m.q_lora_rank,)
            yield f"{prefix}.q_b_proj.weight", (q, m.q_lora_rank)
        else:
            yield f"{prefix}.q_proj.weight", (q, h)
        yield f"{prefix}.kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, h)
        yield f"{prefix}.kv_a_layernorm.weight", (m.kv_lora_rank,)
        yield f"{prefix}.kv_b_proj.weight", (m.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        yield f"{prefix}.o_proj.weight", (h, m.heads * m.v_head_dim)
        return
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    yield f"{prefix}.q_proj.weight", (q, h)
    yield f"{prefix}.k_proj.weight", (kv, h)
    yield f"{prefix}.v_proj.weight", (kv, h)
    if m.qkv_bias:
        yield f"{prefix}.q_proj.bias", (q,)
        yield f"{prefix}.k_proj.bias", (kv,)
        yield f"{prefix}.v_proj.bias", (kv,)
    if m.qk_norm:
        yield f"{prefix}.q_norm.weight", (m.head_dim,)
        yield f"{prefix}.k_norm.weight", (m.head_dim,)
    yield f"{prefix}.o_proj.weight", (h, q)


def _mlp(
    prefix: str, hidden: int, inter: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
) -> Iterator[tuple[str, tuple[int, ...]]]:
    gate, up, down = names
    yield f"{prefix}.{gate}.weight", (inter, hidden)
    yield f"{prefix}.{up}.weight", (inter, hidden)
    yield f"{prefix}.{down}.weight", (hidden, inter)


def _layer(m: ModelConfig, i: int) -> Iterator[CheckpointTensor]:
    prefix, h = f"model.layers.{i}", m.hidden
    dense: list[tuple[str, tuple[int, ...]]] = [(f"{prefix}.input_layernorm.weight", (h,))]
    dense += list(_attention(m, f"{prefix}.self_attn"))
    dense += [(f"{prefix}.post_attention_layernorm.weight", (h,))]
    moe = m.experts and i >= m.first_dense_layers
    if not moe:
        dense += list(_mlp(f"{prefix}.mlp", h, m.intermediate))
    yield from (CheckpointTensor(name, shape, m.dtype) for name, shape in dense)
    if not moe:
        return
    block = f"{prefix}.block_sparse_moe" if m.family == "mixtral" else f"{prefix}.mlp"
    yield CheckpointTensor(f"{block}.gate.weight", (m.experts, h), m.dtype)
    if m.family == "deepseek_v3":
        yield CheckpointTensor(f"{block}.gate.e_score_correction_bias", (m.experts,), "float32", buffer=True)
    if m.shared_experts:
        yield from (
            CheckpointTensor(name, shape, m.dtype)
            for name, shape in _mlp(f"{block}.shared_experts", h, m.shared_experts * m.moe_intermediate)
        )
    names = ("w1", "w3", "w2") if m.family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    for e in range(m.experts):
        yield from (
            CheckpointTensor(name, shape, m.dtype, e)
            for name, shape in _mlp(f"{block}.experts.{e}", h, m.moe_intermediate, names)
        )


def checkpoint_tensors(model: ModelConfig) -> Iterator[CheckpointTensor]:
    """Every tensor of `model`'s Hugging Face checkpoint, in checkpoint order: Mixtral's
    `block_sparse_moe` names, Qwen2's q/k/v biases, Qwen3's q/k norms, DeepSeek-V3's MLA, shared
    experts and fp32 router score-correction bias, per-expert routed expert weights."""
    yield CheckpointTensor("model.embed_tokens.weight", (model.vocab, model.hidden), model.dtype)
    for i in range(model.layers):
        yield from _layer(model, i)
    yield CheckpointTensor("model.norm.weight", (model.hidden,), model.dtype)
    if not model.tie_embeddings:
        yield CheckpointTensor("lm_head.weight", (model.vocab, model.hidden), model.dtype)


def _specs(t: CheckpointTensor, src: Layout, dst: Layout, block: tuple[int, int] | None) -> Iterator[TensorSpec]:
    """The tensor, or with `block` its FP8 values and their scale grid."""
    if block is None:
        yield TensorSpec(t.name, t.dtype, t.shape, src, dst)
        return
    what = f"tensor {t.name!r}"
    yield TensorSpec(t.name, FP8_DTYPE, t.shape, src, dst, block)
    yield TensorSpec(
        scale_name(t.name),
        SCALE_DTYPE,
        grid_shape(t.shape, block, what),
        source_scale_layout(src, t.shape, block, what),
        dest_scale_layout(dst, t.shape, block, what),
    )


def model_specs(model: ModelConfig, trainer: TrainerParallel, inference: Parallel) -> list[TensorSpec]:
    """Every checkpoint tensor of `model` with its trainer layout and the inference layout the
    binder gives it (worker side ranks placed after the trainers'); with `model.fp8_block`, the
    tensors the binder keeps quantized travel as FP8 plus scales. `ValueError` for a tensor no
    built-in rule binds in place."""
    binder, sources = Binder(model, inference), _Sources(model, trainer)
    side = range(trainer.ranks, trainer.ranks + inference.size)
    placed: dict[Layout, Layout] = {}
    specs: list[TensorSpec] = []
    for t in checkpoint_tensors(model):
        layout = binder.destination(t.name, t.shape)
        if layout not in placed:
            placed[layout] = layout.remapped(side)
        found = binder.match(t.name)
        assert found is not None, t.name  # `destination` raised for a tensor no rule binds
        fp8 = model.fp8_block is not None and binder.quantized(*found)
        specs.extend(_specs(t, sources.of(t), placed[layout], model.fp8_block if fp8 else None))
    return specs
