"""The fused sparse codec's host side: box tables for the Triton kernels (`sparse_triton`) and the
CUDA ones that replace them where CuPy is installed (`sparse_cuda`: `diff`, `compact`, the busy
`expand`, the receiver's checks and its blocked rows), one upload per step, or none where every
launch of the step is a CUDA one whose rows fit in its parameters (`sparse_cuda.fits_inline`; the
sender's `compact` takes up to `FLUSHES` + 1 steps, each launched while the host encodes the next
boxes), and a bucket's counts read back in one transfer.

`FusedSender` finds and encodes the CUDA boxes one rank sends in a bucket, `FusedReceiver`
validates and writes the CUDA boxes it receives; `sparse_codec.BucketChanges` and
`sparse_codec.BucketReceiver` drive them beside the torch path. Everything here is host
arithmetic on addresses and sizes: no tensor is sliced per box, and a sender's geometry (its
boxes' addresses, tile slots, the uploaded `diff` table, its counts and their read-back, and the
CUDA `diff` launch bound to them) is built once and reused while a bucket's tensors stay where
they are.
"""

from __future__ import annotations

import functools
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..sparse.encodings import ALIGN, BITMAP, BLOCK, BLOCKED, DENSE, encoded_nbytes, payload_layout
from . import sparse_cuda, sparse_launch
from .sparse_launch import Prepared, Row
from .sparse_table import (
    INDEX_KIND,
    SEND_COLUMNS,
    TILE,
    WORDS,
    Key,
    Refs,
    Strided2D,
    Upload,
    as_2d,
    density,
    element_offset,
    refer,
    refers_to,
    tiles,
)


@dataclass(frozen=True)
class _Box:
    """One sender box: where it is in the bucket, its source and baseline, its size, its first
    tile slot (whole wire blocks per box, so padding tiles count 0), whether another box of
    the bucket overlaps it (then its baseline advances only after every box was diffed), and
    where the CUDA `diff` stages its values (bytes from the round's words; -1: the box takes the
    Triton kernels)."""

    index: int
    cur: Strided2D
    base: Strided2D
    n: int
    width: int
    slot: int
    shared: bool
    stage: int = -1

    @property
    def on_cuda(self) -> bool:
        """It takes the CUDA `diff` and `compact`, which stage its values."""
        return self.stage >= 0

    @property
    def diff_advances(self) -> bool:
        """Its `diff` advances its baseline: the CUDA one, where no other box reads the baseline."""
        return self.on_cuda and not self.shared

    @functools.cached_property
    def encode_advances(self) -> bool:
        """Its encoding advances its baseline (`compact`, or a dense copy): where no other box reads
        the baseline and `diff` did not (kept: `encode` asks for every box, every round)."""
        return not self.shared and not self.on_cuda

    @functools.cached_property
    def key(self) -> Key:
        return self.width, self.cur.fast and self.base.fast

    @functools.cached_property
    def tiles(self) -> int:
        return tiles(self.n)

    def row(
        self, values: int = 0, index: int = 0, kind: int = -1, update: bool = False, bitmap: int = 0, blocks: int = 0
    ) -> list[int]:
        """Its `sparse_table.SEND_*` row (`kind` -1: no values written)."""
        return [*self._head, values, index, kind, int(update), bitmap, blocks, self.index, self.stage]

    @functools.cached_property
    def _head(self) -> tuple[int, ...]:
        return *self.cur.columns, *self.base.columns, self.n, self.slot


