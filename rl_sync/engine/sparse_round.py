"""A sparse round: only changed elements travel, to exactly the ranks that keep them.

Per bucket, in two grouped exchanges: first every message's header (per
segment: encoding code and changed count, int64), so each receiver knows the
size of every payload before posting it; then the payloads. Senders diff each
segment's box against the baseline (the values last synced), pick the
smallest encoding (`rl_sync.sparse.encodings`), and advance the baseline
(`sparse_codec.BucketChanges`: on CUDA every box of the bucket in the same
Triton launches, and the bucket's counts read back once; the baselines of
boxes the kernels did not update advance once the payloads are sent). Receivers validate
every segment of the bucket and write it, in place, into live storage
(`sparse_codec.BucketReceiver`: its tables are built and uploaded from the headers once
the payload exchange is posted, while the payloads travel; on CUDA the writes are queued behind the checks
and skip themselves on the device when a segment is malformed; one host sync,
after them): bad input raises and writes nothing of the bucket.

Ordering contract: as for dense rounds (all ranks, buckets in order); within a
bucket the header exchange precedes the payload exchange on every rank. A worker
forwarding relayed boxes (`rl_sync.planning.relay`) keeps the header and payload of each such
message as it arrived and sends them unchanged in the bucket its schedule names.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ..planning.relay import RelayKey
from ..planning.schedule import Message, RankBucket, Segment
from ..sparse.encodings import DENSE, NAMES, MessageLayout, choose, encoded_nbytes, message_layout
from ..transport.base import Transport
from . import sparse_codec
from .endpoint import Endpoint
from .runner import BucketError, Counters, describe_bucket

T = TypeVar("T")


@dataclass
class SparseCounters(Counters):
    """Counters plus the encoding mix, the bytes a dense round would have moved, and the buckets
    whose payloads the device laid out (`sparse_codec.BucketChanges.placed`)."""

    dense_bytes: int = 0
    changed: int = 0
    encodings: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NAMES.values(), 0))
    placed: int = 0


@dataclass(frozen=True)
class SparseIO:
    sources: Mapping[int, Endpoint]
    baselines: Mapping[int, Endpoint]
    dests: Mapping[int, Endpoint]
    dtypes: Sequence[torch.dtype]
    allow_dense: bool
    forwards: frozenset[RelayKey] = frozenset()
    """Relayed messages this rank forwards later in the round (`rl_sync.planning.relay`)."""
    kept: dict[RelayKey, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """(header, payload) of each of them as it arrived, until it is forwarded."""


def _wire(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A source box in the wire's dtype (cast when the trainer keeps another precision): changes
    are found in what the receiver holds, so an fp32 change too small to move bf16 is none."""
    return view if view.dtype == dtype else view.to(dtype)


