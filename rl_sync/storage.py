"""Where tensors live: a trainer's local shard, a worker's live destination.

Plain records shared by the engine (which reads and writes them) and the
binder (which builds destinations from rules).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from .planning.layout import Layout


@dataclass(frozen=True)
class Sharded:
    """A trainer's local shard of a tensor of global `shape` laid out by `layout`."""

    local: torch.Tensor
    """The rank-local tensor that holds this trainer's box."""
    layout: Layout
    shape: tuple[int, ...]


class Slot(NamedTuple):
    """Where an engine keeps the tensor a destination's view was cut from: `holder[key]` (a
    module's `_parameters` and the parameter's name, a dict of weights and its key)."""

    holder: Mapping
    key: str


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
    slot: Slot | None = field(default=None, compare=False)
    """Where the engine keeps the tensor `local` was cut from, when it may put a new one there
    (`module.weight = Parameter(...)`): each round looks, and cuts `local` again from a new one of
    the same shape, strides and dtype (`rl_sync.rank.watch`)."""
