"""GPU-side builders: FSDP-sharded trainer tensors, TP workers with fused qkv / gate_up slots."""

from __future__ import annotations

import zlib

import torch

from rl_sync.engine.sources import Destination, Sharded
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

HIDDEN, Q, KV, INTER = 256, 256, 64, 512
SHAPES = {
    "q_proj.weight": (Q, HIDDEN),
    "k_proj.weight": (KV, HIDDEN),
    "v_proj.weight": (KV, HIDDEN),
    "o_proj.weight": (HIDDEN, Q),
    "gate_proj.weight": (INTER, HIDDEN),
    "up_proj.weight": (INTER, HIDDEN),
    "down_proj.weight": (HIDDEN, INTER),
    "norm.weight": (HIDDEN,),
}
FUSED = {"qkv": ("q_proj.weight", "k_proj.weight", "v_proj.weight"), "gate_up": ("gate_proj.weight", "up_proj.weight")}


def full(name: str, version: int, device: str) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(zlib.crc32(name.encode()) + version)
    return torch.randn(SHAPES[name], generator=gen).to(torch.bfloat16).to(device)


def dst_layout(name: str, tp: int) -> Layout:
    mesh = Mesh((tp,))
    if name in ("o_proj.weight", "down_proj.weight"):
        return Layout(mesh, (Shard(1),))
    if name == "norm.weight":
        return Layout(mesh, (Replicate(),))
    return Layout(mesh, (Shard(0),))


def _slices(box):
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def trainer_build(version: int = 0):
    def build(rank: int, size: int):
        layout = Layout(Mesh((size,)), (Shard(0),))
        out = {}
        for name, shape in SHAPES.items():
            box = layout.local_box(shape, rank)
            out[name] = Sharded(full(name, version, "cuda")[_slices(box)].contiguous(), layout, shape)
        return out

    return build


def set_version(actor, version: int) -> None:
    layout = Layout(Mesh((actor.size,)), (Shard(0),))
    for name, shape in SHAPES.items():
        actor.held[name].local.copy_(full(name, version, "cuda")[_slices(layout.local_box(shape, actor.rank))])


def worker_build(rank: int, size: int):
    """TP shards; q/k/v live in one fused qkv tensor and gate/up in one gate_up tensor."""
    boxes = {n: dst_layout(n, size).all_boxes(s)[rank] for n, s in SHAPES.items()}  # meshes start at rank 0
    out = {}
    for parts in FUSED.values():
        fused = torch.full(
            (sum(boxes[p].sizes[0] for p in parts), HIDDEN), float("nan"), dtype=torch.bfloat16, device="cuda"
        )
        row = 0
        for p in parts:
            n = boxes[p].sizes[0]
            out[p] = Destination(fused[row : row + n], dst_layout(p, size), SHAPES[p], torch.bfloat16)
            row += n
    for name in ("o_proj.weight", "down_proj.weight", "norm.weight"):
        view = torch.full(boxes[name].sizes, float("nan"), dtype=torch.bfloat16, device="cuda")
        out[name] = Destination(view, dst_layout(name, size), SHAPES[name], torch.bfloat16)
    return out


def read(actor) -> dict:
    return {n: d.local.detach().cpu().contiguous().view(torch.int16) for n, d in actor.held.items()}


def expected(rank: int, size: int, version: int) -> dict:
    return {
        n: full(n, version, "cpu")[_slices(dst_layout(n, size).local_box(s, rank))].contiguous().view(torch.int16)
        for n, s in SHAPES.items()
    }
