"""The fused sparse codec's receiving side: `FusedReceiver` validates and writes the bitmap and
blocked boxes one rank receives in a bucket, every box of the bucket in the same launches (the
CUDA `starts`, `blocked_check`, busy `expand` and `blocked_apply` of `sparse_cuda` where they take
them, else Triton's, `sparse_triton`); `sparse_codec.BucketReceiver` drives it beside the torch
path.

A receiver's table has a row a box. Most of a row follows from where its destination view lies
and from the box's encoding and density class; only five columns follow from this round's
payload and count. So a receiver works out each message's destinations once
(`destinations`), and a round that comes with the same views and headers of the same shape
(each box's encoding and density class) as an earlier one finds that round's tables in the
bucket's `sparse_codec.KeptTables` and fills in those five columns alone: on the receiver's
critical path, before its first launch, the host then spends about a microsecond a box.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple, Protocol

import numpy as np
import torch

from ..sparse.encodings import BITMAP, BLOCK, BLOCKED, PayloadLayout
from . import sparse_cuda, sparse_triton
from .sparse_cuda import STARTS_WARPS
from .sparse_launch import kernels_for, launch_order
from .sparse_table import (
    BUSIER,
    BUSY,
    RECV_COLUMNS,
    RECV_COUNTS,
    RECV_K,
    RECV_OFFSETS,
    RECV_VALUES,
    RECV_WORDS,
    TILE,
    Key,
    Refs,
    Upload,
    anchor_address,
    check_elements,
    flags_layout,
    refer,
    refers_to,
    starts,
    strided,
)


def disjoint(spans: list[tuple[int, int]]) -> bool:
    """Whether no two of the byte ranges `spans` (start, end) share a byte."""
    ordered = sorted(spans)
    return all(end <= start for (_, end), (start, _) in itertools.pairwise(ordered))


class Destination(NamedTuple):
    """A box's destination view as a receiver writes it: its elements `n`; where the fused kernels
    can write it, its row's columns from `RECV_DEST` through `RECV_N` (`Strided2D.columns`, then
    `n`), otherwise none; its launch key; the bytes it spans where it is on the vectorized path
    (else None); and its element width and the address of that width's anchor, from which a
    row's values are counted."""

    n: int
    columns: tuple[int, ...]
    key: Key
    span: tuple[int, int] | None
    width: int
    anchor: int
    refused: str = ""
    """Why a bitmap or blocked box cannot be written into it (a view not aligned to its elements);
    a box of another encoding takes the torch path."""


def destinations(views: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], device: int) -> list[Destination]:
    """Each view of a message, box i of `dtypes[i]`, whose payload is on the device numbered
    `device`: the fused kernels write it when it is of that dtype (at most 8 bytes), on that
    device, not empty, with dims that merge into two, aligned to its elements (`Destination.refused`
    says why not, for a box that must be)."""
    return [
        _destination(view.data_ptr(), view.shape, view.stride(), view.dtype, dtype, view.get_device() == device, device)
        for view, dtype in zip(views, dtypes)
    ]


@functools.lru_cache(maxsize=4096)
def _destination(
    address: int,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    held: torch.dtype,
    dtype: torch.dtype,
    here: bool,
    device: int,
) -> Destination:
    """`destinations`' answer for a view at `address` of `shape` and `strides`, holding `held`, for
    a box of `dtype`, on the payload's device (`here`) numbered `device`: a pure function of its
    arguments, kept for the views a round finds again every step."""
    n, width = math.prod(shape), dtype.itemsize
    dest = None
    if held == dtype and width <= 8 and n and here:
        try:
            dest = strided(address, shape, strides, width, device)
        except ValueError as error:  # (not aligned to its elements)
            return Destination(n, (), (width, False), None, width, 0, str(error))
    if dest is None:
        return Destination(n, (), (width, False), None, width, 0)
    span = (address, address + n * width) if dest.fast else None
    anchor = anchor_address(device, width)
    return Destination(n, (*dest.columns, n), (width, dest.fast), span, width, anchor)


