"""The fused sparse codec's tables, shared by its kernels (Triton's, `sparse_triton`, and CUDA's,
`sparse_cuda` and `sparse_kernels.cu`, which takes these columns as macros) and its host side
(`sparse_fused` sends, `sparse_receiver` receives, `sparse_launch` groups their launches): the
columns of a sender's and a receiver's rows, the tiles boxes are cut into, where a box's elements
lie (`Strided2D`, counted from an anchor per device and width), the density classes that pick a
launch, the one upload of a step's values, the flags a receiver starts from zero, and what a
bucket's tables find again from round to round (`refer`, `refers_to`). Nothing here launches a kernel or
needs Triton or CuPy.

Typical use::

    box = as_2d(view)                                        # None: its dims do not merge into two
    row = [*box.columns, ...]                                # a row, column by column (SEND_*, RECV_*)
    up = Upload(); at = up.add_rows(rows); dev = up.send(device)
    kernel(dev[at], ...)                                     # the kernels read row[SEND_N], ...
"""

from __future__ import annotations

import array
import ctypes
import functools
import itertools
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..sparse.encodings import BITMAP, BLOCKED, INDICES

TILE = 16384
"""Elements per program in the tile kernels (a power of two dividing `sparse.BLOCK`). On an H200,
1 GiB of bf16 in 16 boxes: the kernels of a 10% round take 2.55 ms with 16,384, against 2.82 ms
with 4,096 and 2.54-2.56 ms with 32,768 or 65,536 (where the sparse `compact` of a 1% round
slows down: 0.39-1.2 against 0.37 ms)."""
WORDS = TILE // 32

NONE, INT32_INDEX, UINT16_OFFSET = range(3)
"""What `compact` writes beside the values (a `SEND_INDEX_KIND`; -1: no values either)."""
INDEX_KIND = {BITMAP: NONE, INDICES: INT32_INDEX, BLOCKED: UINT16_OFFSET}
"""The index kind of each wire encoding."""

BOX_COLS, BOX_ROW_STRIDE, BOX_COL_STRIDE, BOX_CONTIGUOUS = range(1, 5)
"""A box's columns after its start (`Strided2D.columns`)."""
(
    SEND_CUR,
    SEND_BASE,
    SEND_N,
    SEND_SLOT,
    SEND_VALUES,
    SEND_INDEX,
    SEND_INDEX_KIND,
    SEND_UPDATE,
    SEND_BITMAP_OUT,
    SEND_BLOCKS_OUT,
    SEND_COUNT,
    SEND_STAGE,
) = (0, 5, *range(10, 20))
SEND_COLUMNS = 20
"""A sender row: source box (5 columns), baseline box (5), n, tile slot, values (element offset),
index pointer, index kind, update the baseline, wire bitmap and block counts pointers (0: none),
where `diff` adds up the box's changes, and where the CUDA `diff` stages its values (bytes from the
words; `sparse_cuda.stage_bytes`; the Triton kernels do not read it)."""
(
    RECV_WORDS,
    RECV_OFFSETS,
    RECV_VALUES,
    RECV_DEST,
    RECV_N,
    RECV_K,
    RECV_FLAG,
    RECV_FIRST,
    RECV_M,
    RECV_COUNTS,
    RECV_LIMIT,
) = (0, 1, 2, 3, *range(8, 15))
RECV_COLUMNS = 15
"""A receiver row: bitmap words and in-block offsets pointers, values (element offset), live box (5
columns), n, k, flag slot, first count slot, counts, block counts pointer (0: tile counts), limit."""
BITS_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
"""The integer type of each element width: elements are compared, copied and written as bits."""


Key = tuple[int, bool]
"""Which launch a box joins: (element width, every box of the launch on the vectorized path)."""


BUSY = 32
"""A box with more than one change in this many elements (one per bitmap word on average) is busy:
it takes the busy `compact` / `expand` launches, which handle every element of
`sparse_triton.SUB` words at once; sparser boxes visit their marks `sparse_triton.ROUNDS` per word
at a time."""
BUSIER = 5
"""A busy box with more than one change in this many elements is busier: the same kernels, with
other warps a program (`sparse_triton.COMPACT_WARPS`, `sparse_triton.EXPAND_WARPS`)."""


def density(k: int, n: int) -> int:
    """The density class of a box of `k` changes in `n` elements: 0 sparse, 1 busy, 2 busier."""
    return int(k * BUSY > n) + int(k * BUSIER > n)


@dataclass(frozen=True)
class Strided2D:
    """Where a box's elements lie, in elements of its width: flat index `i` at `start + (i //
    cols) * row_stride + (i % cols) * col_stride` from its width's anchor (`anchor`)."""

    start: int
    cols: int
    row_stride: int
    col_stride: int
    aligned: bool
    """Its first element is 16-byte aligned."""

    @functools.cached_property
    def contiguous(self) -> bool:
        return self.col_stride == 1 and self.row_stride == self.cols

    @functools.cached_property
    def fast(self) -> bool:
        """Contiguous and 16-byte aligned: the kernels' vectorized path."""
        return self.contiguous and self.aligned

    @functools.cached_property
    def columns(self) -> tuple[int, ...]:
        """(start, cols, row stride, col stride, contiguous) as table columns."""
        return self.start, self.cols, self.row_stride, self.col_stride, int(self.contiguous)


_ANCHORS: dict[tuple[torch.device, int], torch.Tensor] = {}
_ANCHOR_ADDRESSES: dict[tuple[int, int], int] = {}


