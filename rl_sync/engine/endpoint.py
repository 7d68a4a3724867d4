"""Local storage seen through global coordinates: views, packing and unpacking.

An `Endpoint` is a tensor (a local shard, a live parameter, a fused slot of
one) together with the global offsets of its first element, so any global box
inside it becomes a strided view with `Endpoint.view(offsets, sizes)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..planning.schedule import Segment


@dataclass(frozen=True)
class Endpoint:
    """`tensor[i0, i1, ...]` holds global element `(origin[0] + i0, origin[1] + i1, ...)`."""

    tensor: torch.Tensor
    origin: tuple[int, ...]

    def view(self, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The strided view of global box (`offsets`, `sizes`)."""
        index = tuple(slice(o - base, o - base + s) for o, s, base in zip(offsets, sizes, self.origin))
        return self.tensor[index]


def as_bytes(view: torch.Tensor) -> torch.Tensor | None:
    """A flat uint8 alias of a contiguous view, or `None` when it is strided."""
    if not view.is_contiguous():
        return None
    flat = view.reshape(-1)
    if flat.numel() == 1:  # contiguous whatever its stride: make it 1 so the bytes can be viewed
        flat = flat.as_strided((1,), (1,))
    return flat.view(torch.uint8)


def region(buf: torch.Tensor, seg: Segment, dtype: torch.dtype) -> torch.Tensor:
    """Segment `seg`'s bytes in packed buffer `buf`, typed and shaped as its box."""
    return buf[seg.start : seg.start + seg.nbytes].view(dtype).view(seg.sizes)
