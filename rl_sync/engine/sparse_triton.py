"""The sparse codec's CUDA kernels (Triton): find, encode, validate and apply in a few passes,
with no host synchronization inside them.

Every box is cut into tiles of `TILE` elements (row-major over the box; a wire block of
`sparse.BLOCK` elements is 16 tiles). Elements are compared, copied and written as integers
of their width, so NaN payloads and -0.0 keep their bits. A box is addressed through
`Strided2D`: its flat row-major index `i` sits at `(i // cols) * row_stride + (i % cols) *
col_stride` elements from its start (contiguous boxes skip the division).

Sender, per box:
1. `diff`: one read of the box and its baseline; writes the box's change bitmap (the wire's
   `BITMAP` bit order) and one count per tile.
2. The caller sums the counts of every box of a bucket on the device and reads them back in one
   transfer, chooses each box's encoding, and turns the tile counts into tile starts.
3. `compact`: reads the bitmap and only the changed elements, and writes them (and their
   int32 indices or uint16 in-block offsets) at their tile's start; optionally writes them
   into the baseline too (the baseline update).

Receiver: `bitmap_counts` / `blocked_check` validate a payload into device flags (no write);
only once every box of the bucket is valid do `expand` (bitmap) and `blocked_apply` write
into the live view. Loads from a payload are bounded by the header's count, so even an
unvalidated payload cannot make a kernel read out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..sparse import BLOCK

TILE = 4096
"""Elements per program in the tile kernels (a power of two dividing `sparse.BLOCK`)."""
CHUNK = 1024
"""Elements per step of the per-block kernels."""
NONE, INT32_INDEX, UINT16_OFFSET = 0, 1, 2
"""What `compact` writes beside the values."""


@dataclass(frozen=True)
class Strided2D:
    """A box as (bits tensor, cols, row stride, col stride): `bits` has the box's storage and
    start, reinterpreted as same-width integers."""

    bits: torch.Tensor
    cols: int
    row_stride: int
    col_stride: int

    @property
    def contiguous(self) -> bool:
        return self.col_stride == 1 and self.row_stride == self.cols

    def args(self) -> tuple:
        return self.bits, self.cols, self.row_stride, self.col_stride


def as_2d(view: torch.Tensor, bits: torch.Tensor) -> Strided2D | None:
    """`view` (with `bits`, its integer reinterpretation) as a `Strided2D`, or None when its
    dims do not merge into two."""
    dims = [(size, stride) for size, stride in zip(view.shape, view.stride()) if size != 1]
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
    return Strided2D(bits, cols, row_stride, col_stride)


@triton.jit
def _where(i, cols, row_stride, col_stride, CONTIG: tl.constexpr):
    if CONTIG:
        return i
    return (i // cols) * row_stride + (i % cols) * col_stride


@triton.jit
def _popc(x):
    """Set bits of each uint32."""
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
def _tile(n, TILE: tl.constexpr):
    """This program's elements as a [TILE // 32, 32] grid of int64 flat indices (row w: bitmap
    word w of the tile), and the number of them below `n` per word."""
    w = tl.arange(0, TILE // 32)
    first = tl.program_id(0).to(tl.int64) * TILE + w * 32
    return first[:, None] + tl.arange(0, 32)[None, :], n - first


@triton.jit
def _marked(bitmap, n, TILE: tl.constexpr):
    """(flat indices, hits, positions among the tile's hits, the tile's hit count): the bitmap's
    marks of this tile, bits at or past `n` ignored."""
    i, left = _tile(n, TILE)
    word = tl.load(bitmap + tl.program_id(0).to(tl.int64) * (TILE // 32) + tl.arange(0, TILE // 32),
                   mask=left > 0, other=0).to(tl.uint32, bitcast=True) & _low_bits(left)
    j = tl.arange(0, 32).to(tl.uint32)
    hit = ((word[:, None] >> j[None, :]) & 1) != 0
    per_word = _popc(word).to(tl.int32)
    below = _popc(word[:, None] & ((tl.full([32], 1, tl.uint32) << j) - 1)[None, :]).to(tl.int32)
    at = (tl.cumsum(per_word, axis=0) - per_word)[:, None] + below
    return i, hit, at, tl.sum(per_word, axis=0)


@triton.jit
def _diff_kernel(cur, c_cols, c_rs, c_cs, base, b_cols, b_rs, b_cs, n, bitmap, counts,
                 C_CONTIG: tl.constexpr, B_CONTIG: tl.constexpr, TILE: tl.constexpr):
    i, left = _tile(n, TILE)
    inside = i < n
    a = tl.load(cur + _where(i, c_cols, c_rs, c_cs, C_CONTIG), mask=inside, other=0)
    b = tl.load(base + _where(i, b_cols, b_rs, b_cs, B_CONTIG), mask=inside, other=0)
    differ = (a != b) & inside
    word = tl.sum(differ.to(tl.uint32) << tl.arange(0, 32).to(tl.uint32)[None, :], axis=1)
    pid = tl.program_id(0).to(tl.int64)
    tl.store(bitmap + pid * (TILE // 32) + tl.arange(0, TILE // 32), word.to(tl.int32, bitcast=True))
    tl.store(counts + pid, tl.sum(tl.sum(differ.to(tl.int32), axis=1), axis=0))


@triton.jit
def _compact_kernel(cur, c_cols, c_rs, c_cs, base, b_cols, b_rs, b_cs, n, bitmap, starts, values, index,
                    C_CONTIG: tl.constexpr, B_CONTIG: tl.constexpr, VALUES: tl.constexpr, INDEX: tl.constexpr,
                    UPDATE: tl.constexpr, TILE: tl.constexpr):
    i, hit, at, _ = _marked(bitmap, n, TILE)
    v = tl.load(cur + _where(i, c_cols, c_rs, c_cs, C_CONTIG), mask=hit)
    if UPDATE:
        tl.store(base + _where(i, b_cols, b_rs, b_cs, B_CONTIG), v, mask=hit)
    at += tl.load(starts + tl.program_id(0)) - tl.load(starts)
    if VALUES:
        tl.store(values + at, v, mask=hit)
    if INDEX == 1:
        tl.store(index + at, i.to(tl.int32), mask=hit)
    if INDEX == 2:
        tl.store(index + at, (i & 0xFFFF).to(tl.int32).to(tl.int16), mask=hit)


@triton.jit
def _popcount_kernel(bitmap, n, counts, flags, slot, TILE: tl.constexpr):
    """Tile counts; flags the box when a bit between `n` and the bitmap's last whole byte is set."""
    _, _, _, count = _marked(bitmap, n, TILE)
    tl.store(counts + tl.program_id(0), count)
    _, left = _tile(n, TILE)
    word = tl.load(bitmap + tl.program_id(0).to(tl.int64) * (TILE // 32) + tl.arange(0, TILE // 32),
                   mask=left > 0, other=0).to(tl.uint32, bitcast=True)
    wire_bits = (n + 7) // 8 * 8 - (n - left)
    stray = word & ~_low_bits(left) & _low_bits(wire_bits)
    tl.atomic_max(flags + slot, tl.max((stray != 0).to(tl.int32), axis=0))


@triton.jit
def _scan_kernel(counts, m, k, starts, flags, slot, LIMIT: tl.constexpr, CHUNK: tl.constexpr):
    """One program: `starts` = exclusive prefix sums of `counts` (each clamped to 0..LIMIT);
    flags the box when a count is out of range or they do not sum to `k`."""
    carry = tl.zeros([], dtype=tl.int64)
    wrong = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, m, CHUNK):
        r = c0 + tl.arange(0, CHUNK)
        x = tl.load(counts + r, mask=r < m, other=0)
        wrong = wrong | tl.max(((x < 0) | (x > LIMIT)).to(tl.int32), axis=0)
        x = tl.minimum(tl.maximum(x, 0), LIMIT).to(tl.int64)
        tl.store(starts + r, carry + tl.cumsum(x, axis=0) - x, mask=r < m)
        carry += tl.sum(x, axis=0)
    tl.atomic_max(flags + slot, wrong | (carry != k).to(tl.int32))


