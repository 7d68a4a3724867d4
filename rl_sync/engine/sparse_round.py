"""A sparse round: only changed elements travel, to exactly the ranks that keep them.

Per bucket, in two grouped exchanges: first every message's header (per
segment: encoding code and changed count, int64), so each receiver knows the
size of every payload before posting it; then the payloads. Senders diff each
segment's box against the baseline (the values last synced), pick the
smallest encoding (`rl_sync.sparse`), and advance the baseline. Receivers
validate every segment of the bucket (one host sync) and only then write, in
place, into live storage: bad input raises and writes nothing of the bucket.

Ordering contract: as for dense rounds (all ranks, buckets in order); within a
bucket the header exchange precedes the payload exchange on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..schedule import Message, RankBucket
from ..sparse import BITMAP, DENSE, INDICES, NAMES, check_count, choose, encoded_nbytes
from ..transport.base import Transport
from . import sparse_codec
from .endpoint import Endpoint
from .runner import BucketError, Counters, describe_bucket


@dataclass
class SparseCounters(Counters):
    """Counters plus the encoding mix and the bytes a dense round would have moved."""

    dense_bytes: int = 0
    changed: int = 0
    encodings: dict[str, int] = field(default_factory=lambda: {name: 0 for name in NAMES.values()})


@dataclass(frozen=True)
class SparseIO:
    sources: Mapping[int, Endpoint]
    baselines: Mapping[int, Endpoint]
    dests: Mapping[int, Endpoint]
    dtypes: Sequence[torch.dtype]
    allow_dense: bool


def _wire(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A source box in the wire's dtype (cast when the trainer keeps another precision): changes
    are found in what the receiver holds, so an fp32 change too small to move bf16 is none."""
    return view if view.dtype == dtype else view.to(dtype)


def _encode_message(msg: Message, io: SparseIO, counters: SparseCounters, device: torch.device):
    """(header, payload, changes): `changes` is (segment, code, `Changes`, values) of every
    segment, which advance the baseline once the bucket is encoded."""
    views = [(seg, _wire(io.sources[seg.tensor].view(seg.offsets, seg.sizes), io.dtypes[seg.tensor]),
              io.baselines[seg.tensor].view(seg.offsets, seg.sizes)) for seg in msg.segments]
    found = [sparse_codec.Changes(cur, base) for _, cur, base in views]
    header, blocks, total = [], [], 0
    for (seg, cur, _), box in zip(views, found):
        k = box.count
        code = choose(cur.numel(), k, cur.element_size(), io.allow_dense)
        header += [code, cur.numel() if code == DENSE else k]  # a dense block carries every element
        size = encoded_nbytes(code, cur.numel(), k, cur.element_size())
        blocks.append((code, total, size))
        total += size
        counters.encodings[NAMES[code]] += 1
        counters.changed += k
        counters.dense_bytes += seg.nbytes
    payload = torch.empty(total, dtype=torch.uint8, device=device)
    changes = []
    for (code, start, size), seg, box in zip(blocks, msg.segments, found):
        values = sparse_codec.encode(code, box, payload[start : start + size])
        changes.append((seg, code, box, values))
    return torch.tensor(header, dtype=torch.int64).to(device), payload, changes


def _advance_baselines(io: SparseIO, changes) -> None:
    """The bucket's sent boxes are now what their receivers hold: the changed elements of
    indexed segments are written into the baseline, bitmap and dense boxes are copied whole.
    Only after every message is encoded: a box sent to several replicas is diffed against the
    same baseline each time."""
    for seg, code, box, values in changes:
        base = io.baselines[seg.tensor].view(seg.offsets, seg.sizes)
        if code in (DENSE, BITMAP):
            base.copy_(io.sources[seg.tensor].view(seg.offsets, seg.sizes), non_blocking=True)
        elif box.count:
            sparse_codec.apply(INDICES, base, box.index.to(base.device), values.to(base.device))


