"""One worker rank's part of an inference-style Llama / Qwen / MoE model.

Parameters are laid out as an inference engine holds them: fused `qkv_proj`
(this rank's q heads, then its k and v heads; KV heads replicated when TP
exceeds them), fused `gate_up_proj`, row-parallel `o_proj` / `down_proj`,
vocab-parallel `embed_tokens` / `lm_head` padded as vLLM pads them
(`Parallel.padded_vocab`), stacked MoE experts (`w13_weight` gate|up,
`w2_weight`) split whole over TP ranks (expert parallel) or TP-sharded after
`first_dense_layers` dense ones, and only this pipeline stage's layers (GQA
families only: MLA and shared experts are refused). With `cfg.fp8_block` the
projections and experts are block-quantized FP8 as vLLM holds them (`weight`
in float8_e4m3fn plus `weight_scale_inv`, one fp32 scale per block; fused slots
stacked in both) and are dequantized on the fly. `forward` runs this rank's stage with the TP group's all-reduces and
all-gathers; the numerics follow Hugging Face's modeling code so a synced model
reproduces the trainer's logits.

Typical use (every TP rank of a stage, same inputs)::

    model = TPModel(cfg, par, rank)            # zeroed parameters, then bind and sync into them
    logits = model.forward(tokens, tp_group)   # a single-stage model
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..planning.quant import LIVE_SCALE_SUFFIX, grid_shape
from .config import ModelConfig, Parallel


class TPModel:
    """Parameters (`params`, by inference name) and the forward pass of one worker rank."""

    def __init__(
        self,
        cfg: ModelConfig,
        par: Parallel,
        rank: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if cfg.attention != "gqa" or cfg.shared_experts:
            raise ValueError(
                f"TPModel has no forward for {cfg.family} (MLA attention, shared experts); bind such a "
                "model into vLLM (actors.vllm.VllmEngine) instead"
            )
        if cfg.heads % par.tp or (cfg.kv_heads % par.tp and par.tp % cfg.kv_heads):
            raise ValueError(
                f"tp {par.tp} must divide heads {cfg.heads} and divide or be a multiple of kv_heads {cfg.kv_heads}"
            )
        self.cfg, self.par, self.rank = cfg, par, rank
        self.engine, self.stage, self.tp_rank = par.coords(rank)
        self.dtype, self.device = dtype, torch.device(device)
        self.params: dict[str, torch.Tensor] = {}
        self.layers = [i for i in range(cfg.layers) if par.stage_of(i, cfg.layers) == self.stage]
        self._allocate()

    def _add(self, name: str, *shape: int) -> None:
        self.params[name] = torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _add_weight(self, name: str, *shape: int) -> None:
        """A projection or expert weight: FP8 values and block scales in a quantized model."""
        block = self.cfg.fp8_block
        if block is None:
            self._add(name, *shape)
        else:
            self.params[name] = torch.zeros(shape, dtype=torch.float8_e4m3fn, device=self.device)
            grid = grid_shape(shape, block, name)
            self.params[name + LIVE_SCALE_SUFFIX] = torch.ones(grid, dtype=torch.float32, device=self.device)

    def weight(self, name: str) -> torch.Tensor:
        """A weight in the model's dtype (dequantized: value x its block's scale)."""
        value, scales, block = self.params[name], self.params.get(name + LIVE_SCALE_SUFFIX), self.cfg.fp8_block
        if scales is None or block is None:  # block is set wherever scales are (`_add_weight`)
            return value
        (bn, bk), (n, k) = block, value.shape[-2:]
        full = scales.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
        return (value.to(torch.float32) * full).to(self.dtype)

    def _allocate(self) -> None:
        cfg, par = self.cfg, self.par
        h, rows = cfg.hidden, par.padded_vocab(cfg.vocab) // par.tp
        first, last = self.stage == 0, self.stage == par.pp - 1
        if first:
            self._add("model.embed_tokens.weight", rows, h)
        for i in self.layers:
            self._layer(i)
        if last:
            self._add("model.norm.weight", h)
            if cfg.tie_embeddings and first:
                self.params["lm_head.weight"] = self.params["model.embed_tokens.weight"]
            else:
                self._add("lm_head.weight", rows, h)

    @property
    def q_local(self) -> int:
        return self.cfg.heads // self.par.tp

    @property
    def kv_local(self) -> int:
        return max(1, self.cfg.kv_heads // self.par.tp)

    def _layer(self, i: int) -> None:
        cfg, par, p = self.cfg, self.par, f"model.layers.{i}"
        h, d = cfg.hidden, cfg.head_dim
        qkv = (self.q_local + 2 * self.kv_local) * d
        self._add(f"{p}.input_layernorm.weight", h)
        self._add(f"{p}.post_attention_layernorm.weight", h)
        self._add_weight(f"{p}.self_attn.qkv_proj.weight", qkv, h)
        if cfg.qkv_bias:
            self._add(f"{p}.self_attn.qkv_proj.bias", qkv)
        if cfg.qk_norm:
            self._add(f"{p}.self_attn.q_norm.weight", d)
            self._add(f"{p}.self_attn.k_norm.weight", d)
        self._add_weight(f"{p}.self_attn.o_proj.weight", h, self.q_local * d)
        if not self._moe_layer(i):
            inter = cfg.intermediate // par.tp
            self._add_weight(f"{p}.mlp.gate_up_proj.weight", 2 * inter, h)
            self._add_weight(f"{p}.mlp.down_proj.weight", h, inter)
            return
        self._add(f"{p}.mlp.gate.weight", cfg.experts, h)
        inter = cfg.moe_intermediate if par.ep else cfg.moe_intermediate // par.tp
        experts = cfg.experts // par.tp if par.ep else cfg.experts
        self._add_weight(f"{p}.mlp.experts.w13_weight", experts, 2 * inter, h)
        self._add_weight(f"{p}.mlp.experts.w2_weight", experts, h, inter)

    def _moe_layer(self, i: int) -> bool:
        return bool(self.cfg.experts) and i >= self.cfg.first_dense_layers

    def forward(self, inputs: torch.Tensor, group=None) -> torch.Tensor:
        """This stage: token ids (stage 0) or hidden states in; hidden states or, on the
        last stage, full-vocabulary logits out. Every TP rank of the stage calls it."""
        x = self._embed(inputs, group) if self.stage == 0 else inputs.to(self.dtype)
        for i in self.layers:
            x = self._block(i, x, group)
        if self.stage < self.par.pp - 1:
            return x
        return self._head(_rms(x, self.params["model.norm.weight"], self.cfg.rms_eps), group)

    def _embed(self, tokens: torch.Tensor, group) -> torch.Tensor:
        weight = self.params["model.embed_tokens.weight"]
        lo = self.tp_rank * weight.shape[0]
        local = (tokens >= lo) & (tokens < lo + weight.shape[0])
        out = F.embedding(torch.where(local, tokens - lo, 0), weight) * local.unsqueeze(-1)
        return _all_reduce(out, group)

    def _head(self, x: torch.Tensor, group) -> torch.Tensor:
        local = x @ self.params["lm_head.weight"].t()
        if group is not None and self.par.tp > 1:
            parts = [torch.empty_like(local) for _ in range(self.par.tp)]
            dist.all_gather(parts, local.contiguous(), group=group)
            local = torch.cat(parts, dim=-1)
        return local[..., : self.cfg.vocab]

    def _block(self, i: int, x: torch.Tensor, group) -> torch.Tensor:
        p = f"model.layers.{i}"
        x = x + self._attention(p, _rms(x, self.params[f"{p}.input_layernorm.weight"], self.cfg.rms_eps), group)
        h = _rms(x, self.params[f"{p}.post_attention_layernorm.weight"], self.cfg.rms_eps)
        return x + (self._moe(p, h, group) if self._moe_layer(i) else self._mlp(p, h, group))

    def _attention(self, p: str, x: torch.Tensor, group) -> torch.Tensor:
        cfg, d = self.cfg, self.cfg.head_dim
        b, t, _ = x.shape
        qkv = F.linear(
            x, self.weight(f"{p}.self_attn.qkv_proj.weight"), self.params.get(f"{p}.self_attn.qkv_proj.bias")
        )
        q, k, v = qkv.split([self.q_local * d, self.kv_local * d, self.kv_local * d], dim=-1)
        q, k, v = (z.view(b, t, -1, d) for z in (q, k, v))
        if cfg.qk_norm:
            q = _rms(q, self.params[f"{p}.self_attn.q_norm.weight"], cfg.rms_eps)
            k = _rms(k, self.params[f"{p}.self_attn.k_norm.weight"], cfg.rms_eps)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = _rope(q, k, cfg.rope_theta)
        k, v = (z.repeat_interleave(self.q_local // self.kv_local, dim=1) for z in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d**-0.5)
        out = out.transpose(1, 2).reshape(b, t, self.q_local * d)
        return _all_reduce(out @ self.weight(f"{p}.self_attn.o_proj.weight").t(), group)

    def _mlp(self, p: str, x: torch.Tensor, group) -> torch.Tensor:
        gate, up = F.linear(x, self.weight(f"{p}.mlp.gate_up_proj.weight")).chunk(2, dim=-1)
        return _all_reduce(F.linear(F.silu(gate) * up, self.weight(f"{p}.mlp.down_proj.weight")), group)

    def _moe(self, p: str, x: torch.Tensor, group) -> torch.Tensor:
        cfg, par = self.cfg, self.par
        flat = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(F.linear(flat, self.params[f"{p}.mlp.gate.weight"]), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        w13, w2 = self.weight(f"{p}.mlp.experts.w13_weight"), self.weight(f"{p}.mlp.experts.w2_weight")
        first = self.tp_rank * w13.shape[0] if par.ep else 0
        out = torch.zeros_like(flat)
        for local in range(w13.shape[0]):
            tokens, slot = torch.nonzero(chosen == first + local, as_tuple=True)
            if tokens.numel():
                gate, up = F.linear(flat[tokens], w13[local]).chunk(2, dim=-1)
                out.index_add_(0, tokens, F.linear(F.silu(gate) * up, w2[local]) * weights[tokens, slot, None])
        return _all_reduce(out.reshape(x.shape), group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def _rope(q: torch.Tensor, k: torch.Tensor, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    d, t = q.shape[-1], q.shape[-2]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.arange(t, dtype=torch.float32)[:, None] * inv[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    return q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
