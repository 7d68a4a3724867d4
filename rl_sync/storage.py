"""Where tensors live: a trainer's local shard, a worker's live destination.

Plain records shared by the engine (which reads and writes them) and the
binder (which builds destinations from rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .planning.layout import Layout


@dataclass(frozen=True)
class Sharded:
    """A trainer's local shard of a tensor of global `shape` laid out by `layout`."""

    local: torch.Tensor
    """The rank-local tensor that holds this trainer's box."""
    layout: Layout
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Destination:
    """A worker's live storage for its box of a checkpoint tensor.

    `local` is `None` on a worker outside `layout`'s mesh (another pipeline
    stage or expert group): it still reports the layout, for agreement."""

    local: torch.Tensor | None
    """The rank-local tensor (often a view into a live parameter) that holds this worker's box."""
    layout: Layout
    shape: tuple[int, ...]
    dtype: torch.dtype
    fallback: bool = False
    """Delivered whole and handed to the worker's load hook instead of written in place."""
    reason: str = ""
    """Why it falls back (`fallback` only): the sync summary groups fallbacks by it."""
    block: tuple[int, ...] = ()
    """Kept block-quantized (`rl_sync.planning.quant`): `local` holds float8_e4m3fn values, and the
    destination named `scale_name(name)` the fp32 scale of each block of this size."""


def geometry(tensor: torch.Tensor) -> tuple:
    """Where `tensor`'s elements live and how they are laid out: storage address (with offset),
    shape, strides and dtype. A tensor resized, reshaped, or given other storage in place
    (`p.data = ...`, `set_`, `resize_`) differs here afterwards."""
    return tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor.dtype


def owner(view: torch.Tensor) -> torch.Tensor:
    """The tensor `view` was cut from (a parameter, for a slice of one), or `view` itself: the
    object an engine moves when it reallocates its weights."""
    return view if view._base is None else view._base
