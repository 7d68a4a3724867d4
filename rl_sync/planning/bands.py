"""Row bands: a template cut along global dim 0 so no rank moves more than a bucket.

A tensor whose transfers put more than `bucket_bytes` on one mesh position is
cut into `ceil(peak / bucket_bytes)` row bands (`torch.chunk` of dim 0); each
band's transfers are the template's transfers clipped to its rows. Bands are
shared by every tensor with the same template and dtype size, and answer "what
does position p send / receive in band b" from a cache, so a rank expanding
its schedule touches each distinct template once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .layout import chunk_bounds
from .template import Template, sum_by

SideTransfer = tuple[int, tuple[int, ...], tuple[int, ...], int]
"""(peer position, global offsets, sizes, numel) of one transfer seen from one side."""


@dataclass(frozen=True, eq=False)
class Band:
    """The transfers of one row band (global rows `[lo, hi)`), as columns, with per-position lookups."""

    lo: int
    hi: int
    src: np.ndarray
    dst: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    numel: np.ndarray
    send_numel: np.ndarray
    recv_numel: np.ndarray
    _transfers: dict[tuple[str, int], list[SideTransfer]] = field(default_factory=dict)

    def transfers(self, side: str, pos: int) -> list[SideTransfer]:
        """Transfers where position `pos` is the `side` ("src" or "dst"), in template order."""
        cached = self._transfers.get((side, pos))
        if cached is None:
            mine, peers = (self.src, self.dst) if side == "src" else (self.dst, self.src)
            picked = np.nonzero(mine == pos)[0]
            cached = [
                (p, tuple(o), tuple(z), n)
                for p, o, z, n in zip(
                    peers[picked].tolist(),
                    self.offsets[picked].tolist(),
                    self.sizes[picked].tolist(),
                    self.numel[picked].tolist(),
                )
            ]
            self._transfers[(side, pos)] = cached
        return cached


def _clip(template: Template, lo: int, hi: int) -> Band:
    offsets, sizes = template.offsets.copy(), template.sizes.copy()
    keep = np.ones(len(offsets), dtype=bool)
    if offsets.shape[1]:
        start = np.maximum(offsets[:, 0], lo)
        stop = np.minimum(offsets[:, 0] + sizes[:, 0], hi)
        keep = stop > start
        offsets[:, 0], sizes[:, 0] = start, stop - start
    src, dst, offsets, sizes = template.src[keep], template.dst[keep], offsets[keep], sizes[keep]
    numel = sizes.prod(axis=1)
    return Band(
        lo,
        hi,
        src,
        dst,
        offsets,
        sizes,
        numel,
        sum_by(src, numel, len(template.send_numel)),
        sum_by(dst, numel, len(template.recv_numel)),
    )


def band_count(template: Template, itemsize: int, bucket_bytes: int) -> int:
    """How many row bands `make_bands` cuts `template` into (at most its rows)."""
    shape = template.key.shape
    peak = max(int(template.send_numel.max(initial=0)), int(template.recv_numel.max(initial=0))) * itemsize
    rows = shape[0] if shape else 1
    return max(1, min(rows, -(-peak // bucket_bytes)))


def make_bands(template: Template, itemsize: int, bucket_bytes: int) -> tuple[Band, ...]:
    """Cut `template` into row bands of at most about `bucket_bytes` per position."""
    shape = template.key.shape
    rows = shape[0] if shape else 1
    count = band_count(template, itemsize, bucket_bytes)
    if count == 1:
        return (_clip(template, 0, rows),)
    return tuple(_clip(template, start, start + size) for start, size in chunk_bounds(rows, count) if size)
