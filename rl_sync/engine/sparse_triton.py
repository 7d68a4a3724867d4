"""The sparse codec's CUDA kernels (Triton): every box of a bucket in one launch per step, with
no host synchronization inside.

A launch takes a *box table* (int64 rows, one per box; pointers are addresses) and the
boxes' cumulative program counts: each program finds its box by binary search, so the host
cost of a step does not grow with the number of boxes. One launch serves boxes of one element
width (`VT`, the same-width integer type: elements are compared, copied and written as bits,
so NaN payloads and -0.0 keep them). A box is addressed as `Strided2D`: flat row-major index
`i` sits at `(i // cols) * row_stride + (i % cols) * col_stride` elements from its start
(contiguous boxes skip the division); contiguous, 16-byte aligned boxes take the vectorized
path (`FAST`), and whole tiles are read with unmasked, vectorized loads.

Boxes are cut into tiles of `TILE` elements; a tile's change bitmap is `TILE // 32` int32
words, bit `b` of word `w` for element `32 w + b` (the wire's `BITMAP` bit order).

Sender (`SEND_*` columns): `diff` reads each box and its baseline once and writes the bitmap
words and a count per tile into the bucket's buffers, at the box's tile slot, and adds up
each box's count; the caller reads the bucket's counts back in one transfer, chooses
encodings and fills the payload columns; `compact` reads the words and only the changed
elements and writes the values, their indices (int32) or in-block offsets (uint16), the wire
bitmap and the wire block counts, and the baseline where asked.

Receiver (`RECV_*` columns): `bitmap_counts` counts each received bitmap's tiles (and flags
stray bits past `n`); `scan` turns each box's tile or block counts into starts and flags counts
out of range or not summing to `k`; `blocked_check` flags blocks whose offsets are not strictly
increasing inside the box. Each flag raised also raises the bucket's `guard`, and `expand` and
`blocked_apply`, queued right behind the checks, write into live views only while the guard is
down: a bucket with a malformed box writes nothing, with no host synchronization in between.
Every payload load is bounded by the header's `k`, so even an unvalidated payload cannot make a
kernel read out of bounds.

`compact` and `expand` come in launches per density class of their boxes
(`sparse_table.density`): the sparse one visits each word's marks `ROUNDS` at a time, the busy
and busier ones handle every element of `SUB` words at once, each with its own warps. On the
vectorized path, `diff`, `compact` and the busy `expand` take `sparse_cuda`'s CUDA versions
instead where CuPy is installed, and on every path `bitmap_counts` and `scan` give way to its
one `starts` launch and `blocked_check` and `blocked_apply` to its own (`sparse_fused` chooses).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..sparse.encodings import BLOCK
from . import sparse_table
from .sparse_table import TILE, anchor

CHUNK = 1024
"""Entries per step of the per-block and scan kernels."""
ROUNDS = 4
"""Marks per word the sparse `compact` / `expand` visit at once (their loads issued together)."""
SUB = 32
"""Bitmap words the busy `compact` / `expand` handle at once (on an H200, 1 GiB of bf16: `compact` /
`expand` 0.91 / 0.85 ms at 10% density, against 0.96 / 0.99 ms with 16 words and 0.97 / 1.02 ms
with 64)."""
WARPS = 4
"""Warps a program (8 were slower for every kernel on an H200, and 1 or 2 for most)."""
COMPACT_WARPS = (4, 2, 4)
EXPAND_WARPS = (4, 4, 2)
"""Warps a program of `compact` and `expand`, by density class (sparse, busy, busier: see
`sparse_table.density`). On an H200, 1 GiB of bf16: `compact` 0.91 against 0.97 ms (2 against 4
warps) at 10% density, 1.05 against 1.28 ms (4 against 2) at 30%; `expand` 0.85 against 0.92 ms (4
against 2) at 10%, 1.05 against 1.29 ms (2 against 4) at 30%."""
BITMAP_COUNTS_WARPS = 2
"""Warps a program of `bitmap_counts` (0.06 against 0.07 ms with 4, at 10% on an H200)."""
DIFF_PARTS = 8
"""`diff` programs a tile: 2,048 elements each (fewer registers than a whole tile, so more of them
resident: 0.65 ms against 0.70 ms for 1 GiB of bf16 on an H200)."""
HARDWARE_POPC = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")
BITS = {1: tl.uint8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


@triton.jit
def _box(firsts, boxes):
    """(this program's box, its program index within the box): the last box whose first
    program is at most this one."""
    pid = tl.program_id(0).to(tl.int64)
    lo = tl.zeros([], dtype=tl.int64)
    hi = tl.zeros([], dtype=tl.int64) + boxes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(firsts + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo, pid - tl.load(firsts + lo)


@triton.jit
def _ptr(row, column, VT: tl.constexpr):
    return tl.load(row + column).to(tl.pointer_type(VT))


@triton.jit
def _at(row, first, start, local, anchor, FAST: tl.constexpr, ALIGN: tl.constexpr):
    """Pointers to flat indices `start + local` (an int64 scalar, int32 offsets) of the box whose
    (start, cols, row stride, col stride, contiguous) columns start at `first`; FAST: every box
    of the launch is contiguous and 16-byte aligned (`ALIGN` elements), so loads vectorize."""
    box = tl.load(row + first)
    if FAST:
        return anchor + tl.multiple_of(box, ALIGN) + start + local
    i = start + local.to(tl.int64)
    if tl.load(row + first + sparse_table.BOX_CONTIGUOUS) != 0:
        offsets = i
    else:
        cols = tl.load(row + first + sparse_table.BOX_COLS)
        offsets = (i // cols) * tl.load(row + first + sparse_table.BOX_ROW_STRIDE) + (i % cols) * tl.load(
            row + first + sparse_table.BOX_COL_STRIDE
        )
    return anchor + box + offsets


@triton.jit
def _popc(x):
    """Set bits of each uint32 (the GPU's popc; bit arithmetic under the interpreter)."""
    if HARDWARE_POPC:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.uint32, is_pure=True, pack=1)
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def _low_bits(count):
    """uint32 masks of the `count` (clamped to 0..32) lowest bits."""
    count = tl.minimum(tl.maximum(count, 0), 32).to(tl.uint32)
    return tl.where(count >= 32, 0xFFFFFFFF, (tl.full(count.shape, 1, tl.uint32) << tl.minimum(count, 31)) - 1)


@triton.jit
def _tile(t, n, TILE: tl.constexpr):
    """Tile `t`: its first flat index (int64), its elements as a [TILE // 32, 32] grid of int32
    offsets from there (row w: bitmap word w), and how many elements of each word are below `n`."""
    start = t * TILE
    words = tl.arange(0, TILE // 32) * 32
    return start, words[:, None] + tl.arange(0, 32)[None, :], tl.minimum(n - start, TILE).to(tl.int32) - words


@triton.jit
def _below_n(first, left):
    """The bitmap words from `first` on, one per entry of `left` (the elements of each word below
    `n`), bits at or past `n` cleared."""
    w = tl.load(first + tl.arange(0, left.shape[0]), mask=left > 0, other=0)
    return w.to(tl.uint32, bitcast=True) & _low_bits(left)


@triton.jit
def _words(words, t, left, TILE: tl.constexpr):
    """Tile `t`'s bitmap words, bits at or past `n` cleared."""
    return _below_n(words + t * (TILE // 32), left)


@triton.jit
def _chunk(words, t, c, n, start, SUB: tl.constexpr, TILE: tl.constexpr):
    """Words `c .. c + SUB` of tile `t` (bits at or past `n` cleared), and their elements' offsets
    in the tile as a [SUB, 32] grid."""
    at = c + tl.arange(0, SUB)
    left = tl.minimum(n - start, TILE).to(tl.int32) - at * 32
    return _below_n(words + t * (TILE // 32) + c, left), at[:, None] * 32 + tl.arange(0, 32)[None, :]


@triton.jit
def _marked(word):
    """(hits, positions among the words' marks) of bitmap words, as [words, 32] grids: every
    element at once."""
    j = tl.arange(0, 32).to(tl.uint32)
    hit = ((word[:, None] >> j[None, :]) & 1) != 0
    per_word = _popc(word).to(tl.int32)
    below = _popc(word[:, None] & ((tl.full([32], 1, tl.uint32) << j) - 1)[None, :]).to(tl.int32)
    return hit, (tl.cumsum(per_word, axis=0) - per_word)[:, None] + below


@triton.jit
def _runs(word):
    """(each word's first position among the tile's marks, the most marks in one word): the
    sparse launches visit the marks `ROUNDS` per word at a time, lowest first."""
    per_word = _popc(word).to(tl.int32)
    return tl.cumsum(per_word, axis=0) - per_word, tl.max(per_word, axis=0)


@triton.jit
def _first_marks(word, ROUNDS: tl.constexpr):
    """(hits, offsets in the tile, round) of each word's `ROUNDS` lowest marks, as [words, ROUNDS]
    grids (round r: the word's r-th lowest mark), so their loads are issued together."""
    r = tl.arange(0, ROUNDS)[None, :]
    marks = word[:, None] + tl.zeros([1, ROUNDS], dtype=tl.uint32)
    for s in tl.static_range(ROUNDS - 1):
        marks = tl.where(r > s, marks & (marks - 1), marks)
    lowest = marks & (~marks + 1)
    local = tl.arange(0, word.shape[0])[:, None] * 32 + _popc(lowest - 1).to(tl.int32)
    return marks != 0, local, r


@triton.jit
def _dropped(word, ROUNDS: tl.constexpr):
    """Each word without its `ROUNDS` lowest marks."""
    for _ in tl.static_range(ROUNDS):
        word = word & (word - 1)
    return word


@triton.jit
def _diff_kernel(
    table,
    firsts,
    boxes,
    words,
    counts,
    totals,
    anchor,
    FAST: tl.constexpr,
    ALIGN: tl.constexpr,
    TILE: tl.constexpr,
    PART: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    box, p = _box(firsts, boxes)  # part p of the box: `PART` elements
    row = table + box * COLUMNS
    n = tl.load(row + sparse_table.SEND_N)
    start, local, _ = _tile(p, n, PART)
    cur = _at(row, sparse_table.SEND_CUR, start, local, anchor, FAST, ALIGN)
    base = _at(row, sparse_table.SEND_BASE, start, local, anchor, FAST, ALIGN)
    if n - start >= PART:  # whole: unmasked loads, which vectorize
        differ = tl.load(cur) != tl.load(base)
    else:
        inside = local < (n - start).to(tl.int32)
        differ = (tl.load(cur, mask=inside, other=0) != tl.load(base, mask=inside, other=0)) & inside
    count = tl.sum(tl.sum(differ.to(tl.int32), axis=1), axis=0)
    word = tl.sum(differ.to(tl.uint32) << tl.arange(0, 32).to(tl.uint32)[None, :], axis=1)
    slot = tl.load(row + sparse_table.SEND_SLOT)
    tl.store(words + slot * (TILE // 32) + p * (PART // 32) + tl.arange(0, PART // 32), word.to(tl.int32, bitcast=True))
    tl.atomic_add(counts + slot + p // (TILE // PART), count.to(tl.int64), sem="relaxed")
    tl.atomic_add(
        totals + tl.load(row + sparse_table.SEND_COUNT), count.to(tl.int64), sem="relaxed"
    )  # a box may pass 2^31


@triton.jit
def _emit(
    row, anchor, start, local, at, hit, kind, update, FAST: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr
):
    """Compact's writes for the marks `hit` at tile offsets `local`: value (and index) at `at`,
    and the baseline when `update`."""
    v = tl.load(_at(row, sparse_table.SEND_CUR, start, local, anchor, FAST, ALIGN), mask=hit)
    if update:
        tl.store(_at(row, sparse_table.SEND_BASE, start, local, anchor, FAST, ALIGN), v, mask=hit)
    _emit_values(row, anchor, start, local, at, hit, v, kind, BLOCK)


@triton.jit
def _emit_values(row, anchor, start, local, at, hit, v, kind, BLOCK: tl.constexpr):
    """The marked values `v` (and their indices) at payload positions `at`."""
    if kind >= sparse_table.NONE:
        tl.store(anchor + tl.load(row + sparse_table.SEND_VALUES) + at, v, mask=hit)
    if kind == sparse_table.INT32_INDEX:
        tl.store(_ptr(row, sparse_table.SEND_INDEX, tl.int32) + at, start.to(tl.int32) + local, mask=hit)
    if kind == sparse_table.UINT16_OFFSET:
        tl.store(
            _ptr(row, sparse_table.SEND_INDEX, tl.int16) + at,
            (((start % BLOCK).to(tl.int32) + local) & 0xFFFF).to(tl.int16),
            mask=hit,
        )


@triton.jit
def _compact_kernel(
    table,
    firsts,
    boxes,
    words,
    starts,
    blocks,
    anchor,
    FAST: tl.constexpr,
    ALIGN: tl.constexpr,
    TILE: tl.constexpr,
    COLUMNS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROUNDS: tl.constexpr,
    BUSY: tl.constexpr,
    SUB: tl.constexpr,
):
    box, t = _box(firsts, boxes)
    row = table + box * COLUMNS
    n = tl.load(row + sparse_table.SEND_N)
    slot = tl.load(row + sparse_table.SEND_SLOT)
    start, _, left = _tile(t, n, TILE)
    tile_start = tl.load(starts + slot + t) - tl.load(starts + slot)
    kind = tl.load(row + sparse_table.SEND_INDEX_KIND)
    update = tl.load(row + sparse_table.SEND_UPDATE) != 0
    bitmap = _ptr(row, sparse_table.SEND_BITMAP_OUT, tl.int32) + t * (TILE // 32)
    words += slot * (TILE // 32)
    if not BUSY:  # a few marks per word: visited `ROUNDS` per word at a time
        word = _words(words, t, left, TILE)
        first, rounds = _runs(word)
        marks = word
        for g in range(0, rounds, ROUNDS):
            marked, offsets, r = _first_marks(marks, ROUNDS)
            at = tile_start + first[:, None] + g + r
            _emit(row, anchor, start, offsets, at, marked, kind, update, FAST, ALIGN, BLOCK)
            marks = _dropped(marks, ROUNDS)
        if tl.load(row + sparse_table.SEND_BITMAP_OUT) != 0:
            tl.store(bitmap + tl.arange(0, TILE // 32), word.to(tl.int32, bitcast=True), mask=left > 0)
    else:  # busy: every element of `SUB` words at a time
        whole = FAST & (n - start >= TILE)  # read whole, and the baseline written whole: vectorized
        for c in range(0, TILE // 32, SUB):
            chunk, local = _chunk(words, t, c, n, start, SUB, TILE)
            hit, at = _marked(chunk)
            at += tile_start
            if whole:
                v = tl.load(_at(row, sparse_table.SEND_CUR, start, local, anchor, FAST, ALIGN))
                if update:
                    tl.store(_at(row, sparse_table.SEND_BASE, start, local, anchor, FAST, ALIGN), v)
                _emit_values(row, anchor, start, local, at, hit, v, kind, BLOCK)
            else:
                _emit(row, anchor, start, local, at, hit, kind, update, FAST, ALIGN, BLOCK)
            if tl.load(row + sparse_table.SEND_BITMAP_OUT) != 0:
                ws = c + tl.arange(0, SUB)
                tl.store(bitmap + ws, chunk.to(tl.int32, bitcast=True), mask=ws * 32 < n - start)
            tile_start += tl.sum(_popc(chunk).to(tl.int32), axis=0)
    if (tl.load(row + sparse_table.SEND_BLOCKS_OUT) != 0) & (t % (BLOCK // TILE) == 0):
        tl.store(
            _ptr(row, sparse_table.SEND_BLOCKS_OUT, tl.int32) + t // (BLOCK // TILE),
            tl.load(blocks + (slot + t) // (BLOCK // TILE)),
        )


@triton.jit
def _raise(flags, row, guard, wrong):
    """Raise the box's flag when `wrong` (0 or 1), and with it the bucket's guard."""
    tl.atomic_max(flags + tl.load(row + sparse_table.RECV_FLAG), wrong)
    tl.atomic_max(guard, wrong, mask=wrong != 0)


@triton.jit
def _bitmap_counts_kernel(table, firsts, boxes, counts, flags, guard, TILE: tl.constexpr, COLUMNS: tl.constexpr):
    box, t = _box(firsts, boxes)
    row = table + box * COLUMNS
    n = tl.load(row + sparse_table.RECV_N)
    _, _, left = _tile(t, n, TILE)
    words = _ptr(row, sparse_table.RECV_WORDS, tl.int32)
    tl.store(
        counts + tl.load(row + sparse_table.RECV_FIRST) + t,
        tl.sum(_popc(_words(words, t, left, TILE)).to(tl.int32), axis=0),
    )
    raw = tl.load(words + t * (TILE // 32) + tl.arange(0, TILE // 32), mask=left > 0, other=0).to(
        tl.uint32, bitcast=True
    )
    wire_bits = left + ((n + 7) // 8 * 8 - n)
    stray = raw & ~_low_bits(left) & _low_bits(wire_bits)
    _raise(flags, row, guard, tl.max((stray != 0).to(tl.int32), axis=0))


@triton.jit
def _scan_kernel(table, counts, starts, flags, guard, CHUNK: tl.constexpr, COLUMNS: tl.constexpr):
    """One program per box: its `starts` = exclusive prefix sums of its counts (each clamped to
    the box's limit); flags the box when a count is out of range or they do not sum to `k`."""
    row = table + tl.program_id(0).to(tl.int64) * COLUMNS
    m = tl.load(row + sparse_table.RECV_M)
    first = tl.load(row + sparse_table.RECV_FIRST)
    limit = tl.load(row + sparse_table.RECV_LIMIT).to(tl.int32)
    if tl.load(row + sparse_table.RECV_COUNTS) != 0:  # (a branch in the kernel: the pointers differ in type)
        source = _ptr(row, sparse_table.RECV_COUNTS, tl.int32)
    else:
        source = counts + first
    carry = tl.zeros([], dtype=tl.int64)
    wrong = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, m, CHUNK):
        r = c0 + tl.arange(0, CHUNK)
        x = tl.load(source + r, mask=r < m, other=0)
        wrong = wrong | tl.max(((x < 0) | (x > limit)).to(tl.int32), axis=0)
        x = tl.minimum(tl.maximum(x, 0), limit).to(tl.int64)
        tl.store(starts + first + r, carry + tl.cumsum(x, axis=0) - x, mask=r < m)
        carry += tl.sum(x, axis=0)
    _raise(flags, row, guard, wrong | (carry != tl.load(row + sparse_table.RECV_K)).to(tl.int32))


@triton.jit
def _expand_kernel(
    table,
    firsts,
    boxes,
    starts,
    guard,
    anchor,
    FAST: tl.constexpr,
    ALIGN: tl.constexpr,
    TILE: tl.constexpr,
    COLUMNS: tl.constexpr,
    ROUNDS: tl.constexpr,
    BUSY: tl.constexpr,
    SUB: tl.constexpr,
):
    if tl.load(guard) != 0:  # a box of the bucket is malformed: nothing is written
        return
    box, t = _box(firsts, boxes)
    row = table + box * COLUMNS
    n = tl.load(row + sparse_table.RECV_N)
    start, _, left = _tile(t, n, TILE)
    words = _ptr(row, sparse_table.RECV_WORDS, tl.int32)
    tile_start = tl.load(starts + tl.load(row + sparse_table.RECV_FIRST) + t)
    k = tl.load(row + sparse_table.RECV_K)
    values = anchor + tl.load(row + sparse_table.RECV_VALUES)
    if not BUSY:  # a few marks per word: visited `ROUNDS` per word at a time
        marks = _words(words, t, left, TILE)
        first, rounds = _runs(marks)
        for g in range(0, rounds, ROUNDS):
            marked, offsets, r = _first_marks(marks, ROUNDS)
            places = tile_start + first[:, None] + g + r
            marked = marked & (places < k)
            tl.store(
                _at(row, sparse_table.RECV_DEST, start, offsets, anchor, FAST, ALIGN),
                tl.load(values + places, mask=marked),
                mask=marked,
            )
            marks = _dropped(marks, ROUNDS)
    else:  # busy: every element of `SUB` words at a time
        for c in range(0, TILE // 32, SUB):
            chunk, local = _chunk(words, t, c, n, start, SUB, TILE)
            hit, at = _marked(chunk)
            at += tile_start
            hit = hit & (at < k)
            tl.store(
                _at(row, sparse_table.RECV_DEST, start, local, anchor, FAST, ALIGN),
                tl.load(values + at, mask=hit),
                mask=hit,
            )
            tile_start += tl.sum(_popc(chunk).to(tl.int32), axis=0)


@triton.jit
def _block_entries(row, b, starts, j, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Entries `j .. j + CHUNK` of wire block `b` of a box: (payload positions, mask, in-block
    offsets, the offsets one entry earlier or -1)."""
    count = tl.minimum(tl.maximum(tl.load(_ptr(row, sparse_table.RECV_COUNTS, tl.int32) + b), 0), BLOCK)
    r = j + tl.arange(0, CHUNK)
    at = tl.load(starts + tl.load(row + sparse_table.RECV_FIRST) + b) + r
    ok = (r < count) & (at < tl.load(row + sparse_table.RECV_K))
    offsets = _ptr(row, sparse_table.RECV_OFFSETS, tl.int16)
    off = tl.load(offsets + at, mask=ok, other=0).to(tl.int32) & 0xFFFF
    before = tl.load(offsets + at - 1, mask=ok & (r > 0), other=-1).to(tl.int32)
    return at, ok, off, tl.where(r > 0, before & 0xFFFF, -1)


@triton.jit
def _block_count(row, b, BLOCK: tl.constexpr):
    return tl.minimum(tl.maximum(tl.load(_ptr(row, sparse_table.RECV_COUNTS, tl.int32) + b), 0), BLOCK)


@triton.jit
def _blocked_check_kernel(
    table, firsts, boxes, starts, flags, guard, CHUNK: tl.constexpr, BLOCK: tl.constexpr, COLUMNS: tl.constexpr
):
    box, b = _box(firsts, boxes)
    row = table + box * COLUMNS
    n = tl.load(row + sparse_table.RECV_N)
    wrong = tl.zeros([], dtype=tl.int32)
    for j in range(0, _block_count(row, b, BLOCK), CHUNK):
        _, ok, off, before = _block_entries(row, b, starts, j, CHUNK, BLOCK)
        wrong = wrong | tl.max((ok & ((off <= before) | (b * BLOCK + off >= n))).to(tl.int32), axis=0)
    _raise(flags, row, guard, wrong)


@triton.jit
def _blocked_apply_kernel(
    table,
    firsts,
    boxes,
    starts,
    guard,
    anchor,
    FAST: tl.constexpr,
    ALIGN: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    if tl.load(guard) != 0:  # a box of the bucket is malformed: nothing is written
        return
    box, b = _box(firsts, boxes)
    row = table + box * COLUMNS
    for j in range(0, _block_count(row, b, BLOCK), CHUNK):
        at, ok, off, _ = _block_entries(row, b, starts, j, CHUNK, BLOCK)
        v = tl.load(anchor + tl.load(row + sparse_table.RECV_VALUES) + at, mask=ok)
        tl.store(_at(row, sparse_table.RECV_DEST, b * BLOCK, off, anchor, False, ALIGN), v, mask=ok)


def _launch(kernel, total: int, args: tuple, warps: int = WARPS, **constexprs) -> None:
    """`kernel[(total,)](*args, **constexprs)` with `warps` warps a program, none when `total` is 0."""
    if total:
        kernel[(total,)](*args, **constexprs, num_warps=warps)


def _width(key: tuple[int, bool], device: torch.device) -> tuple[torch.Tensor, dict]:
    """(anchor, its constexprs) of a launch over elements of `key`'s width (`key`'s flag: every
    box on the vectorized path)."""
    width, fast = key
    return anchor(device, width), {"FAST": fast, "ALIGN": 16 // width}


def diff(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    words: torch.Tensor,
    counts: torch.Tensor,
    totals: torch.Tensor,
) -> None:
    """For each `SEND_*` row (elements of `key`'s width): its bitmap words and tile counts, at its
    slot of `words` / `counts` (bits past `n` are zero), and its changes added to `totals` at
    its `SEND_COUNT`."""
    at, fast = _width(key, words.device)
    args = (table, firsts, boxes, words, counts, totals, at)
    _launch(_diff_kernel, total, args, **fast, TILE=TILE, PART=TILE // DIFF_PARTS, COLUMNS=sparse_table.SEND_COLUMNS)


def compact(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    words: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    density: int,
) -> None:
    """For each `SEND_*` row: the marked elements at their positions (`starts` of its slot, made
    relative to its first tile), their indices, the wire bitmap and wire block counts, and the
    baseline update, as its payload columns ask (values at element offset `SEND_VALUES` unless
    `SEND_INDEX_KIND` is -1); `density`: the class of the rows' boxes (`sparse_table.density`)."""
    at, fast = _width(key, words.device)
    args = (table, firsts, boxes, words, starts, blocks, at)
    constexprs = dict(
        TILE=TILE, COLUMNS=sparse_table.SEND_COLUMNS, BLOCK=BLOCK, ROUNDS=ROUNDS, BUSY=density > 0, SUB=SUB
    )
    _launch(_compact_kernel, total, args, COMPACT_WARPS[density], **fast, **constexprs)


def bitmap_counts(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    counts: torch.Tensor,
    flags: torch.Tensor,
    guard: torch.Tensor,
) -> None:
    """Tile counts of each received bitmap (`RECV_*` rows) at its `first` in `counts`; flags stray
    bits (and raises `guard`)."""
    args = (table, firsts, boxes, counts, flags, guard)
    _launch(_bitmap_counts_kernel, total, args, BITMAP_COUNTS_WARPS, TILE=TILE, COLUMNS=sparse_table.RECV_COLUMNS)


def scan(
    table: torch.Tensor,
    boxes: int,
    counts: torch.Tensor,
    starts: torch.Tensor,
    flags: torch.Tensor,
    guard: torch.Tensor,
) -> None:
    """Starts from each row's counts (its `counts` column, or `counts` at its `first`); flags wrong
    counts (and raises `guard`)."""
    _launch(_scan_kernel, boxes, (table, counts, starts, flags, guard), CHUNK=CHUNK, COLUMNS=sparse_table.RECV_COLUMNS)


def expand(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    starts: torch.Tensor,
    density: int,
    guard: torch.Tensor,
) -> None:
    """Write each bitmap row's values into its marked elements, in order, unless `guard` is raised
    (`density`: the class of the rows' boxes, `sparse_table.density`)."""
    at, fast = _width(key, starts.device)
    args = (table, firsts, boxes, starts, guard, at)
    constexprs = dict(TILE=TILE, COLUMNS=sparse_table.RECV_COLUMNS, ROUNDS=ROUNDS, BUSY=density > 0, SUB=SUB)
    _launch(_expand_kernel, total, args, EXPAND_WARPS[density], **fast, **constexprs)


def blocked_check(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    starts: torch.Tensor,
    flags: torch.Tensor,
    guard: torch.Tensor,
) -> None:
    """Flag blocked rows whose offsets are not strictly increasing inside the box (and raise `guard`)."""
    args = (table, firsts, boxes, starts, flags, guard)
    _launch(_blocked_check_kernel, total, args, CHUNK=CHUNK, BLOCK=BLOCK, COLUMNS=sparse_table.RECV_COLUMNS)


def blocked_apply(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    starts: torch.Tensor,
    guard: torch.Tensor,
) -> None:
    """Write each blocked row's values at its offsets, unless `guard` is raised."""
    at, fast = _width(key, starts.device)
    args = (table, firsts, boxes, starts, guard, at)
    _launch(_blocked_apply_kernel, total, args, **fast, CHUNK=CHUNK, BLOCK=BLOCK, COLUMNS=sparse_table.RECV_COLUMNS)
