"""A small Llama-style transformer with Hugging Face parameter names, and its
FSDP2 trainer and tensor-parallel worker builders for the examples.

`TinyLlama(LlamaShape())` has about 66M parameters. Trainer ranks shard it with
FSDP2 (`fully_shard`, `Shard(0)`) over their own Gloo process group; worker
ranks hold column / row / vocab-parallel shards of the same names.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from rl_sync.engine.sources import Destination
from rl_sync.layout import Layout, Mesh, Replicate, Shard


@dataclass(frozen=True, kw_only=True)
class LlamaShape:
    """Model size (defaults: about 66M parameters)."""

    vocab: int = 32000
    """Vocabulary size."""
    hidden: int = 512
    """Hidden size."""
    layers: int = 8
    """Decoder layers."""
    heads: int = 8
    """Attention heads."""
    intermediate: int = 2048
    """MLP size."""


class Block(nn.Module):
    def __init__(self, s: LlamaShape):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(s.hidden)
        self.self_attn = nn.ModuleDict({n: nn.Linear(s.hidden, s.hidden, bias=False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")})
        self.post_attention_layernorm = nn.RMSNorm(s.hidden)
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(s.hidden, s.intermediate, bias=False),
                                  "up_proj": nn.Linear(s.hidden, s.intermediate, bias=False),
                                  "down_proj": nn.Linear(s.intermediate, s.hidden, bias=False)})
        self.heads = s.heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.self_attn
        h = self.input_layernorm(x)
        b, t, d = h.shape
        q, k, v = (a[n](h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + a["o_proj"](att)
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m["down_proj"](F.silu(m["gate_proj"](h)) * m["up_proj"](h))


class TinyLlama(nn.Module):
    """Embedding, `layers` blocks, final norm, untied LM head."""

    def __init__(self, s: LlamaShape):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(s.vocab, s.hidden)
        self.model.layers = nn.ModuleList(Block(s) for _ in range(s.layers))
        self.model.norm = nn.RMSNorm(s.hidden)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(tokens)
        for block in self.model.layers:
            x = block(x)
        return self.lm_head(self.model.norm(x))


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_fsdp_trainer(actor, shape: LlamaShape, init_method: str, lr: float = 1e-4) -> None:
    """Inside trainer actor `actor`: join the trainers' Gloo group, build and FSDP2-shard the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=init_method, rank=actor.rank, world_size=actor.size)
    torch.manual_seed(0)
    model = TinyLlama(shape)
    mesh = init_device_mesh("cpu", (actor.size,))
    for block in model.model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    actor.state["model"] = model
    actor.state["optim"] = torch.optim.AdamW(model.parameters(), lr=lr)
    actor.held.clear()
    actor.held.update(dict(model.named_parameters()))


def train_step(actor, seed: int, batch: int = 4, length: int = 32) -> float:
    """One next-token-prediction step on random tokens (same batch on every rank)."""
    model, optim = actor.state["model"], actor.state["optim"]
    tokens = torch.randint(0, model.lm_head.out_features, (batch, length + 1), generator=torch.Generator().manual_seed(seed))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.item()


def local_shards(actor) -> dict[str, torch.Tensor]:
    """Inside a trainer: every parameter's local FSDP shard."""
    return {name: p.to_local().detach().clone() for name, p in actor.held.items()}


def tp_layout(name: str, engines: int, tp: int) -> Layout:
    """Column-parallel q/k/v/gate/up, row-parallel o/down, vocab-parallel embed/head, replicated norms."""
    mesh = Mesh((engines, tp))
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        return Layout(mesh, (Replicate(), Shard(1)))
    if "norm" in name:
        return Layout.replicated(mesh)
    return Layout(mesh, (Replicate(), Shard(0)))


def tp_destinations(shape: LlamaShape, engines: int, tp: int):
    """A `build(rank, size)` for workers: zeroed TP shards of every parameter."""
    def build(rank: int, size: int):
        with torch.device("meta"):
            names = {n: tuple(p.shape) for n, p in TinyLlama(shape).named_parameters()}
        out = {}
        for name, full in names.items():
            layout = tp_layout(name, engines, tp)
            box = layout.local_box(full, rank)
            out[name] = Destination(torch.zeros(box.sizes), layout, full, torch.float32)
        return out
    return build


def worker_shards(actor) -> dict[str, torch.Tensor]:
    """Inside a worker: its live TP shards."""
    return {name: d.view.clone() for name, d in actor.held.items()}