_FUSED_CODES = (BITMAP, BLOCKED)
"""The encodings a receiver's fused kernels check and write (the rest take the torch path)."""
_BLOCKED_ROW = 3
"""A blocked box's place in a message's shape (a bitmap box's is its density class, 0 to 2)."""
_TORCH = -1
"""A box's place in a message's shape when it takes the torch path."""
_PER_ROUND = np.array([RECV_WORDS, RECV_OFFSETS, RECV_VALUES, RECV_K, RECV_COUNTS])
"""The columns of a row that follow from the round's payload and count, in the order a receiver
gathers them (`FusedReceiver.add_message`): bitmap words, in-block offsets, values, count, and
block counts."""
_NO_LAUNCH = (None, 0)
"""(program starts, programs) of a launch without rows: not launched."""
Launch = tuple
"""A receiver's launch: `CHECKS`, `BLOCKED_CHECKS`, or a write, `(key, density class)` (`expand`)
or `(key, None)` (`blocked_apply`)."""
CHECKS: Launch = ("checks",)
BLOCKED_CHECKS: Launch = ("blocked checks",)
Queued = tuple[Callable[..., None], tuple]
"""A receiver's launch, prepared: (kernel, its arguments)."""
Buffer = torch.Tensor | sparse_cuda.Address
"""Device memory a receiver's launch takes: a tensor, or an address (CUDA launches only)."""
Message = tuple[int, Sequence[Destination], tuple[int, ...]]
"""A message as a receiver's tables see it: its first slot, its destinations, its shape (each
box's density class, `_BLOCKED_ROW`, or `_TORCH`)."""


Write = tuple[ModuleType, Key, "int | None", Launch]
"""A write launch of a receiver's tables: (the module whose kernel it takes, key, density class
(None: `blocked_apply`), the launch)."""


@dataclass(frozen=True)
class Tables:
    """What the checks and writes of a bucket's rows need but the round's payloads and counts: the
    rows with their other columns (`template`, one after another) and where the others go
    (`per_round_at`, `_PER_ROUND` of each row), each launch's program starts and programs, the
    writes with programs in the order they are queued (each key's `expand`s, then its
    `blocked_apply`), whether every launch carries the rows inline, and the tile and block counts
    of the rows."""

    template: np.ndarray
    per_round_at: np.ndarray
    firsts: dict[Launch, tuple[list[int], int]]
    writes: list[Write]
    inline: bool
    entries: int

    @property
    def rows(self) -> int:
        return len(self.template) // RECV_COLUMNS

    def table(self, per_round: list[int]) -> np.ndarray:
        """The rows, with each row's `_PER_ROUND` columns from `per_round` (five values a row)."""
        table = self.template.copy()
        table[self.per_round_at] = per_round
        return table


def tables(messages: Sequence[Message], usable: bool) -> Tables:
    """The tables of a bucket's fused rows, message by message (`usable`: `sparse_cuda.usable` for
    the bucket's device)."""
    rows, checks, writes, counts, spans = _rows(messages, usable)
    firsts = {}
    for launch, each in _programs(checks, writes, counts).items():
        at = starts(each)
        firsts[launch] = (at, at[-1])
    cuda = usable and disjoint(spans)
    queued = [
        (_writer(key, density_, cuda, usable), key, density_, (key, density_))
        for key, density_ in sorted(filter(_is_write, firsts), key=launch_order)
    ]
    inline = usable and sparse_cuda.fits_inline(len(counts), RECV_COLUMNS)
    inline = inline and all(module is sparse_cuda for module, *_ in queued)
    per_round_at = (np.arange(len(counts))[:, None] * RECV_COLUMNS + _PER_ROUND).ravel()
    with_programs = [write for write in queued if firsts[write[3]][1]]
    return Tables(np.array(rows, dtype=np.int64), per_round_at, firsts, with_programs, inline, sum(counts))


