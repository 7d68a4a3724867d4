"""One-launch copy of many small contiguous regions on a CUDA device.

Thousands of small parameters (tens of thousands in MoE models) would cost a
launch each, or run a batched elementwise kernel far below bandwidth. This
copies them all with one Triton launch: every region is cut into 32 KiB
blocks, and each program moves one block with 8-byte loads. The block table is
built once per compiled round and reused.

Typical use::

    copier = BatchedCopy.build(dsts, srcs)   # contiguous byte views on one device; None if unusable
    copier.run()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

WORDS_PER_BLOCK = 4096


def _triton():
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    return triton, tl


_KERNEL = None


def _kernel():
    global _KERNEL
    if _KERNEL is None:
        triton, tl = _triton()

        @triton.jit
        def copy_blocks(src_tab, dst_tab, words_tab, block_region, block_start, BLOCK: tl.constexpr):  # type: ignore[name-defined]  # Triton's marker, not a type
            pid = tl.program_id(0)
            region = tl.load(block_region + pid)
            start = tl.load(block_start + pid)
            words = tl.load(words_tab + region)
            src = tl.load(src_tab + region).to(tl.pointer_type(tl.int64))
            dst = tl.load(dst_tab + region).to(tl.pointer_type(tl.int64))
            index = start + tl.arange(0, BLOCK)
            mask = index < words
            tl.store(dst + index, tl.load(src + index, mask=mask), mask=mask)

        _KERNEL = copy_blocks
    return _KERNEL


class BatchedCopy:
    """A fixed list of (dst, src) contiguous byte regions, copied in one launch."""

    def __init__(self, tables: tuple[torch.Tensor, ...], blocks: int, keep: list[torch.Tensor]):
        self.tables, self.blocks, self._keep = tables, blocks, keep

    @classmethod
    def build(cls, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> BatchedCopy | None:
        """`None` unless every region is 8-byte aligned and sized, all on one CUDA device, and Triton imports."""
        if not dsts or _triton() is None:
            return None
        device = dsts[0].device
        if device.type != "cuda" or any(t.device != device for t in list(dsts) + list(srcs)):
            return None
        if any(d.numel() % 8 or d.data_ptr() % 8 or s.data_ptr() % 8 for d, s in zip(dsts, srcs)):
            return None
        words = [d.numel() // 8 for d in dsts]
        counts = [-(-w // WORDS_PER_BLOCK) for w in words]
        region = torch.repeat_interleave(torch.arange(len(words)), torch.tensor(counts))
        start = torch.cat([torch.arange(c) * WORDS_PER_BLOCK for c in counts])
        cpu = (
            torch.tensor([s.data_ptr() for s in srcs], dtype=torch.int64),
            torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64),
            torch.tensor(words, dtype=torch.int64),
            region.to(torch.int32),
            start.to(torch.int64),
        )
        tables = tuple(t.to(device) for t in cpu)
        return cls(tables, int(region.numel()), list(dsts) + list(srcs))

    def run(self) -> None:
        if self.blocks:
            _kernel()[(self.blocks,)](*self.tables, BLOCK=WORDS_PER_BLOCK)
