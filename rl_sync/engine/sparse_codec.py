"""Sparse deltas on tensors: find changed elements, encode, validate, apply.

Changes are found bit-exactly (elements compared as integers of their width,
so NaN payloads and -0.0 count). Indices are flat, row-major, local to the
transfer's box. Decoding validates everything (ranges, order, bit counts,
sizes) and only then writes, so malformed input never reaches live storage
and never triggers a device-side assert.

A sparse round uses the bucket-level `BucketChanges` (sender) and
`BucketReceiver` (receiver): CUDA boxes go through the fused Triton kernels
(`sparse_triton`, driven by `sparse_fused`), every box of a bucket in the same
launches; the rest through the per-box torch functions below (`Changes`,
`encode`, `decode`, `apply`).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..sparse.encodings import (
    ALIGN,
    BITMAP,
    BLOCK,
    BLOCKED,
    DENSE,
    INDICES,
    MessageLayout,
    PayloadLayout,
    check_count,
    payload_layout,
)
from .sparse_table import BITS_TORCH, check_elements, flags_layout

if TYPE_CHECKING:
    from .sparse_fused import KeptGeometry
    from .sparse_receiver import FusedReceiver, KeptDestinations, Tables


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements reinterpreted as same-width integers (bit patterns)."""
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t if t.dtype == BITS_TORCH[t.element_size()] else t.view(BITS_TORCH[t.element_size()])


