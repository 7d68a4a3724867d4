"""Destinations that share memory: two names writing one element make a round's result depend
on write order, so a worker refuses them at init, naming both.

Views of one storage are compared as boxes of the row-major array their strides describe
(fused slots, TP shards, expert slices, parts cut along a dim are all such boxes); views whose
strides differ, or are not of that form, count as overlapping when their byte extents do.

    check_disjoint({"q": q_view, "k": k_view}, rank=0)   # ValueError naming the pair
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def _extent(t: torch.Tensor) -> tuple[int, int]:
    span = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(offsets, sizes) of `t` in the row-major array of its strides, or None when it is not one."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    rest, offsets = int(t.storage_offset()), [0] * t.dim()
    for i, d in enumerate(order):
        stride = t.stride(d)
        if stride <= 0:
            return None
        offsets[d], rest = divmod(rest, stride)
        outer = t.stride(order[i - 1]) if i else None
        if outer is not None and (offsets[d] + t.shape[d]) * stride > outer:
            return None
    return (tuple(offsets), tuple(t.shape)) if rest == 0 else None


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.dtype != b.dtype or a.stride() != b.stride():
        return True
    box_a, box_b = _box(a), _box(b)
    if box_a is None or box_b is None:
        return True
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(*box_a, *box_b))


def check_disjoint(views: Mapping[str, torch.Tensor], rank: int) -> None:
    """`ValueError` naming the first two names whose views share an element."""
    by_storage: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, view in views.items():
        if view is not None and view.numel():
            by_storage.setdefault(view.untyped_storage().data_ptr(), []).append((name, view))
    for group in by_storage.values():
        group.sort(key=lambda item: item[1].data_ptr())
        for i, (name, view) in enumerate(group):
            end = _extent(view)[1]
            for other, other_view in group[i + 1 :]:
                if other_view.data_ptr() >= end:
                    break
                if _overlap(view, other_view):
                    raise ValueError(
                        f"worker rank {rank}: destinations {name!r} and {other!r} share memory (their "
                        "views overlap); each element may have one writer"
                    )
