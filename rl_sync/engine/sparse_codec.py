"""Torch side of sparse deltas: find changed elements, encode, validate, apply.

Changes are found bit-exactly (elements compared as integers of their width,
so NaN payloads and -0.0 count). Indices are flat, row-major, local to the
transfer's box. Decoding validates everything (ranges, order, bit counts,
sizes) and only then writes, so malformed input never reaches live storage
and never triggers a device-side assert.
"""

from __future__ import annotations

import numpy as np
import torch

from ..sparse import BITMAP, BLOCK, BLOCKED, DENSE, INDICES, encoded_nbytes

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements reinterpreted as same-width integers (bit patterns)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t if t.dtype == _BITS[t.element_size()] else t.view(_BITS[t.element_size()])


def changed(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of elements whose bits differ (row-major over the box).

    Elements wider than 8 bytes (complex128) are all marked changed: they travel dense."""
    if cur.element_size() not in _BITS:
        return torch.ones(cur.numel(), dtype=torch.bool, device=cur.device)
    return (as_bits(cur) != as_bits(base.to(cur.device, non_blocking=True))).reshape(-1)


class Changes:
    """The elements of a box whose bits differ from its baseline: `count`, and their row-major
    flat `index` (int64) and `mask` (flat bool), each computed once, when first asked for.

    Contiguous boxes are compared 8 bytes at a time first; while few words differ, only those
    are looked at element by element, so a low-density box is scanned without a per-element
    mask of the whole box. Otherwise the elements are compared into a mask, whose count is one
    reduction: a box that goes dense never builds its index."""

    def __init__(self, cur: torch.Tensor, base: torch.Tensor):
        self.cur, self.base = cur, base.to(cur.device, non_blocking=True)
        self._index: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        words = _words(self.cur), _words(self.base)
        if words[0] is not None and words[1] is not None:
            differ = words[0] != words[1]
            if int(differ.sum()) * SPARSE_WORDS <= differ.numel():
                self._index = _inside(torch.nonzero(differ).reshape(-1), words, cur)
        if self._index is None:
            self._mask = changed(self.cur, self.base)
            self.count = int(self._mask.sum())  # the one host sync of a sparse encode on a GPU
        else:
            self.count = self._index.numel()

    @property
    def index(self) -> torch.Tensor:
        if self._index is None:
            self._index = torch.nonzero(self._mask).reshape(-1)
        return self._index

    @property
    def mask(self) -> torch.Tensor:
        if self._mask is None:
            self._mask = torch.zeros(self.cur.numel(), dtype=torch.bool, device=self.cur.device)
            self._mask[self._index] = True
        return self._mask


SPARSE_WORDS = 8
"""The word path is kept while at most 1 word in this many differs."""


def _inside(hot: torch.Tensor, words: tuple[torch.Tensor, torch.Tensor], cur: torch.Tensor) -> torch.Tensor:
    """Flat element indices of the differing elements inside the differing words `hot`."""
    per = 8 // cur.element_size()
    if per == 1:
        return hot
    flips = (words[0].index_select(0, hot) ^ words[1].index_select(0, hot)).view(as_bits(cur).dtype)  # 0 where equal
    inside = torch.nonzero(flips).reshape(-1)
    return hot[inside // per] * per + inside % per


def _words(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor's bytes as int64 words, when it is contiguous, 8-byte aligned and whole words."""
    if not t.is_contiguous() or t.element_size() > 8 or t.data_ptr() % 8 or (t.numel() * t.element_size()) % 8:
        return None
    return as_bits(t).reshape(-1).view(torch.int64)


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """One bit per element, little-endian within each byte; trailing bits zero."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = (-mask.numel()) % 8
    bits = torch.nn.functional.pad(mask.to(torch.uint8), (0, pad)).view(-1, 8)
    weights = (1 << torch.arange(8, device=mask.device, dtype=torch.int32)).to(torch.uint8)
    return (bits * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The bits of `packed` (`pack_bits`), padded to whole bytes, as uint8 0 / 1."""
    if packed.device.type == "cpu":
        return torch.from_numpy(np.unpackbits(packed.numpy(), bitorder="little"))[: ((n + 7) // 8) * 8]
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed[:, None] >> shifts) & 1).reshape(-1)[: ((n + 7) // 8) * 8]


def _up(n: int) -> int:
    return -(-n // 16) * 16


def encode(code: int, changes: Changes, out: torch.Tensor) -> torch.Tensor | None:
    """Write the box `changes` was found in, encoded as `code`, into byte buffer `out`;
    returns the changed values (None for dense)."""
    cur = changes.cur
    flat = cur.reshape(-1)
    size, k = cur.element_size(), changes.count
    if code == DENSE:
        out[: size * flat.numel()].view(cur.dtype).copy_(flat)
        return None
    index = changes.index
    values = flat.index_select(0, index)
    if code == BITMAP:
        nbits = _up(-(-flat.numel() // 8))
        out[: -(-flat.numel() // 8)].copy_(pack_bits(changes.mask))
        out[nbits : nbits + size * k].view(cur.dtype).copy_(values)
    elif code == INDICES:
        out[: 4 * k].view(torch.int32).copy_(index)
        out[_up(4 * k) : _up(4 * k) + size * k].view(cur.dtype).copy_(values)
    else:
        blocks = -(-flat.numel() // BLOCK)
        counts, offsets = _up(4 * blocks), _up(4 * blocks) + _up(2 * k)
        out[: 4 * blocks].view(torch.int32).copy_(torch.bincount(index >> 16, minlength=blocks))
        out[counts : counts + 2 * k].view(torch.int16).copy_((index & 0xFFFF).to(torch.int32).to(torch.int16))
        out[offsets : offsets + size * k].view(cur.dtype).copy_(values)
    return values


def decode(code: int, k: int, n: int, dtype: torch.dtype, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, values, ok) of one transfer; `ok` is a 0-dim bool tensor (no host sync here).
    Dense transfers return no positions: `apply` copies them whole."""
    size = dtype.itemsize
    if block.numel() != encoded_nbytes(code, n, k, size):
        raise ValueError(f"payload of {block.numel()} bytes, header implies {encoded_nbytes(code, n, k, size)}")
    if code == DENSE:
        return torch.empty(0, dtype=torch.long, device=block.device), block[: size * n].view(dtype), \
            torch.ones((), dtype=torch.bool, device=block.device)
    if code == INDICES:
        index = block[: 4 * k].view(torch.int32).long()
        values = block[_up(4 * k) : _up(4 * k) + size * k].view(dtype)
        ok = ((index >= 0) & (index < n)).all() & (index[1:] > index[:-1]).all()
        return index, values, ok
    if code == BLOCKED:
        return _decode_blocked(k, n, dtype, size, block)
    nbits = -(-n // 8)
    bits = unpack_bits(block[:nbits], n)
    index = torch.nonzero(bits[:n]).reshape(-1)
    ok = (bits[n:] == 0).all() & (index.numel() == k)
    values = block[_up(nbits) : _up(nbits) + size * k].view(dtype)
    return index, values, ok


def _decode_blocked(k: int, n: int, dtype: torch.dtype, size: int, block: torch.Tensor):
    blocks = -(-n // BLOCK)
    start_off, start_val = _up(4 * blocks), _up(4 * blocks) + _up(2 * k)
    counts = block[: 4 * blocks].view(torch.int32).long()
    offsets = block[start_off : start_off + 2 * k].view(torch.int16).long() & 0xFFFF
    ends = torch.cumsum(counts.clamp(min=0), 0)
    owner = torch.searchsorted(ends, torch.arange(k, device=block.device), right=True).clamp(max=blocks - 1)
    index = owner * BLOCK + offsets
    ok = (counts >= 0).all() & (counts.sum() == k) & (index < n).all() & (index[1:] > index[:-1]).all()
    return index, block[start_val : start_val + size * k].view(dtype), ok


def apply(code: int, view: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """Write decoded values into a (possibly strided) live box view, in place."""
    if code == DENSE:
        view.copy_(values.view(view.shape))
        return
    if not index.numel():
        return
    if view.is_contiguous():
        view.view(-1)[index] = values
        return
    offsets = torch.zeros_like(index)
    rest = index
    for size, stride in zip(reversed(view.shape), reversed(view.stride())):
        offsets += (rest % size) * stride
        rest = rest // size
    span = 1 + sum((s - 1) * st for s, st in zip(view.shape, view.stride()))
    flat = view.as_strided((span,), (1,))
    flat[offsets] = values.to(view.dtype)