def changed(cur: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """Flat bool mask of elements whose bits differ (row-major over the box).

    Elements wider than 8 bytes (complex128) are all marked changed: they travel dense."""
    if cur.element_size() not in BITS_TORCH:
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
        cur_words, base_words = _words(self.cur), _words(self.base)
        if cur_words is not None and base_words is not None:
            differ = cur_words != base_words
            if int(torch.count_nonzero(differ)) * SPARSE_WORDS <= differ.numel():
                self._index = _inside(torch.nonzero(differ).reshape(-1), (cur_words, base_words), cur)
        if self._index is None:
            self._mask = changed(self.cur, self.base)
            self.count = int(torch.count_nonzero(self._mask))  # the one host sync of a sparse encode on a GPU
        else:
            self.count = self._index.numel()

    @property
    def index(self) -> torch.Tensor:
        if self._index is None:
            assert self._mask is not None  # __init__ sets one of the two
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
    at = payload_layout(code, flat.numel(), k, size)
    if code == BITMAP:
        out[: at.head].copy_(pack_bits(changes.mask))
    elif code == INDICES:
        out[: 4 * k].view(torch.int32).copy_(index)
    else:
        out[: at.head].view(torch.int32).copy_(torch.bincount(index >> 16, minlength=at.head // 4))
        offsets = (index & 0xFFFF).to(torch.int32).to(torch.int16)
        out[at.positions : at.positions + 2 * k].view(torch.int16).copy_(offsets)
    out[at.values : at.values + size * k].view(cur.dtype).copy_(values)
    return values


def decode(
    code: int, k: int, n: int, dtype: torch.dtype, block: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions, values, ok) of one transfer; `ok` is a 0-dim bool tensor (no host sync here).
    Dense transfers return no positions: `apply` copies them whole."""
    at = _checked_layout(code, k, n, dtype, block)
    if code == DENSE:
        return (
            torch.empty(0, dtype=torch.long, device=block.device),
            block[: dtype.itemsize * n].view(dtype),
            torch.ones((), dtype=torch.bool, device=block.device),
        )
    values = block[at.values : at.values + dtype.itemsize * k].view(dtype)
    if code == INDICES:
        index = block[: 4 * k].view(torch.int32).long()
        ok = ((index >= 0) & (index < n)).all() & (index[1:] > index[:-1]).all()
        return index, values, ok
    if code == BLOCKED:
        index, ok = _decode_blocked(k, n, at, block)
        return index, values, ok
    bits = unpack_bits(block[: at.head], n)
    index = torch.nonzero(bits[:n]).reshape(-1)
    ok = (bits[n:] == 0).all() & (index.numel() == k)
    return index, values, ok


def _checked_layout(code: int, k: int, n: int, dtype: torch.dtype, block: torch.Tensor) -> PayloadLayout:
    """The payload's layout, once its size is what the header implies and it starts aligned."""
    at = payload_layout(code, n, k, dtype.itemsize)
    if block.numel() != at.nbytes:
        raise ValueError(f"payload of {block.numel()} bytes, header implies {at.nbytes}")
    _check_aligned(block)
    return at


def _check_aligned(block: torch.Tensor) -> None:
    if block.data_ptr() % ALIGN:
        raise ValueError(
            f"payload buffer at address {block.data_ptr():#x} is not {ALIGN}-byte aligned; every encoded "
            f"transfer starts {ALIGN}-byte aligned (`rl_sync.sparse.encodings`)"
        )


def _decode_blocked(k: int, n: int, at: PayloadLayout, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions, ok) of a blocked payload."""
    blocks = at.head // 4
    counts = block[: at.head].view(torch.int32).long()
    offsets = block[at.positions : at.positions + 2 * k].view(torch.int16).long() & 0xFFFF
    counted = (counts >= 0).all() & (counts.sum() == k)
    if block.device.type == "cpu":  # reading the counts costs nothing here: expand them instead of searching
        if not bool(counted):
            return torch.zeros(k, dtype=torch.long), counted
        owner = torch.repeat_interleave(torch.arange(blocks), counts)
    else:
        ends = torch.cumsum(counts.clamp(min=0), 0)
        owner = torch.searchsorted(ends, torch.arange(k, device=block.device), right=True).clamp(max=blocks - 1)
    index = owner * BLOCK + offsets
    return index, counted & (index < n).all() & (index[1:] > index[:-1]).all()


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


Box = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(tensor, offsets, sizes): where a sent box sits in its tensor."""


@functools.cache
def _fused():
    """`sparse_fused`, imported on first use (it needs Triton, which a CPU-only install may lack);
    cached, as every box of a round asks."""
    from . import sparse_fused

    return sparse_fused


@functools.cache
def _receiver():
    """`sparse_receiver`, imported on first use, as `_fused`."""
    from . import sparse_receiver

    return sparse_receiver


_SPARE_FLAGS: OrderedDict[tuple[torch.device, int], list[torch.Tensor]] = OrderedDict()
_SPARE_KINDS = 64
"""Bucket sizes (device, boxes) whose spare flag buffers are kept (a few hundred bytes each)."""
_SPARE_EACH = 2
"""Spare buffers kept of each kind: a round's receivers of one size come one after another."""


def _zeroed_flags(device: torch.device, boxes: int) -> torch.Tensor:
    """`flags_layout(boxes)` int32 zeros on `device`: a spare buffer a clean receiver gave back
    (`_give_back_flags`), or a new one. A round takes one a bucket; a spare saves an allocation and
    a fill launch on the receiver's critical path."""
    if device.type == "cuda" and device.index is None:  # (as the buffer is kept: by the device it is on)
        device = torch.device("cuda", torch.cuda.current_device())
    spare = _SPARE_FLAGS.get((device, boxes))
    if spare is not None:
        try:
            return spare.pop()  # (not `if spare:` first: another thread may take the last one between)
        except IndexError:
            pass
    return torch.zeros(flags_layout(boxes)[1], dtype=torch.int32, device=device)


def _give_back_flags(boxes: int, flags: torch.Tensor) -> None:
    """Keep `flags` for the next receiver of `boxes` boxes on their device: only once every value
    is zero again and nothing queued still uses it (a commit that found no malformed box raised no
    flag nor the guard, the CUDA `starts` resets each counter it counted, and the commit's host
    read of the flags waited for every launch behind them)."""
    kind = (flags.device, boxes)
    spare = _SPARE_FLAGS.setdefault(kind, [])
    _SPARE_FLAGS.move_to_end(kind)
    if len(spare) < _SPARE_EACH:
        spare.append(flags)
    if len(_SPARE_FLAGS) > _SPARE_KINDS:
        _SPARE_FLAGS.popitem(last=False)


def _on_kernel_device(t: torch.Tensor) -> bool:
    return t.is_cuda  # (not `t.device.type`: building the device object costs 10x more, per box)


def _overlap(a: Box, b: Box) -> bool:
    return a[0] == b[0] and all(p < q + m and q < p + n for p, n, q, m in zip(a[1], a[2], b[1], b[2]))


def overlapping(boxes: Sequence[Box]) -> tuple[bool, ...]:
    """Whether each box overlaps another of `boxes` (only boxes of one tensor are compared); kept
    for the buckets a round sends again every step."""
    return _overlapping(tuple(boxes))


@functools.lru_cache(maxsize=1024)
def _overlapping(boxes: tuple[Box, ...]) -> tuple[bool, ...]:
    by_tensor: dict[int, list[int]] = {}
    for i, box in enumerate(boxes):
        by_tensor.setdefault(box[0], []).append(i)
    shared = [False] * len(boxes)
    for group in by_tensor.values():
        for x, i in enumerate(group):
            for j in group[x + 1 :]:
                if _overlap(boxes[i], boxes[j]):
                    shared[i] = shared[j] = True
    return tuple(shared)


class BucketChanges:
    """The changes of every box one rank sends in a bucket, found together.

    Usage: `found = BucketChanges(pairs, boxes)`; `found.counts[i]` (changed elements of box i);
    `found.encode(i, code, out)` for each box; then `found.finish()` once: the encodings are
    complete, and each baseline equals what was sent (or `complete()`, send, then `advance()`).

    CUDA boxes take the fused Triton path (`sparse_fused.FusedSender`), every box of the bucket
    in the same launches: one diff pass (bitmap words and tile counts), the bucket's counts
    back to the host in one transfer; at `complete`, one compact pass that reads only the
    bitmap and the changed elements, writes every payload and updates the baselines of boxes
    no other box overlaps; at `advance`, one pass updating the overlapping ones (a box sent to
    several replicas is diffed against the same baseline each time). Where the CUDA kernels take
    a box (`sparse_cuda`), its diff itself advances the baseline of a box no other box overlaps,
    at construction, and leaves the values of sparse runs for `complete` to copy: from then on
    the baseline holds this round's values whatever is encoded (a round that fails later makes
    the group send in full, `sparse.refresh`). Other boxes use `Changes` (one host sync each on a
    GPU) and `encode`.

    Given `allow_dense`, a bucket whose boxes all take the CUDA kernels in one launch is encoded
    on the device right behind its `diff`, each box as `choose(n, k, itemsize, allow_dense)`
    picks, into one buffer (`sparse_fused.FusedSender`): `placed` (`sparse_fused.Placed`) then
    holds every payload, its `codes` and `offsets`, and `encode` is not called. Otherwise, or when
    the payloads do not fit the buffer kept for them (`sparse_fused._Geometry.capacity`), `placed`
    is None and the caller encodes each box."""

    def __init__(
        self,
        pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
        boxes: Sequence[Box],
        payloads: torch.device | None = None,
        allow_dense: bool | None = None,
        kept: KeptTables | None = None,
    ):
        """`payloads`: the device the payload buffers will be on, when known (the fused path writes
        them from the GPU, so CUDA boxes whose payloads go to the host take the torch path);
        `allow_dense`: whether dense may be picked, for a bucket encoded on the device (None: the
        caller picks each encoding); `kept`: the bucket's `KeptTables`, where the caller keeps one
        (its geometry is then found by the pairs' tensor objects)."""
        self.pairs = list(pairs)
        fusable = payloads is None or payloads.type == "cuda"  # (the fused kernels write payloads on the GPU)
        candidates = [i for i, (cur, _) in enumerate(self.pairs) if _on_kernel_device(cur)] if fusable else []
        geometry = _fused().geometry(self.pairs, candidates, overlapping(boxes), kept) if candidates else None
        fused = _fused().FusedSender(self.pairs, geometry, allow_dense) if geometry and geometry.boxes else None
        self._fused = fused
        self._changes = [None if fused and i in fused.geometry.boxes else Changes(*p) for i, p in enumerate(self.pairs)]
        self._values: list[torch.Tensor | None] = [None] * len(self.pairs)
        self.placed = fused.placed if fused else None
        self._codes = list(self.placed.codes) if self.placed else [DENSE] * len(self.pairs)
        fused_counts = fused.counts if fused else [0] * len(self.pairs)
        self.counts = [c.count if c is not None else fused_counts[i] for i, c in enumerate(self._changes)]

    def encode(self, i: int, code: int, out: torch.Tensor) -> None:
        """Encode box `i` as `code` into the byte buffer `out` (`encoded_nbytes` long); complete
        once `complete` has run. Not for a bucket encoded on the device (`placed`)."""
        _check_aligned(out)
        self._codes[i], changes = code, self._changes[i]
        if changes is not None:
            self._values[i] = encode(code, changes, out)
        elif self._fused:
            self._fused.encode(i, code, out)

    def finish(self) -> None:
        """Complete every encoding and make every box's baseline what was sent."""
        self.complete()
        self.advance()

    def complete(self) -> None:
        """Complete every encoding (on CUDA, with the baselines of boxes no other box overlaps)."""
        if self._fused:
            self._fused.complete()

    def advance(self) -> None:
        """After `complete`: every other box's baseline becomes what was sent (a round runs it once
        the payloads are on their way, off the receivers' critical path)."""
        for i, ((cur, base), changes) in enumerate(zip(self.pairs, self._changes)):
            if changes is not None:
                _advance(base, cur, self._codes[i], changes, self._values[i])
        if self._fused:
            self._fused.advance(self._codes)


def _advance(base: torch.Tensor, cur: torch.Tensor, code: int, changes: Changes, values: torch.Tensor | None) -> None:
    """Bitmap and dense boxes copy whole; indexed ones write their changed elements."""
    if code in (DENSE, BITMAP):
        base.copy_(cur, non_blocking=True)
    elif changes.count:
        assert values is not None  # `encode` returns the values of every sparse code
        apply(INDICES, base, changes.index.to(base.device), values.to(base.device))


class KeptTables:
    """What the sender and receivers of one bucket keep from round to round (`BucketChanges(...,
    kept=)`, `BucketReceiver(..., kept=)`; a sparse round keeps one with the bucket's views,
    `sparse_round.BucketViews`): the sender's fused geometry (`sparse_fused.geometry`) with (weak
    references to) the tensor objects it was found for; each received message's destinations as
    the fused kernels address them, by first slot, while the same view objects come there; and
    the tables of the last few header shapes (each box's encoding and density class) of the
    bucket (`sparse_receiver.FusedReceiver`). Tensors are found again by identity: one whose shape is
    changed in place (`set_`, `resize_`, `as_strided_`), or whose storage moves (its own or its
    base's storage resized), must not come back under the same `KeptTables` (a rank's session
    builds new views, with a new one, when a weight moves). One round at a time."""

    def __init__(self) -> None:
        self.geometry: KeptGeometry | None = None
        self.destinations: dict[int, KeptDestinations] = {}
        self.tables: OrderedDict[tuple, Tables] = OrderedDict()


class BucketReceiver:
    """Every box one rank receives in a bucket: validated together, then written together.

    Usage: `received = BucketReceiver(device, boxes)` (or `kept=` the bucket's `KeptTables`, to
    reuse what its earlier rounds worked out); `received.add_message(first, layout, dtypes,
    payload, views)` for each message (or `received.add(slot, code, k, n, dtype, block, view)` for
    each box), which reads the headers and where the payload lies but not its bytes;
    optionally `received.prepare()`; then, once every payload is in its block, `bad =
    received.commit()`: the slots whose payload is malformed; when it is empty every box was
    written, otherwise none was. A round adds its boxes and prepares while the payloads are on
    their way, so that only the kernels wait for them.

    Bitmap and blocked payloads bound for a CUDA view of the wire dtype are validated by the
    fused kernels (`sparse_receiver.FusedReceiver`), every such box of the bucket in the same
    launches, and written likewise; the rest `decode` and `apply` at `commit`. A malformed box
    raises its flag and the bucket's guard (the last flag) on the device, and the fused writes,
    queued right behind the checks, write nothing while the guard is raised; so `commit` reads
    the flags once (the bucket's one host sync) after the fused writes, and only the torch
    path's writes wait for it. A commit that finds no malformed box leaves the flags all zero and
    gives them to the next receiver of as many boxes on the device (`_zeroed_flags`): no zeroing
    is queued before its checks."""

    def __init__(self, device: torch.device, boxes: int, kept: KeptTables | None = None):
        """`kept`: what the bucket's receivers of earlier rounds worked out (`KeptTables`), where
        the caller keeps it."""
        self.device, self._boxes, self._kept = device, boxes, kept
        self.flags = _zeroed_flags(device, boxes)
        self._committed: list[int] | None = None  # (what `commit` found, once it has run)
        self._decodes: list[tuple] = []  # the torch path's boxes: `add`'s arguments, decoded at `commit`
        self._added = bytearray(boxes)  # the slots added so far
        self._fused: FusedReceiver | None = None

    def add(
        self, slot: int, code: int, k: int, n: int, dtype: torch.dtype, block: torch.Tensor, view: torch.Tensor
    ) -> None:
        """Box `slot`: `k` of its `n` elements of `dtype` changed, encoded as `code` in `block`, to be
        written into `view` (`add_message` of one box)."""
        check_count(code, k, n, f"box slot {slot}")
        at = payload_layout(code, n, k, dtype.itemsize)
        layout = MessageLayout([(code, k, n, at, 0)], at.nbytes, [dtype.itemsize])
        self.add_message(slot, layout, [dtype], block, [view])

    def add_message(
        self,
        first: int,
        layout: MessageLayout,
        dtypes: Sequence[torch.dtype],
        payload: torch.Tensor,
        views: Sequence[torch.Tensor],
    ) -> None:
        """The boxes of one message, in slots `first`, `first + 1`, ...: box i of `layout`
        (`encodings.message_layout`) of `dtypes[i]`, its payload at its start in `payload`, to be
        written into `views[i]`. Reads where `payload` lies, not its bytes. Refuses, adding nothing,
        dtypes of other element sizes than the layout's, slots outside the bucket or added before,
        a payload not of the layout's size or not 16-byte aligned, a view of other elements than
        its box's, and a box for the fused path once the tables are prepared."""
        count = len(layout.boxes)
        if len(dtypes) != count or len(views) != count:
            raise ValueError(
                f"{count} boxes in the layout, {len(dtypes)} dtypes and {len(views)} views; expected one of each a box"
            )
        sizes = [dtype.itemsize for dtype in dtypes]
        if sizes != layout.itemsizes:  # (the parts' sizes, so the kernels' reads, follow from them)
            raise ValueError(f"the layout was made for element sizes {layout.itemsizes}; the dtypes have {sizes}")
        if first < 0 or first + count > self._boxes:
            slot = first if first < 0 else first + count - 1
            raise IndexError(f"box slot {slot} is outside this bucket's {self._boxes} boxes")
        twice = self._added.find(1, first, first + count)
        if twice >= 0:  # (the fused checks keep a counter a box: a box added twice would overrun them)
            raise ValueError(f"box slot {twice} was added twice to this bucket's receiver")
        if payload.numel() != layout.nbytes:
            raise ValueError(f"payload of {payload.numel()} bytes, header implies {layout.nbytes}")
        _check_aligned(payload)
        others: Sequence[int] = range(count)
        if _on_kernel_device(payload):
            if self._fused is None:
                self._fused = _receiver().FusedReceiver(self.device, self.flags, self._boxes, self._kept)
            others = self._fused.add_message(first, layout.boxes, dtypes, payload, views)
        else:
            check_elements(first, layout.boxes, views)
        self._added[first : first + count] = b"\x01" * count
        for i in others:
            code, k, n, at, start = layout.boxes[i]
            self._decodes.append((first + i, code, k, n, dtypes[i], payload[start : start + at.nbytes], views[i]))

    def prepare(self) -> None:
        """Queue what needs only the headers: the fused boxes' tables go to the device, so that
        `commit` only launches kernels (it prepares first when this has not run)."""
        if self._fused is not None:
            self._fused.prepare()

    def commit(self) -> list[int]:
        """Validate every box and write them all unless one is malformed; the malformed slots. Once:
        a later call returns the first one's answer and does nothing (a clean commit has given its
        flags to the next receiver)."""
        if self._committed is not None:
            return list(self._committed)
        writes = [self._decode(*box) for box in self._decodes]
        if self._fused is not None and self._fused.boxes:
            if writes:  # boxes on the torch path too: their flags raise the guard as well
                boxes = self._boxes
                torch.amax(self.flags[:boxes], dim=0, keepdim=True, out=self.flags[boxes : boxes + 1])
            self._fused.validate()
            self._fused.write()
        bad = [slot for slot, flag in enumerate(self.flags[: self._boxes].tolist()) if flag]  # the one sync
        self._committed = bad
        if not bad:
            for write in writes:
                write()
            _give_back_flags(self._boxes, self.flags)
        return list(bad)

    def _decode(
        self, slot: int, code: int, k: int, n: int, dtype: torch.dtype, block: torch.Tensor, view: torch.Tensor
    ) -> Callable[[], None]:
        """Box `slot` on the torch path decoded, its flag set; its write, to run once no box is
        malformed."""
        index, values, ok = decode(code, k, n, dtype, block)
        self.flags[slot] = (~ok).to(torch.int32)
        return lambda: apply(code, view, index, values)
