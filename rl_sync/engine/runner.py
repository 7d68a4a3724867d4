"""Run one rank's buckets: pack, grouped send/recv, unpack into live storage.

Zero copy where it can be: a message of one segment whose box is contiguous in
local storage is sent from, or received into, that storage directly (a live
parameter on a worker). Everything else goes through a staging buffer.
Staging is two reusable buffers (double buffering: bucket k+1 is packed while
bucket k is in flight), each grown to the largest bucket this rank stages, so
its size is bounded by about two buckets and reported in the statistics.

Ordering contract: every rank of the group calls `run_buckets` for the same
round with its own `RankSchedule`; buckets are posted in increasing index.

Typical use::

    stats = run_buckets(mine.buckets, BucketIO(source, dest, dtypes), transport,
                        staging, deadline, context="round 3")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..schedule import ALIGN, Message, RankBucket
from ..transport.base import Pending, Transport
from .endpoint import Endpoint, as_bytes, region


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Staging:
    """Two reusable byte buffers on one device, grown on demand."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]

    def get(self, slot: int, nbytes: int) -> torch.Tensor:
        buf = self.buffers[slot]
        if buf is None or buf.numel() < nbytes:
            self.buffers[slot] = None
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            self.buffers[slot] = buf
        return buf

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for b in self.buffers if b is not None)

    def release(self) -> None:
        self.buffers = [None, None]


@dataclass
class Counters:
    """What one rank moved in one round."""

    sent_bytes: int = 0
    received_bytes: int = 0
    zero_copy_bytes: int = 0
    staged_bytes: int = 0
    local_bytes: int = 0
    messages: int = 0
    buckets: int = 0


@dataclass(frozen=True)
class BucketIO:
    """How a runner finds storage: `source(bucket, tensor)` / `dest(bucket, tensor)`."""

    source: Callable[[int, int], Endpoint]
    dest: Callable[[int, int], Endpoint]
    dtypes: Sequence[torch.dtype]


@dataclass
class Prepared:
    bucket: RankBucket
    pending: Pending | None = None
    unpack: list[tuple[torch.Tensor, Message]] = field(default_factory=list)


def _needs_staging(msg: Message, endpoint: Callable[[int, int], Endpoint], bucket: int) -> bool:
    if len(msg.segments) != 1:
        return True
    seg = msg.segments[0]
    return not endpoint(bucket, seg.tensor).view(seg.offsets, seg.sizes).is_contiguous()


def post_bucket(bucket: RankBucket, io: BucketIO, transport: Transport, buf_of, counters: Counters) -> Prepared:
    staged_sends = [m for m in bucket.sends if _needs_staging(m, io.source, bucket.index)]
    staged_recvs = [m for m in bucket.recvs if _needs_staging(m, io.dest, bucket.index)]
    buf = buf_of(sum(_aligned(m.nbytes) for m in staged_sends + staged_recvs))
    cursor, sends, recvs, prepared = 0, [], [], Prepared(bucket)
    for side, messages, staged in (("send", bucket.sends, staged_sends), ("recv", bucket.recvs, staged_recvs)):
        endpoint = io.source if side == "send" else io.dest
        for msg in messages:
            if any(m is msg for m in staged):
                target = buf[cursor : cursor + msg.nbytes]
                cursor += _aligned(msg.nbytes)
                counters.staged_bytes += msg.nbytes
                if side == "send":
                    for seg in msg.segments:
                        region(target, seg, io.dtypes[seg.tensor]).copy_(
                            endpoint(bucket.index, seg.tensor).view(seg.offsets, seg.sizes))
                else:
                    prepared.unpack.append((target, msg))
            else:
                seg = msg.segments[0]
                target = as_bytes(endpoint(bucket.index, seg.tensor).view(seg.offsets, seg.sizes))
                counters.zero_copy_bytes += msg.nbytes
            (sends if side == "send" else recvs).append((msg.peer, target))
    _local_copies(bucket, io, counters)
    counters.sent_bytes += sum(seg.nbytes for m in bucket.sends for seg in m.segments)
    counters.received_bytes += sum(seg.nbytes for m in bucket.recvs for seg in m.segments)
    counters.messages += len(bucket.sends) + len(bucket.recvs)
    counters.buckets += 1
    prepared.pending = transport.post(sends, recvs) if sends or recvs else None
    return prepared


def _local_copies(bucket: RankBucket, io: BucketIO, counters: Counters) -> None:
    """Copy what this rank holds on both sides: contiguous pairs as bytes in one batched
    `_foreach_copy_` (thousands of small tensors cost a few launches), the rest one by one."""
    dsts, srcs = [], []
    for seg in bucket.local:
        dst = io.dest(bucket.index, seg.tensor).view(seg.offsets, seg.sizes)
        src = io.source(bucket.index, seg.tensor).view(seg.offsets, seg.sizes)
        counters.local_bytes += seg.nbytes
        if dst.data_ptr() == src.data_ptr() and dst.stride() == src.stride():
            continue
        dst_bytes, src_bytes = as_bytes(dst), as_bytes(src)
        if dst_bytes is not None and src_bytes is not None:
            dsts.append(dst_bytes)
            srcs.append(src_bytes)
        else:
            dst.copy_(src)
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def complete_bucket(prepared: Prepared, io: BucketIO, deadline: float) -> None:
    if prepared.pending is not None:
        prepared.pending.wait(deadline)
    for target, msg in prepared.unpack:
        for seg in msg.segments:
            io.dest(prepared.bucket.index, seg.tensor).view(seg.offsets, seg.sizes).copy_(
                region(target, seg, io.dtypes[seg.tensor]))


class BucketError(RuntimeError):
    """A bucket failed on this rank; the message names the bucket and its tensors."""


def run_buckets(
    buckets: Sequence[RankBucket],
    io: BucketIO,
    transport: Transport,
    staging: Staging,
    deadline: float,
    *,
    names: Sequence[str],
    context: str,
) -> Counters:
    """Run `buckets` in order with double-buffered staging; see the module docstring."""
    counters, previous, active = Counters(), None, None
    try:
        for step, bucket in enumerate(buckets):
            active = bucket
            current = post_bucket(bucket, io, transport, lambda n, s=step % 2: staging.get(s, n), counters)
            if previous is not None:
                active = previous.bucket
                complete_bucket(previous, io, deadline)
            previous = current
        if previous is not None:
            active = previous.bucket
            complete_bucket(previous, io, deadline)
        transport.finish(deadline)
    except Exception as exc:
        transport.abort()
        where = describe_bucket(active, names) if active is not None else "before the first bucket"
        raise BucketError(f"rank {transport.rank}, {context}, {where}: {type(exc).__name__}: {exc}") from exc
    return counters


def describe_bucket(bucket: RankBucket, names: Sequence[str]) -> str:
    tensors = sorted({s.tensor for m in bucket.sends + bucket.recvs for s in m.segments} | {s.tensor for s in bucket.local})
    shown = ", ".join(repr(names[t]) for t in tensors[:4]) + (f" and {len(tensors) - 4} more" if len(tensors) > 4 else "")
    return f"bucket {bucket.index} (tensors {shown})"


def deadline_in(seconds: float) -> float:
    """A `time.monotonic()` deadline `seconds` from now."""
    return time.monotonic() + seconds
