"""Sparse delta encodings: which one a transfer uses, and how many bytes it takes.

A transfer of `n` elements of `itemsize` bytes, `k` of them changed since the
last sync, travels as whichever is smallest:

* `INDICES`: k int32 box-local flat indices, then the k values (4k + bk bytes);
* `BLOCKED`: the box cut into blocks of 65,536 elements, an int32 count per
  block, then k uint16 offsets inside their blocks, then the k values
  (4 ceil(n / 65536) + 2k + bk bytes: 2% of dense for bf16 at 1% density,
  where int32 indices take 3%);
* `BITMAP`: one bit per element (ceil(n / 8) bytes), then the k values;
* `DENSE`: all n values (bn bytes).

Blocks inside a message start 16-byte aligned. Pure arithmetic: the torch side
is `rl_sync.engine.sparse_codec`, its CUDA kernels `rl_sync.engine.sparse_triton`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

INDICES, BITMAP, DENSE, BLOCKED = 0, 1, 2, 3
NAMES = {INDICES: "indices", BITMAP: "bitmap", DENSE: "dense", BLOCKED: "blocked"}
BLOCK = 1 << 16
ALIGN = 16
MAX_INDEX = 2**31 - 1


_PAD, _MASK = ALIGN - 1, -ALIGN
"""`n` rounded up to `ALIGN` (a power of two) is `(n + _PAD) & _MASK`."""


def _up(n: int) -> int:
    return (n + _PAD) & _MASK


class PayloadLayout(NamedTuple):
    """Where each part of one encoded transfer starts in its payload (bytes; each part 16-byte
    aligned): the bitmap or the int32 block counts at 0, `positions` the int32 indices or uint16
    in-block offsets, `values` the changed (or, dense, all) values; `nbytes` in all. (A named
    tuple: a round builds one per box on each side, and a tuple is built in half the time.)"""

    head: int
    """Bytes of the part at 0 (bitmap or block counts; 0 when there is none)."""
    positions: int
    values: int
    nbytes: int


def payload_layout(code: int, n: int, k: int, itemsize: int) -> PayloadLayout:
    """The layout of a transfer of `n` elements of `itemsize` bytes, `k` changed, as `code` (each
    part rounded up to `ALIGN` inline, and the tuple made without the named tuple's own `__new__`: a
    round asks for one per box on each side, on its critical path)."""
    values = (itemsize * k + _PAD) & _MASK  # (`_up`, inline)
    if code == BITMAP:
        head = -(-n // 8)
        at = (head + _PAD) & _MASK
        return _layout(PayloadLayout, (head, at, at, at + values))
    if code == BLOCKED:
        head = 4 * -(-n // BLOCK)
        at = (head + _PAD) & _MASK
        offsets = (2 * k + _PAD) & _MASK
        return _layout(PayloadLayout, (head, at, at + offsets, at + offsets + values))
    if code == INDICES:
        indices = (4 * k + _PAD) & _MASK
        return _layout(PayloadLayout, (0, 0, indices, indices + values))
    if code == DENSE:
        return _layout(PayloadLayout, (0, 0, 0, _up(itemsize * n)))
    raise ValueError(
        f"unknown sparse encoding code {code!r}; expected 0 (indices), 1 (bitmap), 2 (dense) or 3 (blocked)"
    )


_layout = tuple.__new__


def encoded_nbytes(code: int, n: int, k: int, itemsize: int) -> int:
    """Bytes of one encoded transfer (its parts each 16-byte aligned)."""
    return payload_layout(code, n, k, itemsize).nbytes


def choose(n: int, k: int, itemsize: int, allow_dense: bool) -> int:
    """The smallest encoding for `k` changes in `n` elements (ties prefer the sparser one)."""
    options = [INDICES, BLOCKED, BITMAP] + ([DENSE] if allow_dense else [])
    if n > MAX_INDEX:
        options.remove(INDICES)
    return min(options, key=lambda code: (encoded_nbytes(code, n, k, itemsize), code))


def check_count(code: int, k: int, n: int, what: str) -> None:
    """Refuse a header that cannot describe a transfer of `n` elements."""
    if code not in NAMES:
        raise ValueError(f"{what}: encoding code {code} is not 0, 1, 2 or 3")
    if not 0 <= k <= n or (code == DENSE and k != n) or (code == INDICES and n > MAX_INDEX):
        raise ValueError(f"{what}: {NAMES[code]} header claims {k} changed of {n} elements")


class MessageLayout(NamedTuple):
    """Where each box of one message lies in its payload, its boxes' parts one after another:
    `boxes[i]` is box i's (code, k, n, layout, start), `start` its first byte in the payload;
    `nbytes` in all; `itemsizes`, each box's element size, as the layout was made for."""

    boxes: list[tuple[int, int, int, PayloadLayout, int]]
    nbytes: int
    itemsizes: list[int]


def message_layout(header: Sequence[int], ns: Sequence[int], itemsizes: Sequence[int], what: str) -> MessageLayout:
    """The layout of a message whose `header` holds (code, changed count) for each of its boxes,
    of `ns[i]` elements of `itemsizes[i]` bytes; every count checked against its box first
    (`check_count`, naming `what` and the segment), so nothing is sized from a bad header."""
    if len(header) != 2 * len(ns) or len(itemsizes) != len(ns):
        raise ValueError(
            f"{what}: a header of {len(header)} values and {len(itemsizes)} element sizes for "
            f"{len(ns)} boxes; expected {2 * len(ns)} values (code, count) and one size a box"
        )
    boxes, start = [], 0
    for i, n in enumerate(ns):
        code, k = header[2 * i], header[2 * i + 1]
        check_count(code, k, n, f"{what}, segment {i}")
        at = payload_layout(code, n, k, itemsizes[i])
        boxes.append((code, k, n, at, start))
        start += at.nbytes
    return MessageLayout(boxes, start, list(itemsizes))
