"""Exchanging the memory behind two storages in O(1): how a commit makes a round live without a copy.

After `swap_memory(a, b)` every tensor and view over `a` reads what `b` held, and the
other way round; nothing is copied and no tensor object changes (`rl_sync.rank.shadow`,
`rl_sync.vllm.reload`). PyTorch releases that have `UntypedStorage._swap_data_ptr_`
(2.13 here) do it themselves; those without it (2.11, which vLLM 0.26's CUDA build
pins) do it through rl-sync's C++ module `swap.cpp` (`rl_sync.rank.native`: built once
per machine, 10 to 20 s, the first time a process asks). Where neither can be had,
`can_swap()` is False and every commit copies.

    if can_swap():
        swap_memory(live.untyped_storage(), spare.untyped_storage())
        swap_memories(lives, spares)   # many pairs: all or none, one C++ call with the module
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache

import torch

from . import native

Swap = Callable[[Sequence[torch.UntypedStorage], Sequence[torch.UntypedStorage]], None]
"""Exchanges the memory behind a[i] and b[i] for every i, all or none."""


def _pytorchs(a: Sequence[torch.UntypedStorage], b: Sequence[torch.UntypedStorage]) -> None:
    for first, second in zip(a, b):
        _check(first, second)
    for first, second in zip(a, b):
        first._swap_data_ptr_(second)  # type: ignore[attr-defined]  # PyTorch's, untyped (2.13 here)


def _check(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    if a.nbytes() != b.nbytes() or a.device != b.device:
        raise ValueError(
            f"swap: storages of {a.nbytes()} bytes on {a.device} and {b.nbytes()} bytes on {b.device}; "
            "expected the same size on the same device"
        )


def _native() -> Swap | None:
    module = native.swap()
    if module is None:
        return None
    return lambda a, b: module.swap([s._cdata for s in a], [s._cdata for s in b])  # (checks every pair first)


@cache
def _swapper() -> Swap | None:
    return _pytorchs if hasattr(torch.UntypedStorage, "_swap_data_ptr_") else _native()


def can_swap() -> bool:
    """Whether this process can exchange the memory behind two storages (see the module docstring)."""
    return _swapper() is not None


def swap_memory(a: torch.UntypedStorage, b: torch.UntypedStorage) -> None:
    """Exchange the memory behind `a` and `b`, of the same size on the same device (`ValueError`
    otherwise, naming both); only where `can_swap()`."""
    swap_memories([a], [b])


def swap_memories(a: Sequence[torch.UntypedStorage], b: Sequence[torch.UntypedStorage]) -> None:
    """`swap_memory(a[i], b[i])` for every i, all or none: every pair is checked before any swaps
    (`ValueError` naming the first pair that does not match); in one C++ call where rl-sync's
    module swaps."""
    swapper = _swapper()
    if swapper is None:
        raise RuntimeError("swap: this process cannot exchange storages' memory (can_swap() is False)")
    if len(a) != len(b):
        raise ValueError(f"swap: {len(a)} and {len(b)} storages; expected pairs")
    swapper(a, b)