def anchor(device: torch.device, width: int) -> torch.Tensor:
    """The tensor the kernels address every element of `width` bytes on `device` from (one
    element, kept): a table holds element offsets from it, so a launch knows its pointers'
    alignment."""
    if device.type == "cuda" and device.index is None:  # one anchor per device, however it is named
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, width)
    if key not in _ANCHORS:
        _ANCHORS[key] = torch.empty(1, dtype=BITS_TORCH[width], device=device)
        _ANCHOR_ADDRESSES[(_index(device), width)] = _ANCHORS[key].data_ptr()
    return _ANCHORS[key]


def _index(device: torch.device) -> int:
    """The device's number as `Tensor.get_device` gives it (-1: the CPU)."""
    return -1 if device.type == "cpu" else int(device.index)


def element_offset(address: int, device: int, width: int) -> int:
    """Where the element of `width` bytes at `address` (on the device numbered `device`, as
    `Tensor.get_device` numbers it) is, in elements from its width's anchor; the address must be a
    whole number of elements from it."""
    return _from(anchor_address(device, width), address, width)


def anchor_address(device: int, width: int) -> int:
    """The address of `anchor(·, width)` on the device numbered `device` as `Tensor.get_device`
    numbers it (-1: the CPU)."""
    base = _ANCHOR_ADDRESSES.get((device, width))
    if base is None:
        base = anchor(torch.device("cpu") if device < 0 else torch.device("cuda", device), width).data_ptr()
    return base


def _from(base: int, address: int, width: int) -> int:
    """Elements of `width` bytes from `base` to `address`, a whole number of them."""
    offset, rest = divmod(address - base, width)
    if rest:
        raise ValueError(f"address {address:#x} is not aligned to its {width}-byte elements")
    return offset


def as_2d(view: torch.Tensor) -> Strided2D | None:
    """`view`'s elements as a `Strided2D`, or None when its dims do not merge into two."""
    return strided(view.data_ptr(), view.shape, view.stride(), view.element_size(), view.get_device())


@functools.lru_cache(maxsize=4096)
def strided(
    address: int, shape: tuple[int, ...], strides: tuple[int, ...], width: int, device: int
) -> Strided2D | None:
    """`as_2d` of the view at `address` on the device numbered `device` (`Tensor.get_device`): a
    pure function of its arguments, kept for the views a round finds again every step."""
    dims = [(size, stride) for size, stride in zip(shape, strides) if size != 1]
    merged: list[tuple[int, int]] = []
    for size, stride in dims:
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 2:
        return None
    merged = [(1, 0)] * (2 - len(merged)) + merged
    (rows, row_stride), (cols, col_stride) = merged
    if rows == 1:
        row_stride = cols * col_stride
    base = anchor_address(device, width)
    return Strided2D(_from(base, address, width), cols, row_stride, col_stride, address % 16 == 0)


def tiles(n: int) -> int:
    return -(-n // TILE)


def starts(counts: Iterable[int]) -> list[int]:
    """Cumulative program starts of boxes of `counts` programs each (one more entry: the total)."""
    return list(itertools.accumulate(counts, initial=0))


class Upload:
    """int64 values gathered on the host, then copied to the device in one transfer from pinned
    memory (which does not wait for queued work, as a copy from pageable memory would).

    Usage: `at = up.add(values)` (or `add_rows`) for each array; `dev = up.send(device)`; then
    `dev[at]`."""

    def __init__(self) -> None:
        self._values: list[int] = []

    def __len__(self) -> int:
        """Values added so far."""
        return len(self._values)

    def add(self, values: Iterable[int]) -> slice:
        first = len(self._values)
        self._values.extend(values)
        return slice(first, len(self._values))

    def add_rows(self, rows: Iterable[list[int]]) -> slice:
        return self.add(itertools.chain.from_iterable(rows))

    def send(self, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return torch.from_numpy(np.array(self._values, dtype=np.int64))
        values = array.array("q", self._values)  # (a third faster than a numpy array from a list)
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=True)
        ctypes.memmove(host.data_ptr(), values.buffer_info()[0], 8 * len(values))
        return host.to(device, non_blocking=True)


def flags_layout(boxes: int) -> tuple[int, int]:
    """(where the counters begin, how many values in all) of the int32 values a receiver of `boxes`
    boxes starts from zero (`sparse_codec.BucketReceiver`): a flag a box, the guard, then a counter (int64, so
    8-byte aligned) a box for the fused checks (the CUDA `starts`, `sparse_receiver.FusedReceiver`)."""
    counters = (boxes + 2) // 2 * 2
    return counters, counters + 2 * boxes


def check_elements(first: int, boxes: Sequence[tuple], views: Sequence[torch.Tensor]) -> None:
    """Refuses a message whose view i (slot `first + i`) holds other elements than its box
    (`encodings.MessageLayout.boxes[i]`): the fused kernels would write past a smaller one."""
    for i, (view, (_, _, n, _, _)) in enumerate(zip(views, boxes)):
        held = view.numel()
        if held != n:
            raise ValueError(f"box slot {first + i}: its destination view holds {held} elements; the box has {n}")


Refs = tuple["weakref.ref[torch.Tensor]", ...]
"""Weak references to tensors a `KeptTables` finds again by identity: it keeps no tensor alive (a
source cast to the wire's dtype is a new tensor each round, and is never found again)."""


def refer(tensors: Sequence[torch.Tensor]) -> Refs:
    return tuple(map(weakref.ref, tensors))


def refers_to(refs: Refs, tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `refs` (`refer`) are references to exactly `tensors`, in order, every one alive."""
    return len(refs) == len(tensors) and all(ref() is tensor for ref, tensor in zip(refs, tensors))