def _payload_sizes(msg: Message, header: list[int], io: SparseIO, where: str) -> list[tuple[int, int, int, int]]:
    """(code, k, start, size) per segment, every header checked against the plan before allocation."""
    blocks, total = [], 0
    for i, seg in enumerate(msg.segments):
        code, k = header[2 * i], header[2 * i + 1]
        size = io.dtypes[seg.tensor].itemsize
        n = seg.nbytes // size
        check_count(code, k, n, f"{where}, segment {i}")
        nbytes = encoded_nbytes(code, n, k, size)
        blocks.append((code, k, total, nbytes))
        total += nbytes
    return blocks


def _exchange(transport: Transport, sends, recvs, deadline: float, label: str) -> None:
    """One grouped exchange, complete before the host reads it (digests are checked once, at
    the round's `finish`)."""
    if sends or recvs:
        transport.post(sends, recvs, label=label).wait(deadline)
        transport.complete(deadline)


def run_sparse_bucket(bucket: RankBucket, io: SparseIO, transport: Transport, deadline: float, counters: SparseCounters,
                      names: Sequence[str]) -> None:
    """Headers, then payloads, then validate-all-then-apply (see the module docstring)."""
    device = transport.device
    encoded = [_encode_message(m, io, counters, device) for m in bucket.sends]
    _advance_baselines(io, [c for _, _, changes in encoded for c in changes])
    headers_in = [torch.empty(2 * len(m.segments), dtype=torch.int64, device=device) for m in bucket.recvs]
    where = describe_bucket(bucket, names)
    _exchange(transport, [(m.peer, h.view(torch.uint8)) for m, (h, _, _) in zip(bucket.sends, encoded)],
              [(m.peer, h.view(torch.uint8)) for m, h in zip(bucket.recvs, headers_in)], deadline, f"{where} (headers)")
    layouts = [_payload_sizes(m, h.tolist(), io, f"{where}, message from rank {m.peer}") for m, h in zip(bucket.recvs, headers_in)]
    payloads_in = [torch.empty(sum(b[3] for b in blocks), dtype=torch.uint8, device=device) for blocks in layouts]
    _exchange(transport, [(m.peer, p) for m, (_, p, _) in zip(bucket.sends, encoded)],
              [(m.peer, p) for m, p in zip(bucket.recvs, payloads_in)], deadline, where)
    decoded, checks = [], []
    for msg, blocks, payload in zip(bucket.recvs, layouts, payloads_in):
        for seg, (code, k, start, size) in zip(msg.segments, blocks):
            n = seg.nbytes // io.dtypes[seg.tensor].itemsize
            index, values, ok = sparse_codec.decode(code, k, n, io.dtypes[seg.tensor], payload[start : start + size])
            decoded.append((seg, code, index, values))
            checks.append(ok)
    if checks and not bool(torch.stack(checks).all()):
        bad = [names[seg.tensor] for (seg, *_), ok in zip(decoded, torch.stack(checks).tolist()) if not ok]
        raise BucketError(f"rank {transport.rank}, {where}: malformed sparse payload for tensors {bad[:4]} "
                          "(index out of range, out of order, or bitmap count mismatch); nothing of this bucket was written")
    for seg, code, index, values in decoded:
        sparse_codec.apply(code, io.dests[seg.tensor].view(seg.offsets, seg.sizes), index, values)
    for seg in bucket.local:
        cur = io.sources[seg.tensor].view(seg.offsets, seg.sizes)
        io.dests[seg.tensor].view(seg.offsets, seg.sizes).copy_(cur)
        io.baselines[seg.tensor].view(seg.offsets, seg.sizes).copy_(cur)
        counters.local_bytes += seg.nbytes
    counters.sent_bytes += sum(h.numel() * 8 + p.numel() for h, p, _ in encoded)
    counters.received_bytes += sum(h.numel() * 8 + p.numel() for h, p in zip(headers_in, payloads_in))
    counters.messages += 2 * (len(bucket.sends) + len(bucket.recvs))
    counters.buckets += 1
