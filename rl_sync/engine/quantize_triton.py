"""The FP8 block quantizer's two passes as Triton kernels (CUDA shards; `engine.quantize` uses
torch ops elsewhere, with the same results bit for bit on finite values).

One program per block the shard touches (any block size: rows go `ROWS_PER_STEP` at a time,
columns in a power-of-two tile, both masked to the block): `block_amax` reads the block's part of the shard
once (2 bytes an element for bf16), `quantize_blocks` reads it again and writes one byte an
element; a shard cutting a block reads only its own rows and columns of it (masked loads),
so nothing is padded or copied. Results match the torch path: the amax is exact (a maximum),
`x * inv_scale` is one IEEE fp32 multiply with `inv_scale` computed by torch, and the cast
rounds to nearest even (saturating only values that torch would turn into NaN, which finite
blocks never reach); a block holding a NaN gets a NaN amax, as `torch.amax` gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS_PER_STEP = 32


@triton.jit
def _amax_kernel(x, out, n, k, top, left, s_l, s_r, s_c, R, C, BN: tl.constexpr, BK: tl.constexpr,
                 STEP: tl.constexpr, WIDTH: tl.constexpr):
    bc, br, lead = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    cols = bc * BK - left + tl.arange(0, WIDTH)
    col_ok = (cols >= 0) & (cols < k) & (tl.arange(0, WIDTH) < BK)
    peak = tl.zeros([STEP, WIDTH], dtype=tl.float32)
    nans = tl.zeros([STEP, WIDTH], dtype=tl.int32)
    for step in range(0, BN, STEP):
        rows = br * BN - top + step + tl.arange(0, STEP)
        ok = ((rows >= 0) & (rows < n) & (step + tl.arange(0, STEP) < BN))[:, None] & col_ok[None, :]
        v = tl.load(x + lead * s_l + rows[:, None] * s_r + cols[None, :] * s_c, mask=ok, other=0.0).to(tl.float32)
        peak = tl.maximum(peak, tl.abs(v))
        nans += (v != v).to(tl.int32)
    m = tl.max(tl.max(peak, axis=1), axis=0)
    m = tl.where(tl.sum(tl.sum(nans, axis=1), axis=0) > 0, float("nan"), m)
    tl.store(out + (lead * R + br) * C + bc, m)


@triton.jit
def _quantize_kernel(x, inv, q, n, k, top, left, s_l, s_r, s_c, q_l, q_r, q_c, R, C, BN: tl.constexpr,
                     BK: tl.constexpr, STEP: tl.constexpr, WIDTH: tl.constexpr):
    bc, br, lead = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    scale = tl.load(inv + (lead * R + br) * C + bc)
    cols = bc * BK - left + tl.arange(0, WIDTH)
    col_ok = (cols >= 0) & (cols < k) & (tl.arange(0, WIDTH) < BK)
    for step in range(0, BN, STEP):
        rows = br * BN - top + step + tl.arange(0, STEP)
        ok = ((rows >= 0) & (rows < n) & (step + tl.arange(0, STEP) < BN))[:, None] & col_ok[None, :]
        v = tl.load(x + lead * s_l + rows[:, None] * s_r + cols[None, :] * s_c, mask=ok, other=0.0).to(tl.float32)
        tl.store(q + lead * q_l + rows[:, None] * q_r + cols[None, :] * q_c, (v * scale).to(tl.float8e4nv), mask=ok)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape((-1,) + tuple(t.shape[-2:])) if t.ndim != 3 else t


def _launch(kernel, x: torch.Tensor, grid_shape: tuple[int, ...], offsets: tuple[int, int], block, *args) -> None:
    x3 = _as_3d(x)
    (bn, bk), (top, left) = block, (offsets[0] % block[0], offsets[1] % block[1])
    R, C = grid_shape[-2], grid_shape[-1]
    kernel[(C, R, x3.shape[0])](x3, *args[:-1], x3.shape[1], x3.shape[2], top, left, *x3.stride(), *args[-1], R, C,
                                BN=bn, BK=bk, STEP=min(ROWS_PER_STEP, triton.next_power_of_2(bn)),
                                WIDTH=triton.next_power_of_2(bk))


def block_amax(x: torch.Tensor, offsets: tuple[int, int], block: tuple[int, int], out: torch.Tensor) -> None:
    """`out` (the touched grid, fp32, contiguous) = max |x| per block; `offsets`: where `x`
    starts in its last two global dims."""
    _launch(_amax_kernel, x, tuple(out.shape), offsets, block, out, ())


def quantize_blocks(x: torch.Tensor, offsets: tuple[int, int], block: tuple[int, int], inv: torch.Tensor,
                    q: torch.Tensor) -> None:
    """`q` (FP8, the shape of `x`) = `x * inv` per block, `inv` the touched grid's 1 / scale."""
    q3 = _as_3d(q)
    assert q3.data_ptr() == q.data_ptr(), "FP8 buffers are allocated contiguous"
    _launch(_quantize_kernel, x, tuple(inv.shape), offsets, block, inv, q3, tuple(q3.stride()))