def _rows(
    messages: Sequence[Message], usable: bool
) -> tuple[list[int], list[int], list[Launch], list[int], list[tuple[int, int]]]:
    """(each fused row's columns but `_PER_ROUND`, one row after another; its programs in the
    checks; its write; its tile or block counts; the bytes of the bitmap destinations on the
    vectorized path). A row joins the checks (the CUDA `starts`: a program every `STARTS_WARPS`
    tiles of a bitmap row, one for a blocked row; Triton's `bitmap_counts`: a program a bitmap
    tile) and a write, `(key, density class)` (`expand`) for a bitmap row, `(key, None)`
    (`blocked_apply`) and `BLOCKED_CHECKS` for a blocked one."""
    rows: list[int] = []
    writes: list[Launch] = []
    checks, counts, spans, entries = [], [], [], 0
    for first, dests, shape in messages:
        for slot, dest, place in zip(itertools.count(first), dests, shape):
            if place == _TORCH:
                continue
            if place == _BLOCKED_ROW:
                m = -(-dest.n // BLOCK)
                rows += (0, 0, 0, *dest.columns, 0, slot, entries, m, 0, BLOCK)
                checks.append(int(usable))
                writes.append((dest.key, None))
            else:
                m = -(-dest.n // TILE)
                rows += (0, 0, 0, *dest.columns, 0, slot, entries, m, 0, TILE)
                checks.append(-(-m // STARTS_WARPS) if usable else m)
                writes.append((dest.key, place))
                if dest.span is not None:
                    spans.append(dest.span)
            counts.append(m)
            entries += m
    return rows, checks, writes, counts, spans


def _is_write(launch: Launch) -> bool:
    return launch not in (CHECKS, BLOCKED_CHECKS)


def _programs(checks: list[int], writes: list[Launch], counts: list[int]) -> dict[Launch, list[int]]:
    """Each launch's programs a row (0 for the rows it does not take): the checks, the blocked
    checks where there are blocked rows, and each write."""
    programs = {CHECKS: checks}
    for launch in dict.fromkeys(writes):
        programs[launch] = [m if write == launch else 0 for write, m in zip(writes, counts)]
    blocked = [m if write[1] is None else 0 for write, m in zip(writes, counts)]
    if any(blocked):
        programs[BLOCKED_CHECKS] = blocked
    return programs


def _writer(key: Key, density_: int | None, cuda: bool, usable: bool):
    """The module whose kernel writes a launch of `key` and density class `density_` (None:
    blocked rows): `sparse_cuda` for blocked rows wherever it is `usable` (its `blocked_apply`
    writes one element at a time, strided or not), and for bitmap ones as `sparse_launch.kernels_for` picks
    `expand` with `cuda` (usable, and the bitmap destinations disjoint); else `sparse_triton`."""
    if density_ is None:
        return sparse_cuda if usable else sparse_triton
    return kernels_for("expand", key, density_, cuda)


_KEPT_SHAPES = 8
"""Header shapes whose tables a bucket keeps (`KeptTables`): a round's boxes change encoding or
density class now and then, and back."""


KeptDestinations = tuple[Refs, tuple, int, list[Destination]]
"""A message's destinations as a receiver found them: (weak references to) its views, their dtypes,
the payload's device, and each view's `Destination`."""


class Keeper(Protocol):
    """Where a bucket keeps what its receivers worked out (`sparse_codec.KeptTables`): each message's
    destinations by its first slot, and the tables of its last header shapes (`_KEPT_SHAPES`)."""

    destinations: dict[int, KeptDestinations]
    tables: OrderedDict[tuple, Tables]


class FusedReceiver:
    """The fused boxes one rank receives in a bucket: validated, then written, each step one
    launch per kind (and per key and density class, for the writes).

    Usage: `add_message(...)` per message (it says which boxes do not take the fused path; it reads
    where the payload lies, not its bytes); `prepare()` (the tables to the device, or kept for the
    launches' parameters: a round runs it while the payloads are on their way); `validate()`
    (raises the malformed boxes' `flags`, and `guard` with them, on the device); `write()` right
    behind it: its kernels write nothing while `guard` is raised, so no host synchronization is
    needed in between.

    The CUDA `expand` (`sparse_cuda`) rewrites whole 16-byte runs of a live view, unmarked elements
    with the values they had: it takes only buckets whose bitmap destinations share no byte (others
    take Triton's, which writes marked elements alone), and nothing else may write those views
    while the bucket is written (an inference engine only reads its weights)."""

    def __init__(self, device: torch.device, zeroed: torch.Tensor, bucket: int, kept: Keeper | None = None):
        """`zeroed`: the bucket receiver's int32 values, all zero (`flags_layout(bucket)` for its
        `bucket` boxes): a flag a box, the guard, then the `starts` counters; `kept`: what the
        bucket's earlier receivers worked out (None: everything is worked out afresh)."""
        self.device, self._zeroed, self._bucket, self._memo = device, zeroed, bucket, kept
        self._number = zeroed.get_device()
        self._cuda = sparse_cuda.usable(self._number)
        self._messages: list[Message] = []
        self._per_round: list[int] = []  # each row's `_PER_ROUND` columns, one row after another
        self._kept: list[tuple[torch.Tensor, Sequence[torch.Tensor]]] = []  # the table holds their addresses
        self.boxes = 0
        """Boxes added."""
        self._entries = 0
        self._checks: list[Queued] | None = None  # once prepared
        self._writes: list[Queued] = []
        self._scratch: torch.Tensor | None = None  # the checks' counts and positions, where launches take addresses

    def add_message(
        self,
        first: int,
        boxes: Sequence[tuple[int, int, int, PayloadLayout, int]],
        dtypes: Sequence[torch.dtype],
        payload: torch.Tensor,
        views: Sequence[torch.Tensor],
    ) -> list[int]:
        """The boxes of one message that can take the fused path, in slots `first`, `first + 1`, ...
        (`encodings.MessageLayout.boxes`, box i of `dtypes[i]` at its start in `payload`, checked
        already: `sparse_codec.BucketReceiver.add_message`), to be written into `views[i]`
        (`destinations` says which can be); bitmap or blocked ones. The indices of the others, of
        which nothing is kept. Refuses, adding nothing, a view of other elements than its box's,
        and a box for the fused path once the tables are prepared. One loop, no call a box: a
        round adds every box of a bucket on its receiver's critical path."""
        device, base = payload.get_device(), payload.data_ptr()
        dests = self._destinations(first, views, dtypes, device)
        shape: list[int] = []
        per_round: list[int] = []
        others: list[int] = []
        for i, (code, k, n, at, start) in enumerate(boxes):
            dest = dests[i]
            if dest.n != n:
                check_elements(first, boxes, views)
            if not dest.columns or code not in _FUSED_CODES:
                if dest.refused and code in _FUSED_CODES:
                    raise ValueError(dest.refused)
                shape.append(_TORCH)
                others.append(i)
                continue
            block = base + start
            values = (block + at.values - dest.anchor) // dest.width  # (parts 16-byte aligned)
            if code == BITMAP:
                shape.append(int(k * BUSY > n) + int(k * BUSIER > n))  # (`density`, inline)
                per_round += (block, 0, values, k, 0)
            else:
                shape.append(_BLOCKED_ROW)
                per_round += (0, block + at.positions, values, k, block)
        if per_round:
            if self._checks is not None:
                slot = first + next(i for i, place in enumerate(shape) if place != _TORCH)
                raise RuntimeError(f"box {slot} was added after this bucket's receiver tables were prepared")
            self._messages.append((first, dests, tuple(shape)))
            self._per_round += per_round
            self._kept.append((payload, views))
            self.boxes += len(per_round) // len(_PER_ROUND)
        return others

    def _destinations(
        self, first: int, views: Sequence[torch.Tensor], dtypes: Sequence[torch.dtype], device: int
    ) -> Sequence[Destination]:
        """`destinations` of a message from slot `first`: the kept ones where the bucket's earlier
        receivers were given the same view objects and dtypes there, on the same device."""
        memo = self._memo
        if memo is None:
            return destinations(views, dtypes, device)
        found = memo.destinations.get(first)
        if found is not None:
            kept_views, kept_dtypes, kept_device, dests = found
            if kept_device == device and kept_dtypes == tuple(dtypes) and refers_to(kept_views, views):
                return dests
        dests = destinations(views, dtypes, device)
        memo.destinations[first] = (refer(views), tuple(dtypes), device, dests)
        memo.tables.clear()  # (made for the destinations these replace)
        return dests

    def _tables(self) -> Tables:
        """The tables of the rows added: the kept ones of a round whose messages had this shape,
        else made (and kept)."""
        memo = self._memo
        if memo is None:
            return tables(self._messages, self._cuda)
        shape = (self._cuda, tuple((first, places) for first, _, places in self._messages))
        found = memo.tables.get(shape)
        if found is None:
            found = memo.tables[shape] = tables(self._messages, self._cuda)
            if len(memo.tables) > _KEPT_SHAPES:
                memo.tables.popitem(last=False)
        else:
            memo.tables.move_to_end(shape)
        return found

    def prepare(self) -> None:
        """Everything the checks and writes need but the payloads' bytes: the table and program
        starts uploaded (or kept, to be carried inline), the buffers the checks fill, each launch's
        arguments. A round runs it while the payloads are on their way; `validate` runs it when it
        has not run."""
        if self._checks is not None or not self.boxes:
            return
        made = self._tables()
        self._entries, boxes = made.entries, made.rows
        table, firsts = self._placed(made)
        counts, starts, flags = self._buffers(made.inline)
        (checks_at, checks), (blocked_at, blocked) = firsts[CHECKS], firsts.get(BLOCKED_CHECKS, _NO_LAUNCH)
        queued: list[Queued] = []
        if self._cuda:
            done = sparse_cuda.Address(self._zeroed.data_ptr() + 4 * flags_layout(self._bucket)[0], self._number)
            queued.append((sparse_cuda.starts, (table, checks_at, boxes, checks, counts, starts, *flags, done)))
        else:
            if checks:
                queued.append((sparse_triton.bitmap_counts, (table, checks_at, boxes, checks, counts, *flags)))
            queued.append((sparse_triton.scan, (table, boxes, counts, starts, *flags)))
        if blocked:
            check = (sparse_cuda if self._cuda else sparse_triton).blocked_check
            queued.append((check, (table, blocked_at, boxes, blocked, starts, *flags)))
        self._checks = queued
        for writer, key, density_, launch in made.writes:
            at, total = firsts[launch]
            head = (table, at, boxes, total, key, starts)
            if density_ is None:
                self._writes.append((writer.blocked_apply, (*head, flags[1])))
            else:
                self._writes.append((writer.expand, (*head, density_, flags[1])))

    def _buffers(self, inline: bool) -> tuple[Buffer, Buffer, tuple[Buffer, Buffer]]:
        """(tile counts, payload positions, (flags, guard)) of the checks: tensors, or, where every
        launch is a CUDA one (`inline`), addresses (a view costs the host more than the launch that
        takes it): the counts and positions in one allocation, the flags in `zeroed`."""
        entries, device, bucket, number = self._entries, self.device, self._bucket, self._number
        if not inline:
            counts = torch.empty(entries, dtype=torch.int32, device=device)
            starts = torch.empty(entries, dtype=torch.int64, device=device)
            return counts, starts, (self._zeroed[:bucket], self._zeroed[bucket : bucket + 1])
        self._scratch = torch.empty(entries + (entries + 1) // 2, dtype=torch.int64, device=device)
        at, flags = self._scratch.data_ptr(), self._zeroed.data_ptr()
        Address = sparse_cuda.Address
        return (
            Address(at + 8 * entries, number),
            Address(at, number),
            (Address(flags, number), Address(flags + 4 * bucket, number)),
        )

    def _placed(self, made: Tables) -> tuple[sparse_cuda.Rows, Mapping[Launch, tuple[sparse_cuda.Rows | None, int]]]:
        """(the table; each launch's program starts (None when it has no programs: not uploaded)
        and programs), this round's payloads and counts filled in: host values carried inline (the
        table an array, for every launch to copy), or one upload sliced."""
        table = made.table(self._per_round)
        if made.inline:
            return table, made.firsts
        up = Upload()
        table_at = up.add(table.tolist())
        uploaded = {launch: up.add(at) for launch, (at, total) in made.firsts.items() if total}
        dev = up.send(self.device)
        placed: dict[Launch, tuple[sparse_cuda.Rows | None, int]] = {
            launch: (dev[uploaded[launch]] if total else None, total) for launch, (_, total) in made.firsts.items()
        }
        return dev[table_at], placed

    def validate(self) -> None:
        """Queue the checks (`prepare` first; once, later calls queue nothing): each row's payload
        positions (`starts`), its flag raised (and `guard`) when its payload is malformed. The CUDA
        `starts` does in one launch what Triton's `bitmap_counts` and `scan` do in two."""
        self.prepare()
        for kernel, args in self._checks or ():
            kernel(*args)
        self._checks = []  # queued once: `starts`' counters are spent

    def write(self) -> None:
        """Queue the writes (`validate` first), each key's `expand`s then its `blocked_apply`."""
        for kernel, args in self._writes:
            kernel(*args)