@dataclass
class BucketViews:
    """What a sparse bucket reads and writes, as views of the round's endpoints: each segment this
    rank sends, its source (as the trainer keeps it), the wire's dtype, its baseline and its box;
    each message it receives, its segments' dtypes, element counts, element sizes and destination
    views (and what its receivers keep, `sparse_codec.KeptTables`); each segment it copies
    locally, its source, destination and baseline views. Built on
    the bucket's first round; the session keeps them while its endpoint mappings stay the same
    objects, as it keeps compiled dense rounds (a rank binds anew when a weight moves), so a round
    slices no endpoint per segment."""

    sources: list[torch.Tensor]
    wire: list[torch.dtype]
    baselines: list[torch.Tensor]
    boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]
    receives: list[tuple[list[torch.dtype], list[int], list[int], list[torch.Tensor]]]
    local: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    tables: sparse_codec.KeptTables = field(default_factory=sparse_codec.KeptTables)
    """What the bucket's sender and receivers keep from round to round (`sparse_codec.KeptTables`)."""

    @classmethod
    def of(cls, bucket: RankBucket, io: SparseIO) -> BucketViews:
        sent = [seg for msg in bucket.sends if msg.relay is None for seg in msg.segments]
        receives = []
        for msg in bucket.recvs:
            dtypes = [io.dtypes[seg.tensor] for seg in msg.segments]
            sizes = [dtype.itemsize for dtype in dtypes]
            ns = [seg.nbytes // size for seg, size in zip(msg.segments, sizes)]
            dests = [io.dests[seg.tensor].view(seg.offsets, seg.sizes) for seg in msg.segments]
            receives.append((dtypes, ns, sizes, dests))
        return cls(
            [io.sources[seg.tensor].view(seg.offsets, seg.sizes) for seg in sent],
            [io.dtypes[seg.tensor] for seg in sent],
            [io.baselines[seg.tensor].view(seg.offsets, seg.sizes) for seg in sent],
            [(seg.tensor, tuple(seg.offsets), tuple(seg.sizes)) for seg in sent],
            receives,
            [
                (
                    io.sources[seg.tensor].view(seg.offsets, seg.sizes),
                    io.dests[seg.tensor].view(seg.offsets, seg.sizes),
                    io.baselines[seg.tensor].view(seg.offsets, seg.sizes),
                )
                for seg in bucket.local
            ],
        )

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source in the wire's dtype, baseline) of each segment sent, as they are this round."""
        return [(_wire(view, dtype), base) for view, dtype, base in zip(self.sources, self.wire, self.baselines)]


def _find_changes(views: BucketViews, io: SparseIO, device: torch.device) -> sparse_codec.BucketChanges:
    """The changes of every segment this rank sends from its sources in the bucket, in message
    order, for payloads on `device` (the transport's)."""
    pairs, kept = views.pairs(), views.tables
    return sparse_codec.BucketChanges(pairs, views.boxes, payloads=device, allow_dense=io.allow_dense, kept=kept)


def _encode_message(
    msg: Message,
    found: sparse_codec.BucketChanges,
    first: int,
    io: SparseIO,
    counters: SparseCounters,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one message, whose segments are `found`'s boxes from `first` on: the
    payloads `found` placed on the device, or each encoded here as `choose` picks."""
    header, blocks, total, placed = [], [], 0, found.placed
    for i, seg in enumerate(msg.segments, start=first):
        n, size, k = found.pairs[i][0].numel(), found.pairs[i][0].element_size(), found.counts[i]
        code = placed.codes[i] if placed else choose(n, k, size, io.allow_dense)
        header += [code, n if code == DENSE else k]  # a dense block carries every element
        nbytes = encoded_nbytes(code, n, k, size)
        blocks.append((i, code, total, nbytes))
        total += nbytes
        counters.encodings[NAMES[code]] += 1
        counters.changed += k
        counters.dense_bytes += seg.nbytes
    if placed:  # (its headers written on the device too: no host-to-device copy, which waits for the stream)
        payload = placed.span(first, first + len(msg.segments))
        if payload.numel() != total:
            raise RuntimeError(
                f"the device laid out {payload.numel()} payload bytes for a message to rank {msg.peer}; "
                f"its headers imply {total}"
            )
        return placed.header(first, first + len(msg.segments)), payload
    payload = torch.empty(total, dtype=torch.uint8, device=device)
    for i, code, start, nbytes in blocks:
        found.encode(i, code, payload[start : start + nbytes])
    return torch.tensor(header, dtype=torch.int64).to(device), payload


def _exchange(transport: Transport, sends, recvs, deadline: float, label: str, meanwhile: Callable[[], T]) -> T:
    """One grouped exchange, complete before the host reads it (digests are checked once, at
    the round's `finish`); `meanwhile()` runs while it is in flight (what arrives must not be
    read there), and what it returns is returned. The exchange completes even when `meanwhile`
    raises, so no peer waits on this rank."""
    pending = transport.post(sends, recvs, label=label) if sends or recvs else None
    try:
        return meanwhile()
    finally:
        if pending is not None:
            pending.wait(deadline)
            transport.complete(deadline)


def _receiver(
    bucket: RankBucket,
    views: BucketViews,
    layouts: list[MessageLayout],
    payloads: list[torch.Tensor],
    device: torch.device,
) -> tuple[sparse_codec.BucketReceiver, list[Segment]]:
    """The bucket's receiver, every message it receives added (its payload, whose bytes have not
    arrived yet, in `payloads`) and prepared; the segments, by slot."""
    received = sparse_codec.BucketReceiver(device, sum(len(m.segments) for m in bucket.recvs), views.tables)
    segments: list[Segment] = []
    for msg, (dtypes, _, _, dests), layout, payload in zip(bucket.recvs, views.receives, layouts, payloads):
        received.add_message(len(segments), layout, dtypes, payload, dests)
        segments += msg.segments
    received.prepare()
    return received, segments


def run_sparse_bucket(
    bucket: RankBucket,
    io: SparseIO,
    transport: Transport,
    deadline: float,
    counters: SparseCounters,
    names: Sequence[str],
    views: BucketViews | None = None,
) -> None:
    """Headers, then payloads, then validate-all-then-apply (see the module docstring); `views`, the
    bucket's as a round before built them (`BucketViews.of`), where the caller kept them."""
    device = transport.device
    views = views or BucketViews.of(bucket, io)
    found = _find_changes(views, io, device)
    counters.placed += found.placed is not None
    own = [m for m in bucket.sends if m.relay is None]
    firsts = itertools.accumulate((len(m.segments) for m in own), initial=0)
    fresh = iter([_encode_message(m, found, first, io, counters, device) for m, first in zip(own, firsts)])
    found.complete()
    encoded = [next(fresh) if m.relay is None else io.kept.pop(m.relay) for m in bucket.sends]
    sizes = [2 * len(m.segments) for m in bucket.recvs]
    arriving = torch.empty(sum(sizes), dtype=torch.int64, device=device)  # every header, read in one copy
    headers_in = list(arriving.split(sizes))
    where = describe_bucket(bucket, names)
    _exchange(
        transport,
        [(m.peer, h.view(torch.uint8)) for m, (h, _) in zip(bucket.sends, encoded)],
        [(m.peer, h.view(torch.uint8)) for m, h in zip(bucket.recvs, headers_in)],
        deadline,
        f"{where} (headers)",
        lambda: None,
    )
    values, starts = arriving.tolist(), itertools.accumulate(sizes, initial=0)
    layouts = [  # (every header checked against the plan before anything is allocated from it)
        message_layout(values[start : start + size], ns, itemsizes, f"{where}, message from rank {m.peer}")
        for m, start, size, (_, ns, itemsizes, _) in zip(bucket.recvs, starts, sizes, views.receives)
    ]
    payloads_in = [torch.empty(layout.nbytes, dtype=torch.uint8, device=device) for layout in layouts]
    received, segments = _exchange(
        transport,
        [(m.peer, p) for m, (_, p) in zip(bucket.sends, encoded)],
        [(m.peer, p) for m, p in zip(bucket.recvs, payloads_in)],
        deadline,
        where,
        lambda: _receiver(bucket, views, layouts, payloads_in, device),  # its tables, while the payloads travel
    )
    found.advance()  # the baselines, before the received boxes are checked and written
    for msg, header, payload in zip(bucket.recvs, headers_in, payloads_in):
        if msg.relay in io.forwards:
            io.kept[msg.relay] = (header, payload)  # forwarded as it arrived, in a later bucket
    bad = received.commit() if segments else []  # written unless malformed; the bucket's one host sync
    if bad:
        raise BucketError(
            f"rank {transport.rank}, {where}: malformed sparse payload for tensors "
            f"{[names[segments[i].tensor] for i in bad][:4]} (index out of range, out of order, or "
            "bitmap count mismatch); nothing of this bucket was written"
        )
    for seg, (cur, dest, baseline) in zip(bucket.local, views.local):
        dest.copy_(cur)
        baseline.copy_(cur)
        counters.local_bytes += seg.nbytes
    counters.sent_bytes += sum(h.numel() * 8 + p.numel() for h, p in encoded)
    counters.received_bytes += sum(h.numel() * 8 + p.numel() for h, p in zip(headers_in, payloads_in))
    counters.messages += 2 * (len(bucket.sends) + len(bucket.recvs))
    counters.buckets += 1
