"""Flat-index patches, the drop-in for vLLM's sparse patch interface.

`SparseWeightPatch(name, indices, values)` sets `values` at flat (row-major)
`indices` of the whole checkpoint tensor `name`. `route_patch` checks a patch
against the plan's spec (name, dtype, shape) and cuts out the part one worker
keeps, as flat indices local to that worker's box, so a patch works for any
destination layout (TP shards, fused slots, expert groups, pipeline stages).

Typical use::

    sync.push_patches([SparseWeightPatch("lm_head.weight", idx, vals)])
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..planning.layout import Box


@dataclass(frozen=True)
class SparseWeightPatch:
    """New `values` at flat `indices` of the whole tensor `name`."""

    name: str
    indices: torch.Tensor
    values: torch.Tensor


def check_patch(patch: SparseWeightPatch, dtype: str, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted int64 indices, values) of a valid patch; `ValueError` naming what is wrong."""
    what = f"patch for {patch.name!r}"
    if not isinstance(patch.indices, torch.Tensor) or not isinstance(patch.values, torch.Tensor):
        raise ValueError(f"{what}: indices and values must be tensors")
    if patch.indices.ndim != 1 or patch.values.ndim != 1 or patch.indices.numel() != patch.values.numel():
        raise ValueError(
            f"{what}: indices and values must be 1-D and of one length, got {tuple(patch.indices.shape)} "
            f"and {tuple(patch.values.shape)}"
        )
    if patch.indices.dtype.is_floating_point or patch.indices.dtype == torch.bool:
        raise ValueError(f"{what}: indices must be integers, got {patch.indices.dtype}")
    if str(patch.values.dtype).removeprefix("torch.") != dtype:
        raise ValueError(f"{what}: values are {patch.values.dtype}, the tensor is {dtype}")
    index = patch.indices.to("cpu", torch.int64)
    numel = math.prod(shape)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= numel):
        raise ValueError(
            f"{what}: indices must lie in [0, {numel}) for shape {shape}, got [{int(index.min())}, {int(index.max())}]"
        )
    order = torch.argsort(index, stable=True)
    index, values = index[order], patch.values.to("cpu")[order]
    if index.numel() > 1 and bool((index[1:] == index[:-1]).any()):
        raise ValueError(f"{what}: indices repeat; each element may be patched once")
    return index, values


def route_patch(
    index: torch.Tensor, values: torch.Tensor, shape: tuple[int, ...], box: Box
) -> tuple[torch.Tensor, torch.Tensor]:
    """The part of a checked patch inside `box`, as flat indices local to the box (sorted)."""
    rest, coords = index, []
    for size in reversed(shape):
        coords.append(rest % size)
        rest = rest // size
    coords.reverse()
    inside = torch.ones_like(index, dtype=torch.bool)
    local = torch.zeros_like(index)
    for coord, offset, size in zip(coords, box.offsets, box.sizes):
        inside &= (coord >= offset) & (coord < offset + size)
        local = local * size + (coord - offset)
    return local[inside], values[inside]