@triton.jit
def _expand_kernel(dest, d_cols, d_rs, d_cs, n, k, bitmap, starts, values, D_CONTIG: tl.constexpr,
                   TILE: tl.constexpr):
    i, hit, at, _ = _marked(bitmap, n, TILE)
    at += tl.load(starts + tl.program_id(0))
    hit = hit & (at < k)
    v = tl.load(values + at, mask=hit)
    tl.store(dest + _where(i, d_cols, d_rs, d_cs, D_CONTIG), v, mask=hit)


@triton.jit
def _block_entries(counts, starts, offsets, k, j, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Entries `j .. j + CHUNK` of this program's wire block: (payload positions, mask, in-block
    offsets, the offsets one entry earlier or -1)."""
    b = tl.program_id(0).to(tl.int64)
    count = tl.minimum(tl.maximum(tl.load(counts + b), 0), BLOCK)
    r = j + tl.arange(0, CHUNK)
    at = tl.load(starts + b) + r
    ok = (r < count) & (at < k)
    off = tl.load(offsets + at, mask=ok, other=0).to(tl.int32) & 0xFFFF
    before = tl.load(offsets + at - 1, mask=ok & (r > 0), other=-1).to(tl.int32)
    before = tl.where(r > 0, before & 0xFFFF, -1)
    return at, ok, off, before


@triton.jit
def _blocked_check_kernel(counts, starts, offsets, n, k, flags, slot, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    wrong = tl.zeros([], dtype=tl.int32)
    for j in range(0, tl.minimum(tl.maximum(tl.load(counts + b), 0), BLOCK), CHUNK):
        at, ok, off, before = _block_entries(counts, starts, offsets, k, j, CHUNK, BLOCK)
        outside = ok & ((off <= before) | (b * BLOCK + off >= n))
        wrong = wrong | tl.max(outside.to(tl.int32), axis=0)
    tl.atomic_max(flags + slot, wrong)


@triton.jit
def _blocked_apply_kernel(dest, d_cols, d_rs, d_cs, counts, starts, offsets, values, k, D_CONTIG: tl.constexpr,
                          CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    for j in range(0, tl.minimum(tl.maximum(tl.load(counts + b), 0), BLOCK), CHUNK):
        at, ok, off, _ = _block_entries(counts, starts, offsets, k, j, CHUNK, BLOCK)
        v = tl.load(values + at, mask=ok)
        tl.store(dest + _where(b * BLOCK + off, d_cols, d_rs, d_cs, D_CONTIG), v, mask=ok)


def tiles(n: int) -> int:
    return -(-n // TILE)


def diff(cur: Strided2D, base: Strided2D, n: int, bitmap: torch.Tensor, counts: torch.Tensor) -> None:
    """`bitmap` (int32 words, `tiles(n) * TILE // 32`) and `counts` (`tiles(n)` int32) of the
    elements whose bits differ; bits past `n` are zero."""
    _diff_kernel[(tiles(n),)](*cur.args(), *base.args(), n, bitmap, counts, C_CONTIG=cur.contiguous,
                              B_CONTIG=base.contiguous, TILE=TILE)


def compact(cur: Strided2D, base: Strided2D | None, n: int, bitmap: torch.Tensor, starts: torch.Tensor,
            values: torch.Tensor | None, index: torch.Tensor | None, index_kind: int) -> None:
    """Write the marked elements of `cur` at their tile's start (`starts[t] - starts[0]`) into
    `values` (if given) and their indices (`index_kind`) into `index`, and into `base` where
    `base` is given."""
    dummy = starts
    _compact_kernel[(tiles(n),)](*cur.args(), *(base.args() if base else (dummy, 1, 1, 1)), n, bitmap, starts,
                                 dummy if values is None else values, dummy if index is None else index,
                                 C_CONTIG=cur.contiguous, B_CONTIG=base is None or base.contiguous,
                                 VALUES=values is not None, INDEX=index_kind, UPDATE=base is not None, TILE=TILE)


def bitmap_check(bitmap: torch.Tensor, n: int, k: int, counts: torch.Tensor, starts: torch.Tensor,
                 flags: torch.Tensor, slot: int) -> None:
    """Tile counts and starts of a received bitmap (int32 words); `flags[slot]` set when it has
    stray bits or does not mark exactly `k` elements."""
    _popcount_kernel[(tiles(n),)](bitmap, n, counts, flags, slot, TILE=TILE)
    _scan_kernel[(1,)](counts, counts.numel(), k, starts, flags, slot, LIMIT=TILE, CHUNK=CHUNK)


def expand(dest: Strided2D, n: int, k: int, bitmap: torch.Tensor, starts: torch.Tensor, values: torch.Tensor) -> None:
    """Write `values` into the marked elements of `dest`, in order."""
    _expand_kernel[(tiles(n),)](*dest.args(), n, k, bitmap, starts, values, D_CONTIG=dest.contiguous, TILE=TILE)


def blocked_check(counts: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor, n: int, k: int,
                  flags: torch.Tensor, slot: int) -> None:
    """Starts of each wire block's run; `flags[slot]` set when a count is out of range, the
    counts do not sum to `k`, or a block's offsets are not strictly increasing inside the box."""
    _scan_kernel[(1,)](counts, counts.numel(), k, starts, flags, slot, LIMIT=BLOCK, CHUNK=CHUNK)
    _blocked_check_kernel[(counts.numel(),)](counts, starts, offsets, n, k, flags, slot, CHUNK=CHUNK, BLOCK=BLOCK)


def blocked_apply(dest: Strided2D, counts: torch.Tensor, starts: torch.Tensor, offsets: torch.Tensor,
                  values: torch.Tensor, k: int) -> None:
    """Write each wire block's values at its offsets (a validated payload)."""
    _blocked_apply_kernel[(counts.numel(),)](*dest.args(), counts, starts, offsets, values, k,
                                             D_CONTIG=dest.contiguous, CHUNK=CHUNK, BLOCK=BLOCK)