class _Scratch:
    """A sender's counts for one round of a bucket: `tiles`, each tile slot's changes, then `totals`,
    each box's (both in `counts`, 8 bytes a 16,384-element tile: zero when made, and zeroed again
    by the sender that gives it back, behind its last launch, so that no zeroing is queued before
    the next round's `diff`), and where the totals are read back (pinned host memory, and the event
    of the copy). Kept with the bucket's geometry and lent to one sender at a time, on the stream it
    was made for: stream order queues a round's kernels behind the last round's. (The bitmap words,
    256 times more, a sixteenth of the bf16 bytes, and the CUDA `diff`'s stage behind them, an
    eighth, are allocated each round: kept buckets would hold them while the trainer needs the
    memory.)"""

    def __init__(self, slots: int, boxes: int, device: torch.device, stream: int):
        self.counts = torch.zeros(slots + boxes, dtype=torch.int64, device=device)
        self.tiles, self.totals = self.counts[:slots], self.counts[slots:]
        cuda = device.type == "cuda"
        self._host = torch.empty(boxes, dtype=torch.int64, pin_memory=True) if cuda else None
        self._copied = torch.cuda.Event() if cuda else None
        self._on = torch.cuda.current_stream(device) if cuda else None  # (the stream `stream` names)
        self.stream, self.lent = stream, False
        self.diffs: list[Callable[[torch.Tensor], None]] = []
        """The bucket's `diff` launches on these counts, each taking the round's words (`_Geometry.lend`)."""
        self._plan: _Plan | None = None

    def plan(self, boxes: int) -> _Plan:
        """Where `place` leaves the rounds' rows and placements (made on first use)."""
        if self._plan is None:
            self._plan = _Plan(boxes, self.counts.device, self._on)
        return self._plan

    def read_back(self) -> Callable[[], list[int]]:
        """`totals`, copied to the host as soon as the work queued so far is done: the returned
        function waits for that copy alone, not for what is queued after it (on a GPU; on a CPU
        they are read at once)."""
        if self._host is None or self._copied is None:
            return self.totals.tolist
        return _read_later(self.totals, self._host, self._copied, self._on)


def _read_later(
    values: torch.Tensor, host: torch.Tensor, copied: torch.cuda.Event, stream: torch.cuda.Stream | None
) -> Callable[[], list[int]]:
    """`values` (on a GPU) copied into pinned `host` once the work queued on `stream` so far is done:
    the returned function waits for that copy alone (`copied` records it), not for what is queued
    after it."""
    host.copy_(values, non_blocking=True)
    copied.record(stream)

    def read() -> list[int]:
        copied.synchronize()
        return host.tolist()

    return read


class _Plan:
    """What `sparse_cuda.place` writes for a bucket of `boxes` boxes, kept with its scratch: the rows
    `compact` reads, each density class's program starts, and the placement (`placed`), with its
    copy in pinned host memory and the event of that copy."""

    def __init__(self, boxes: int, device: torch.device, stream: torch.cuda.Stream | None):
        rows, values = boxes * SEND_COLUMNS, sparse_cuda.placed_values(boxes)
        memory = torch.empty(rows + 3 * (boxes + 1) + values, dtype=torch.int64, device=device)
        self.rows, self.starts = memory[:rows], memory[rows : rows + 3 * (boxes + 1)]
        self.firsts = [self.starts[d * (boxes + 1) : (d + 1) * (boxes + 1)] for d in range(3)]
        self.placed = memory[rows + 3 * (boxes + 1) :]
        self._host = torch.empty(values, dtype=torch.int64, pin_memory=True)
        self._copied, self._on = torch.cuda.Event(), stream

    def read_back(self) -> Callable[[], list[int]]:
        """`placed`, copied to the host once `place` is done (`_read_later`)."""
        return _read_later(self.placed, self._host, self._copied, self._on)


@dataclass(frozen=True)
class Placed:
    """A bucket's payloads as `sparse_cuda.place` laid them out, one after another in `buffer`: box
    i encoded as `codes[i]` from byte `offsets[i]` on, `total` bytes in all, its wire header (code
    and count) at `headers[2 * i]` (both complete once every launch queued so far is done: read
    them on the stream they were queued on, or behind it)."""

    buffer: torch.Tensor
    codes: list[int]
    offsets: list[int]
    total: int
    headers: torch.Tensor

    def header(self, first: int, stop: int) -> torch.Tensor:
        """The wire headers of boxes `first` up to `stop` (int64, 2 a box), as a message sends them."""
        return self.headers[2 * first : 2 * stop]

    def span(self, first: int, stop: int) -> torch.Tensor:
        """The payloads of boxes `first` up to `stop`, one after another (as a message carries them)."""
        start, end = (self.offsets[at] if at < len(self.offsets) else self.total for at in (first, stop))
        return self.buffer[start:end]


