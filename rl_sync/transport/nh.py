"""NH, the almost-universal hash of UMAC (RFC 4418, section 5.2), compressing a payload on its device.

A payload is cut into 1 KiB blocks (the last one zero-padded), each read as
256 little-endian 32-bit words `m`. Under key words `k`, one lane of NH is::

    sum over i < 128 of ((m[2i] + k[2i]) mod 2**32) * ((m[2i+1] + k[2i+1]) mod 2**32)   mod 2**64

Two different blocks collide with probability at most 2**-32 per lane over
the key; lane j uses the key shifted by 4j words (UMAC's Toeplitz
construction), so `LANES = 2` gives 2**-64. A block becomes 16 bytes: 1/64 of
the payload. `nh_reduce` applies NH again to those words, each level under its
own key, until at most `REDUCED_BYTES` remain (a 1 GiB payload: three levels,
4 KiB); a collision of the whole then needs one at some level, so its bound is
the sum of the levels' (3 * 2**-64 for 1 GiB). Only that remainder crosses to
the host for the final keyed BLAKE3 (`rl_sync.transport.digest`). On CUDA one Triton
launch per level reads each byte once; elsewhere, or without Triton, the same
result comes from torch operations.

Typical use::

    keys = nh_keys(secret, device)
    words = nh_reduce(payload_bytes, keys)      # int64, at most REDUCED_BYTES
"""

from __future__ import annotations

import hashlib
import struct

import torch

BLOCK_WORDS = 256
BLOCK_BYTES = 4 * BLOCK_WORDS
LANES = 2
CHUNK_BYTES = 64 << 20
"""Payload compressed per torch step (bounds the fallback's temporaries to a few times this)."""
REDUCED_BYTES = 4096
MAX_LEVELS = 8
"""Enough for 2**48 bytes (`rl_sync.planning.plan`'s element bound) at 1/64 per level."""
_MASK32 = 0xFFFFFFFF


def nh_key(key: bytes, device: torch.device) -> torch.Tensor:
    """NH's key words (int64 holding uint32), expanded from `key` by SHAKE-256."""
    words = BLOCK_WORDS + 4 * (LANES - 1)
    raw = hashlib.shake_256(b"rl-sync nh" + key).digest(4 * words)
    return torch.tensor(struct.unpack(f"<{words}I", raw), dtype=torch.int64, device=device)


def nh_keys(key: bytes, device: torch.device) -> list[torch.Tensor]:
    """One independent NH key per level of `nh_reduce`."""
    return [nh_key(key + bytes([level]), device) for level in range(MAX_LEVELS)]


def nh_reduce(buf: torch.Tensor, keys: list[torch.Tensor]) -> torch.Tensor:
    """NH of `buf`, then of its words, level after level, until at most `REDUCED_BYTES` remain
    (always at least one level: nothing of the payload itself is returned)."""
    words = nh_compress(buf, keys[0])
    level = 1
    while words.numel() * 8 > REDUCED_BYTES:
        words = nh_compress(words.view(torch.uint8), keys[level])
        level += 1
    return words


def nh_compress(buf: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NH of `buf` (uint8, on `key`'s device): `LANES` int64 words per block, in block order."""
    full = buf.numel() // BLOCK_BYTES * BLOCK_BYTES
    parts = [_blocks(buf[start : min(full, start + CHUNK_BYTES)], key) for start in range(0, full, CHUNK_BYTES)]
    if full < buf.numel():
        tail = torch.zeros(BLOCK_BYTES, dtype=torch.uint8, device=buf.device)
        tail[: buf.numel() - full] = buf[full:]
        parts.append(_blocks(tail, key))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=buf.device)


def _blocks(chunk: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """NH of whole blocks; copied first when not 4-byte aligned."""
    if chunk.data_ptr() % 4:
        chunk = chunk.clone()
    words = chunk.view(torch.int32).view(-1, BLOCK_WORDS)
    if chunk.is_cuda and _kernel() is not None:
        blocks = words.shape[0]
        out = torch.empty(blocks * LANES, dtype=torch.int64, device=chunk.device)
        grid = (-(-blocks // BLOCKS_PER_PROGRAM),)
        _kernel()[grid](
            words, key, out, blocks, WORDS=BLOCK_WORDS, LANES=LANES, PER_PROGRAM=BLOCKS_PER_PROGRAM, num_warps=8
        )
        return out
    return _nh_torch(words, key)


def _nh_torch(rows: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The reference: int64 arithmetic wraps modulo 2**64 as NH's sum and products do."""
    words = rows.to(torch.int64) & _MASK32
    lanes = []
    for lane in range(LANES):
        mixed = (words + key[4 * lane : 4 * lane + BLOCK_WORDS]) & _MASK32
        lanes.append((mixed[:, 0::2] * mixed[:, 1::2]).sum(dim=1))
    return torch.stack(lanes, dim=1).flatten()


BLOCKS_PER_PROGRAM = 16
"""Blocks one Triton program hashes: 16 KiB read as one contiguous tile."""

_KERNEL: list = []


def _kernel():
    """The Triton kernel, or None without Triton."""
    if not _KERNEL:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            _KERNEL.append(None)
            return None

        @triton.jit
        def nh_blocks(
            words_ptr, key_ptr, out_ptr, blocks, WORDS: tl.constexpr, LANES: tl.constexpr, PER_PROGRAM: tl.constexpr
        ):
            row = tl.program_id(0).to(tl.int64) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)
            column = tl.arange(0, WORDS)
            mask = (row < blocks)[:, None]
            tile = tl.load(words_ptr + row[:, None] * WORDS + column[None, :], mask=mask, other=0)
            even, odd = tl.split(tl.reshape(tile.to(tl.uint32).to(tl.uint64), (PER_PROGRAM, WORDS // 2, 2)))
            pair = tl.arange(0, WORDS // 2)
            for lane in tl.static_range(LANES):
                k_even = tl.load(key_ptr + 4 * lane + 2 * pair).to(tl.uint64)
                k_odd = tl.load(key_ptr + 4 * lane + 2 * pair + 1).to(tl.uint64)
                a = (even + k_even[None, :]) & 0xFFFFFFFF
                b = (odd + k_odd[None, :]) & 0xFFFFFFFF
                total = tl.sum(a * b, axis=1).to(tl.int64, bitcast=True)
                tl.store(out_ptr + row * LANES + lane, total, mask=row < blocks)

        _KERNEL.append(nh_blocks)
    return _KERNEL[0]
