"""Where a loader's copy of a tensor derived from a checkpoint tensor takes its elements from.

Some of vLLM's loaders copy from a tensor *derived* from the checkpoint's: Bloom
regroups its fused q|k|v heads with a `reshape` that copies, Falcon with
`torch.cat`, gpt-oss transposes experts with `.t().contiguous()`. On meta tensors
such a copy has lost its link to the checkpoint tensor. Fed a tensor whose every
element holds its own flat index (`index_tensor`), the copied values say exactly
where each element came from; `affine_blocks` cuts them into blocks that each take
their elements from one strided view of the checkpoint tensor (`Block`), or says
there is no such cut (values cast or computed, or too scattered to be worth it).

Typical use::

    blocks = affine_blocks(copied_values)      # [Block(slices, offset, strides)] or None
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_BLOCKS = 4096
"""Past this many blocks in one copy, the copy is no set of boxes worth planning."""


def index_tensor(shape: Sequence[int]) -> torch.Tensor:
    """A contiguous int64 tensor of `shape` whose every element is its own flat index."""
    return torch.arange(math.prod(shape), dtype=torch.int64).view(tuple(shape))


@dataclass(frozen=True)
class Block:
    """`values[slices]` are the elements at `offset + sum(i_k * strides[k])` of the checkpoint
    tensor's flat storage, `i` the block's own index."""

    slices: tuple[slice, ...]
    offset: int
    strides: tuple[int, ...]


def _affine(values: torch.Tensor) -> tuple[int, tuple[int, ...]] | None:
    """`(offset, strides)` with `values[i] == offset + sum(i_k * strides[k])`, or None."""
    offset = int(values.reshape(-1)[0])
    strides, expected = [], torch.full(values.shape, offset, dtype=torch.int64)
    for dim, size in enumerate(values.shape):
        step = int(values.narrow(dim, 1, 1).reshape(-1)[0]) - offset if size > 1 else 0
        strides.append(step)
        shape = [1] * values.dim()
        shape[dim] = size
        expected += torch.arange(size, dtype=torch.int64).view(shape) * step
    return (offset, tuple(strides)) if torch.equal(values, expected) else None


def _cut(values: torch.Tensor) -> tuple[int, int] | None:
    """`(dim, index)` to split `values` at: along its first dim of more than one element, where
    the step between consecutive slices' first elements first changes, else its middle."""
    dim = next((d for d, size in enumerate(values.shape) if size > 1), None)
    if dim is None:
        return None
    firsts = values.movedim(dim, 0).reshape(values.shape[dim], -1)[:, 0]
    steps = firsts[1:] - firsts[:-1]
    changed = torch.nonzero(steps != steps[0])
    return dim, int(changed[0]) + 1 if len(changed) else values.shape[dim] // 2


def affine_blocks(values: torch.Tensor) -> list[Block] | None:
    """`values` (int64, each an element's flat index in the checkpoint tensor) as the fewest
    blocks this cutting finds (at most `MAX_BLOCKS`) that are each affine, in row-major order of
    their first elements along the cut dims; None when `values` is not int64 or needs more."""
    if values.dtype != torch.int64 or values.numel() == 0:
        return None
    out: list[Block] = []
    pending = [tuple(slice(0, n) for n in values.shape)]
    while pending:
        where = pending.pop()
        found = _affine(values[where])
        if found is not None:
            out.append(Block(where, *found))
        elif (cut := _cut(values[where])) is not None and len(out) + len(pending) < MAX_BLOCKS:
            dim, index = cut
            start = where[dim].start
            head = where[:dim] + (slice(start, start + index),) + where[dim + 1 :]
            tail = where[:dim] + (slice(start + index, where[dim].stop),) + where[dim + 1 :]
            pending.extend((tail, head))
        else:
            return None
    return out