def _stream(device: int) -> int:
    """torch's current stream on the device numbered `device` (`Tensor.get_device`; 0 on a CPU)."""
    return torch._C._cuda_getCurrentRawStream(device) if device >= 0 else 0


@dataclass
class _Geometry:
    """A bucket's sender boxes and their `diff` launches, on the device, and its kept scratch."""

    boxes: dict[int, _Box]
    slots: int
    tiles: int
    """The boxes' tiles, in all."""
    diff: list[sparse_launch.Launch]
    table: torch.Tensor
    cuda: bool
    """Its launches may take the CUDA kernels (`sparse_cuda.usable` when it was built): the two
    `diff`s cut a tile into different parts, so `diff` must take the one it was built for."""
    pairs: int
    """Boxes of the bucket, fused or not (`counts` has a total for each)."""
    stage: int
    """Bytes of its boxes' stages, after the words (`_Box.stage`)."""
    rows: torch.Tensor | None = None
    """The `diff` rows, where `sparse_cuda.place` may lay the payloads out (`_placeable`)."""
    dense_bytes: int = 0
    """Bytes of every box sent dense (each rounded up to `ALIGN`)."""
    placed_bytes: int | None = None
    """Bytes of the last placed round's payloads, fitting or not (None: no round placed yet)."""
    likely: int | None = None
    """The density class with the most `compact` programs in the last placed round: the next
    round's launch of that class is queued right behind `place`, the others once the host knows
    their programs."""
    _kept: _Scratch | None = None

    def capacity(self) -> int:
        """Bytes of a placed round's payload buffer: a quarter more than the last round's payloads
        (and an alignment a box), and at least a sixteenth of the dense bytes (a round after a quiet
        one: 1% of bf16 takes 2% blocked); before any round, a quarter of the dense bytes. Payloads
        that do not fit are encoded by the host (`FusedSender.encode`): a round whose payloads grow
        by more than a quarter, and the first of a bucket busier than about 19% (bitmap, bf16)."""
        last, dense = self.placed_bytes, self.dense_bytes
        return dense // 4 if last is None else max(last + last // 4 + ALIGN * len(self.boxes), dense // 16)

    def learn(self, total: int, programs: Sequence[int]) -> None:
        """A placed round's payload bytes and each density class's programs."""
        self.placed_bytes = total
        self.likely = max(range(3), key=programs.__getitem__) if any(programs) else None

    @functools.cached_property
    def launches(self) -> list[Prepared]:
        """The `diff` launches, ready to run (their rows sliced from `table` once, not every
        round)."""
        return sparse_launch.prepared("diff", self.diff, self.table, self.cuda)

    def lend(self, device: torch.device, number: int) -> _Scratch:
        """Scratch for one sender on `device` (numbered `number`), until it gives it back (`lent`
        False): the kept one when it is free and was made for the current stream, else a new one,
        kept in its place (one never given back, a round that raised, is so replaced once)."""
        stream, kept = _stream(number), self._kept
        if kept is None or kept.lent or kept.stream != stream:
            kept = self._kept = _Scratch(self.slots, self.pairs, device, stream)
            kept.diffs = [_bind(kernel, head, kept) for kernel, head, _ in self.launches]
        kept.lent = True
        return kept


_CUDA_DIFF = sparse_cuda.diff
"""The CUDA `diff` (not a stand-in put in its place), which a scratch's launches take bound."""


