"""Where one PEFT adapter tensor lands in vLLM's LoRA layers, and which box of it a rank keeps.

`locate` maps a saved adapter name to vLLM's LoRA layer and slice the way vLLM's loader
does (its rename mapper, then its packed modules: `q_proj` is slice 0 of `qkv_proj`), and
reads this rank's box off the layer itself: `slice_lora_a` / `slice_lora_b` (what vLLM's
`set_lora` applies at TP > 1) run on a tensor of element indices, and `box_of` finds the box
those indices came from. So column-parallel layers give `lora_A` whole and `lora_B` in row
shards, row-parallel ones `lora_A` in column shards and `lora_B` whole, fully sharded ones
(S-LoRA) what their slicing keeps, without a rule per class; a slicing that keeps no box
(e.g. q, k and v rows of one fused `lora_B`) is refused.

Typical use::

    name = "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"
    target = locate(manager, name, (64, 8), mapper=None, rank=1)
    target.box        # Box((32, 0), (32, 8)) on TP rank 1 of 2: its k rows (one KV head)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..bind.infer import infer_layout
from ..lora import parse_adapter_name
from ..planning.layout import Box, Layout


class Target(NamedTuple):
    """Where one adapter tensor lands on this rank."""

    layer: str
    """vLLM's name of the LoRA layer (e.g. `model.layers.0.self_attn.qkv_proj`)."""
    module: Any
    """The layer (a `BaseLayerWithLoRA`)."""
    part: int
    """Its slice: the sub-module's place in a packed layer, 0 otherwise."""
    matrix: str
    """`A` or `B`."""
    box: Box | None
    """The box of it this rank keeps (None: none)."""


def box_of(kept: torch.Tensor, shape: Sequence[int]) -> Box | None:
    """The box of a tensor of `shape` whose elements, numbered in row-major order, `kept` holds
    (None when it holds none); `ValueError` when they are no box of it."""
    if kept.numel() == 0:
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    first = int(kept.reshape(-1)[0])
    offsets = tuple((first // s) % n for s, n in zip(strides, shape))
    box = Box(offsets, tuple(kept.shape))
    if len(kept.shape) != len(shape) or any(e > n for e, n in zip(box.ends, shape)):
        raise ValueError(f"no box of a {tuple(shape)} tensor")
    whole = torch.arange(math.prod(shape), dtype=torch.float64).reshape(tuple(shape))
    if not torch.equal(kept.to(torch.float64), whole[tuple(slice(o, e) for o, e in zip(box.offsets, box.ends))]):
        raise ValueError(f"no box of a {tuple(shape)} tensor")
    return box


def kept_box(module, index: int, matrix: str, shape: tuple[int, ...]) -> Box | None:
    """The box of an adapter matrix of `shape` that `module`'s slicing keeps on this rank."""
    if module.tp_size == 1:  # vLLM's set_lora slices nothing then
        return Box((0,) * len(shape), shape)
    numbered = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)
    cut = module.slice_lora_a if matrix == "A" else module.slice_lora_b
    if module.n_slices == 1:
        return box_of(cut(numbered), shape)
    pieces: list = [None] * module.n_slices
    pieces[index] = numbered
    return box_of(cut(pieces)[index], shape)


def locate(manager, name: str, shape: tuple[int, ...], mapper, rank: int) -> Target:
    """The layer, slice and box of adapter tensor `name` of global `shape` on this rank;
    `ValueError` for a module vLLM keeps no LoRA layer for, or a slicing that keeps no box."""
    from vllm.lora.utils import parse_fine_tuned_lora_name

    try:
        matrix = parse_adapter_name(name).matrix
    except ValueError as exc:
        raise ValueError(f"vLLM rank {rank}: {exc}") from None
    module_name, _ = parse_fine_tuned_lora_name(name, mapper)
    layer, index = _layer_of(manager, module_name)
    if layer is None:
        packed = {m for subs in manager.packed_modules_mapping.values() for m in subs}
        supported = sorted((set(manager.supported_lora_modules) - set(manager.packed_modules_mapping)) | packed)
        raise ValueError(
            f"vLLM rank {rank}: adapter tensor {name!r} adapts {module_name!r}, which vLLM's engine keeps no LoRA "
            f"layer for (its LoRA modules: {', '.join(supported)}); target only those modules"
        )
    module = manager.modules[layer]
    try:
        box = kept_box(module, index, matrix, shape)
    except ValueError as exc:
        raise ValueError(
            f"vLLM rank {rank}: adapter tensor {name!r}: vLLM's {type(module).__name__} keeps {exc}; LoRA rounds "
            "take layers whose slicing keeps one box per rank"
        ) from None
    return Target(layer, module, index, matrix, box)


def _layer_of(manager, module_name: str) -> tuple[str | None, int]:
    """vLLM's LoRA layer adapting `module_name` and the slice it fills (packed sub-modules fill
    one slice each); (None, 0) where there is none."""
    if module_name in manager.modules and manager.modules[module_name].n_slices == 1:
        return module_name, 0
    for packed, subs in manager.packed_modules.items():
        if module_name in subs and manager.modules[packed].n_slices == len(subs):
            return packed, subs.index(module_name)
    return None, 0


def check_fits(target: Target, name: str, rank: int) -> None:
    """`ValueError` unless this rank's box of `name` fits the slot as vLLM's `set_lora` copies
    it (`[:rows, :cols]` of the slot): it fills the slot's input (A) or output (B) size and
    its rank fits the slot's."""
    room = tuple(_stacked(target).shape[2:])
    if target.box is None:
        raise ValueError(
            f"vLLM rank {rank}: adapter tensor {name!r}: vLLM's slot of {target.layer!r} on this rank keeps none "
            "of it. A fully sharded LoRA layer (fully_sharded_loras=True) splits the slot's max_lora_rank rows "
            "over the ranks, so an adapter of a smaller rank leaves some ranks none, which LoRA rounds do not "
            "take: start the engine with max_lora_rank equal to the adapter's rank, or without fully_sharded_loras"
        )
    sizes = target.box.sizes
    full = 1 if target.matrix == "A" else 0
    if sizes[full] != room[full] or sizes[1 - full] > room[1 - full]:
        raise ValueError(
            f"vLLM rank {rank}: adapter tensor {name!r} gives this rank a {sizes} box, but vLLM's slot of "
            f"{target.layer!r} holds {room} (the adapter was trained on another model, or its rank exceeds the slot)"
        )


def slot_view(target: Target, slot: int) -> torch.Tensor:
    """This rank's box of the tensor in LoRA slot `slot` (`check_fits` passed)."""
    assert target.box is not None  # (check_fits refuses a rank that keeps none)
    sizes = target.box.sizes
    return _stacked(target)[slot, 0, : sizes[0], : sizes[1]]


def _stacked(target: Target) -> torch.Tensor:
    return (target.module.lora_a_stacked if target.matrix == "A" else target.module.lora_b_stacked)[target.part]


def layout_of(name: str, shape: tuple[int, ...], boxes: Sequence[Box | None], rank: int) -> Layout:
    """The layout over the engine's ranks giving each rank its box; `ValueError` when none does."""
    layout = infer_layout(shape, boxes)
    if layout is None:
        raise ValueError(
            f"vLLM rank {rank}: adapter tensor {name!r} {shape}: the engine's ranks keep boxes "
            f"{[str(b) for b in boxes]}, which no layout gives"
        )
    return layout
