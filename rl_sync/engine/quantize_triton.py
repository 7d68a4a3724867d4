"""The FP8 block quantizer's two passes as Triton kernels (CUDA shards; `engine.quantize` uses
torch ops elsewhere, with the same results bit for bit on finite values).

One program per block the shard touches (any block size: rows go `ROWS_PER_STEP` at a time,
columns in a power-of-two tile, both masked to the block): `block_amax` reads the block's part of the shard
once (2 bytes an element for bf16), `quantize_blocks` reads it again and writes one byte an
element; a shard cutting a block reads only its own rows and columns of it (masked loads),
so nothing is padded or copied. Results match the torch path: the amax is exact (a maximum),
`x * inv_scale` is one IEEE fp32 multiply with `inv_scale` computed by torch, and the cast
rounds to nearest even (saturating only values that torch would turn into NaN, which finite
blocks never reach); a block holding a NaN gets a NaN amax, as `torch.amax` gives. A block's start is
computed in 64 bits (a shard of an MoE layer's stacked experts passes 2**31 elements), the
offsets within it in 32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_STEP = 32


@triton.jit
def _block(n, k, top, left, BN: tl.constexpr, BK: tl.constexpr, WIDTH: tl.constexpr):
    """This program's block: its first row and column in the shard (64-bit: shards may pass 2**31
    elements; may be negative where the shard starts inside the block), the valid rows within
    it as `[r_lo, r_hi)`, and the column mask of its tile."""
    row0 = tl.program_id(1).to(tl.int64) * BN - top
    col0 = tl.program_id(0).to(tl.int64) * BK - left
    r_lo, r_hi = tl.maximum(-row0, 0).to(tl.int32), tl.minimum(n - row0, BN).to(tl.int32)
    c = tl.arange(0, WIDTH)
    col_ok = (c >= tl.maximum(-col0, 0).to(tl.int32)) & (c < tl.minimum(k - col0, BK).to(tl.int32))
    return row0, col0, r_lo, r_hi, c, col_ok


@triton.jit
def _amax_kernel(
    x,
    out,
    n,
    k,
    top,
    left,
    s_l,
    s_r,
    s_c,
    R,
    C,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STEP: tl.constexpr,
    WIDTH: tl.constexpr,
):
    row0, col0, r_lo, r_hi, c, col_ok = _block(n, k, top, left, BN, BK, WIDTH)
    lead = tl.program_id(2).to(tl.int64)
    start = x + lead * s_l + row0 * s_r + col0 * s_c
    peak = tl.zeros([STEP, WIDTH], dtype=tl.float32)
    nans = tl.zeros([STEP, WIDTH], dtype=tl.int32)
    for step in range(0, BN, STEP):
        r = step + tl.arange(0, STEP)
        ok = ((r >= r_lo) & (r < r_hi))[:, None] & col_ok[None, :]
        v = tl.load(start + r[:, None] * s_r + c[None, :] * s_c, mask=ok, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(v))
        nans += (v != v).to(tl.int32)
    m = tl.max(tl.max(peak, axis=1), axis=0)
    m = tl.where(tl.sum(tl.sum(nans, axis=1), axis=0) > 0, float("nan"), m)
    tl.store(out + (lead * R + tl.program_id(1)) * C + tl.program_id(0), m)


@triton.jit
def _quantize_kernel(
    x,
    inv,
    q,
    n,
    k,
    top,
    left,
    s_l,
    s_r,
    s_c,
    q_l,
    q_r,
    q_c,
    R,
    C,
    BN: tl.constexpr,
    BK: tl.constexpr,
    STEP: tl.constexpr,
    WIDTH: tl.constexpr,
):
    row0, col0, r_lo, r_hi, c, col_ok = _block(n, k, top, left, BN, BK, WIDTH)
    lead = tl.program_id(2).to(tl.int64)
    scale = tl.load(inv + (lead * R + tl.program_id(1)) * C + tl.program_id(0))
    start = x + lead * s_l + row0 * s_r + col0 * s_c
    target = q + lead * q_l + row0 * q_r + col0 * q_c
    for step in range(0, BN, STEP):
        r = step + tl.arange(0, STEP)
        ok = ((r >= r_lo) & (r < r_hi))[:, None] & col_ok[None, :]
        v = tl.load(start + r[:, None] * s_r + c[None, :] * s_c, mask=ok, other=0.0).to(tl.float32)
        tl.store(target + r[:, None] * q_r + c[None, :] * q_c, (v * scale).to(tl.float8e4nv), mask=ok)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((-1,) + tuple(t.shape[-2:])) if t.ndim != 3 else t


def _launch(kernel, x: torch.Tensor, grid_shape: tuple[int, ...], offsets: tuple[int, int], block, *args) -> None:
    x3 = _as_3d(x)
    (bn, bk), (top, left) = block, (offsets[0] % block[0], offsets[1] % block[1])
    R, C = grid_shape[-2], grid_shape[-1]
    kernel[(C, R, x3.shape[0])](
        x3,
        *args[:-1],
        x3.shape[1],
        x3.shape[2],
        top,
        left,
        *x3.stride(),
        *args[-1],
        R,
        C,
        BN=bn,
        BK=bk,
        STEP=min(ROWS_PER_STEP, triton.next_power_of_2(bn)),
        WIDTH=triton.next_power_of_2(bk),
    )


def block_amax(x: torch.Tensor, offsets: tuple[int, int], block: tuple[int, int], out: torch.Tensor) -> None:
    """`out` (the touched grid, fp32, contiguous) = max |x| per block; `offsets`: where `x`
    starts in its last two global dims."""
    _launch(_amax_kernel, x, tuple(out.shape), offsets, block, out, ())


def quantize_blocks(
    x: torch.Tensor, offsets: tuple[int, int], block: tuple[int, int], inv: torch.Tensor, q: torch.Tensor
) -> None:
    """`q` (FP8, the shape of `x`) = `x * inv` per block, `inv` the touched grid's 1 / scale."""
    q3 = _as_3d(q)
    assert q3.data_ptr() == q.data_ptr(), "FP8 buffers are allocated contiguous"
    _launch(_quantize_kernel, x, tuple(inv.shape), offsets, block, inv, q3, tuple(q3.stride()))