def _bind(kernel: Callable[..., None], head: tuple, scratch: _Scratch) -> Callable[[torch.Tensor], None]:
    """`diff(words)`: `kernel(*head, words, scratch.tiles, scratch.totals)`, to be queued every round;
    the CUDA `diff` bound once (`sparse_cuda.BoundDiff`), any other kernel called with them."""
    if kernel is _CUDA_DIFF:
        table, firsts, boxes, total, key = head
        return sparse_cuda.BoundDiff(table, firsts, boxes, total, key, scratch.tiles, scratch.totals)
    return lambda words: kernel(*head, words, scratch.tiles, scratch.totals)


_GEOMETRIES: OrderedDict[tuple, _Geometry] = OrderedDict()
_KEPT_GEOMETRIES = 256
"""Buckets whose geometry is kept (a few hundred bytes each on the device)."""


def _pair_2d(cur: torch.Tensor, base: torch.Tensor, device: torch.device) -> tuple[Strided2D, Strided2D] | None:
    """(cur, base) as the kernels address them, when both can take the fused path: on `device`,
    of one dtype of at most 8 bytes, not empty, with dims that merge into two."""
    if cur.device != device or base.device != device or cur.dtype != base.dtype or cur.element_size() > 8:
        return None
    if not cur.numel() or cur.shape != base.shape:  # (a mismatch takes the torch path, which refuses it)
        return None
    pair = as_2d(cur), as_2d(base)
    return None if pair[0] is None or pair[1] is None else (pair[0], pair[1])


def _signature(pairs: list[tuple[torch.Tensor, torch.Tensor]], candidates: list[int], shared: Sequence[bool]) -> tuple:
    """Everything the geometry of `candidates` depends on: which boxes overlap, where each box's
    source and baseline are (devices by number: an address freed on one device may later be given
    out on another), and their kind."""
    boxes = [pairs[i] for i in candidates]
    return (
        tuple(shared),
        tuple(candidates),
        *[
            (c.data_ptr(), b.data_ptr(), c.get_device(), b.get_device(), c.shape, b.shape, c.stride(), b.stride())
            for c, b in boxes
        ],
        *[(c.dtype, b.dtype) for c, b in boxes],
    )


KeptGeometry = tuple[Refs, list[int], tuple[bool, ...], _Geometry]
"""What a bucket's sender keeps from round to round: (weak references to) the tensor objects, the
candidates and the overlaps its last geometry was found for, and that geometry."""


class Keeper(Protocol):
    """Where a bucket keeps its sender's geometry (`sparse_codec.KeptTables`)."""

    geometry: KeptGeometry | None


def geometry(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    candidates: list[int],
    shared: Sequence[bool],
    kept: Keeper | None = None,
) -> _Geometry:
    """The geometry of the boxes among `candidates` (indices of `pairs` on CUDA) that take the
    fused path: those on the first candidate's device whose source and baseline match (the
    others take the torch path); built on first use, then found by where the boxes are, or, with
    the bucket's `kept`, by the tensor objects of its last round (`Keeper.geometry`), while
    `sparse_cuda.usable` gives the same answer."""
    if kept is None:
        return _geometry(pairs, candidates, shared)
    objects = tuple(itertools.chain.from_iterable(pairs))
    if kept.geometry is not None:
        last, last_candidates, last_shared, found = kept.geometry
        same = last_candidates == candidates and last_shared == tuple(shared) and refers_to(last, objects)
        if same and found.cuda == sparse_cuda.usable(pairs[candidates[0]][0].get_device()):
            return found
    found = _geometry(pairs, candidates, shared)
    kept.geometry = (refer(objects), list(candidates), tuple(shared), found)
    return found


def _geometry(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], candidates: list[int], shared: Sequence[bool]
) -> _Geometry:
    """`geometry`, found by where the boxes are (`_signature`) or built."""
    first = pairs[candidates[0]][0]
    cuda = sparse_cuda.usable(first.get_device())  # (part of the signature: the two `diff`s cut tiles differently)
    signature = (cuda, _signature(pairs, candidates, shared))
    found = _GEOMETRIES.get(signature)
    if found is not None:
        _GEOMETRIES.move_to_end(signature)
        return found
    device = first.device
    per_block, slot, boxes = BLOCK // TILE, 0, {}
    for i in candidates:
        cur = pairs[i][0]
        pair = _pair_2d(cur, pairs[i][1], device)
        if pair is not None:
            boxes[i] = _Box(i, *pair, cur.numel(), cur.element_size(), slot, shared[i])
            slot += -(-cur.numel() // BLOCK) * per_block
    boxes, stage = _staged(boxes, slot, cuda)
    up = Upload()
    parts = {b.key: sparse_launch.kernels_for("diff", b.key, None, cuda).DIFF_PARTS for b in boxes.values()}
    rows: list[Row] = [(b.key, None, b.tiles * parts[b.key], b.row(update=b.diff_advances)) for b in boxes.values()]
    diff = sparse_launch.launches(rows, up)
    tiles = sum(b.tiles for b in boxes.values())
    table = up.send(device) if boxes else torch.empty(0, dtype=torch.int64)
    made = _Geometry(boxes, slot, tiles, diff, table, cuda, len(pairs), stage)
    if _placeable(made):
        made.rows = table[diff[0].rows]
        made.dense_bytes = sum(encoded_nbytes(DENSE, b.n, 0, b.width) for b in boxes.values())
    _GEOMETRIES[signature] = made
    if len(_GEOMETRIES) > _KEPT_GEOMETRIES:
        _GEOMETRIES.popitem(last=False)
    return made


def _placeable(g: _Geometry) -> bool:
    """Whether `sparse_cuda.place` can lay out the payloads of `g`'s bucket: every box of the bucket
    fused, in order, all in one CUDA `diff` launch (one element width, on the vectorized path)."""
    boxes = list(g.boxes.values())
    return (
        g.cuda
        and len(g.diff) == 1
        and isinstance(g.diff[0].rows, slice)
        and [b.index for b in boxes] == list(range(g.pairs))
        and all(b.on_cuda for b in boxes)
    )


def _staged(boxes: dict[int, _Box], slots: int, cuda: bool) -> tuple[dict[int, _Box], int]:
    """`boxes` (of `slots` tile slots), those that take the CUDA `diff` (`sparse_launch.kernels_for`' choice, with
    `cuda`) given their stage, one after another behind the words; and the stages' bytes."""
    at = words = slots * WORDS * 4
    staged = {}
    for i, box in boxes.items():
        if sparse_launch.kernels_for("diff", box.key, None, cuda) is sparse_cuda:
            box = replace(box, stage=at)
            at += sparse_cuda.stage_bytes(box.tiles, box.width)
        staged[i] = box
    return staged, at - words


FLUSHES = 4
"""A sender's `compact` launches for the boxes encoded so far once its busy ones (`density` 1 or 2)
hold this fraction of the bucket's tiles (and `FLUSH_TILES` at least): the device compacts them
while the host encodes the rest, rather than waiting for every box's table row. Sparse boxes
never start a launch: theirs takes the device less time than the host takes to prepare it."""
FIRST_FLUSH = 2 * FLUSHES
"""The first such launch comes once the busy boxes hold this fraction (an eighth) instead: the
device idles from the counts' arrival until it is queued, while later ones queue as it works."""
FLUSH_TILES = 1024
"""Tiles (16M elements) below which encoded boxes wait for more: a smaller launch costs the host
more than the device time it hides."""


class FusedSender:
    """The fused boxes of a bucket (`geometry`, with at least one box), found in one `diff`
    launch per key; `counts[i]` read back in one transfer (0 for boxes not fused).

    Usage: `encode(i, code, out)` per fused box, then `complete()` (the payloads, and the
    baselines of unshared boxes), then `advance(codes)` (the shared boxes' baselines); the
    unshared boxes on the CUDA `diff` (`_Box.diff_advances`) advance their baselines in that `diff`
    already, at construction, and their `compact` reads the values it staged. `encode`
    itself launches `compact` for the boxes encoded so far once the busy ones hold a
    `FLUSHES`-th of the bucket's tiles (the first time, a `FIRST_FLUSH`-th); every launch queues
    on the current stream, in order, so nothing waits.

    Given `allow_dense` (True or False), a bucket `sparse_cuda.place` can lay out (`_placeable`)
    is encoded on the device with no host step after `diff`: `place` picks each box's encoding as
    `encodings.choose` does and lays the payloads out in one buffer (`_Geometry.capacity`), and
    `compact` follows it, while the host reads the placement back; `placed` then holds the
    payloads (dense ones copied once the placement is read), `encode` is not called, and
    `complete` has nothing left to launch. Payloads that do not fit the buffer leave `placed`
    None: the host encodes them as above."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], g: _Geometry, allow_dense: bool | None = None):
        self.pairs, self.geometry = pairs, g
        first = pairs[next(iter(g.boxes))][0]
        self.device = device = first.device
        self._device = first.get_device()  # (every fused box's, by number)
        self._scratch = scratch = g.lend(device, self._device)
        self._tiles = scratch.tiles
        self._words = torch.empty(g.slots * WORDS + g.stage // 4, dtype=torch.int32, device=device)
        for diff in scratch.diffs:
            diff(self._words)
        placing = allow_dense is not None and g.rows is not None
        counted = None if placing else scratch.read_back()  # the bucket's one host transfer, before the sums
        self._blocks = self._tiles.view(-1, BLOCK // TILE).sum(1, dtype=torch.int32)
        self._starts = torch.cumsum(self._tiles, 0) - self._tiles
        self.placed: Placed | None = None
        self.counts = self._place(bool(allow_dense)) if counted is None else counted()
        self._rows: list[Row] = []
        self._pending = 0  # tiles of `_rows`
        self._flush_at = max(g.tiles // FIRST_FLUSH, FLUSH_TILES)
        self._payloads: list[torch.Tensor] = []  # the tables hold their addresses

    def _place(self, dense: bool) -> list[int]:
        """Every payload laid out and encoded on the device (`sparse_cuda.place`, then `compact`), the
        launch of the last round's likeliest density class queued before the host waits for the
        placement, the others once it knows their programs; `placed` set when they fit. The counts."""
        g, device = self.geometry, self.device
        assert g.rows is not None  # (`_placeable`)
        boxes, plan = len(g.boxes), self._scratch.plan(len(g.boxes))
        memory = torch.empty(16 * boxes + g.capacity(), dtype=torch.uint8, device=device)  # headers, payloads
        headers, buffer = memory[: 16 * boxes].view(torch.int64), memory[16 * boxes :]
        width, totals = next(iter(g.boxes.values())).width, self._scratch.totals
        sparse_cuda.place(g.rows, boxes, totals, width, dense, buffer, plan.rows, plan.starts, plan.placed, headers)
        read, early = plan.read_back(), g.likely
        if early is not None:
            self._compact_placed(plan, early, g.tiles)  # (programs past the class's last return at once)
        values = read()
        total, fits, programs = values[3 * boxes], values[3 * boxes + 1], values[3 * boxes + 2 :]
        g.learn(total, programs)
        if fits:
            for density_, count in enumerate(programs):
                if count and density_ != early:
                    self._compact_placed(plan, density_, count)
            self.placed = Placed(buffer, values[:boxes], values[boxes : 2 * boxes], total, headers)
            self._copy_dense(self.placed)
        return values[2 * boxes : 3 * boxes]

    def _compact_placed(self, plan: _Plan, density_: int, total: int) -> None:
        """`compact` of density class `density_` over `total` programs, from `place`'s rows."""
        boxes, key = len(self.geometry.boxes), next(iter(self.geometry.boxes.values())).key
        args = (self._words, self._starts, self._blocks, density_)
        sparse_cuda.compact(plan.rows, plan.firsts[density_], boxes, total, key, *args)

    def _copy_dense(self, placed: Placed) -> None:
        """The boxes `place` sent dense, copied whole into their payloads."""
        for i, code in enumerate(placed.codes):
            if code == DENSE:
                cur, start = self.pairs[i][0], placed.offsets[i]
                placed.buffer[start : start + cur.numel() * cur.element_size()].view(cur.dtype).copy_(cur.reshape(-1))

    def encode(self, i: int, code: int, out: torch.Tensor) -> None:
        """Box `i` as `code` into byte buffer `out`, on the box's device (complete after
        `complete`); not for a bucket `place`d on the device."""
        if self.placed is not None:
            raise RuntimeError(f"box {i} of this bucket was encoded on the device already: its payload is in `placed`")
        box = self.geometry.boxes[i]
        if out.get_device() != self._device:
            raise ValueError(
                f"the payload buffer of box {i} is on {out.device}; the fused codec writes it from {self.device}"
            )
        if code == DENSE:
            cur = self.pairs[i][0]
            out[: box.width * box.n].view(cur.dtype).copy_(cur.reshape(-1))
            if box.encode_advances:
                self.pairs[i][1].copy_(cur)  # a whole copy now
            return
        k, address, n, width = self.counts[i], out.data_ptr(), box.n, box.width
        at = payload_layout(code, n, k, width)
        if not k:
            out[: at.head].zero_()
            return
        values = element_offset(address + at.values, self._device, width)
        bitmap, index = (address, 0) if code == BITMAP else (0, address + at.positions)
        blocks = address if code == BLOCKED else 0
        row = box.row(values, index, INDEX_KIND[code], box.encode_advances, bitmap, blocks)
        class_ = density(k, n)
        self._rows.append((box.key, class_, box.tiles, row))
        self._payloads.append(out)
        if class_:  # (a sparse box's `compact` is brief on the device: it waits for `complete`)
            self._pending += box.tiles
            if self._pending >= self._flush_at:
                self.complete()
                self._flush_at = max(self.geometry.tiles // FLUSHES, FLUSH_TILES)

    def _compact(self, rows: list[Row]) -> None:
        up, cuda = Upload(), self.geometry.cuda
        launches = sparse_launch.launches(rows, up, sparse_launch.on_cuda("compact", cuda))
        dev = up.send(self.device) if len(up) else None
        sparse_launch.run("compact", launches, dev, self._words, self._starts, self._blocks, cuda=cuda)

    def complete(self) -> None:
        """Every encoding, and the baselines of boxes no other box overlaps."""
        if self._rows:
            self._compact(self._rows)
            self._rows, self._pending = [], 0

    def advance(self, codes: Sequence[int]) -> None:
        """After `complete`: the shared boxes' baselines become what was sent (`codes[i]`: box
        i's encoding)."""
        rows: list[Row] = []
        for i, box in self.geometry.boxes.items():
            if not box.shared:
                continue
            if codes[i] == DENSE:
                self.pairs[i][1].copy_(self.pairs[i][0])
            elif self.counts[i]:
                rows.append((box.key, density(self.counts[i], box.n), box.tiles, box.row(update=True)))
        if rows:
            self._compact(rows)
        self._give_back()

    def _give_back(self) -> None:
        """The scratch back to the geometry, its counts zeroed on the stream it is lent on (behind
        every launch that reads them, and before the next round's `diff`, whatever stream is current
        now)."""
        scratch = self._scratch
        if _stream(self._device) == scratch.stream:
            scratch.counts.zero_()
        else:
            with torch.cuda.stream(scratch._on):
                scratch.counts.zero_()
        scratch.lent = False  # every launch that reads it is queued: the next round's queue behind
