"""Run one rank's buckets: pack, grouped send/recv, unpack into live storage.

Zero copy where it can be: a message of one segment whose box is contiguous in
local storage is sent from, or received into, that storage directly (a live
parameter on a worker). Everything else goes through staging. A round is
first *compiled* (`compile_program`): every view, staging slice and copy list
is resolved once, so replaying it costs a few batched calls per bucket
however many tensors there are; a session keeps the program while its
endpoints stay the same objects. Staging is two buffers (double buffering:
bucket k+1 is packed while bucket k is in flight), each sized to the largest
bucket that uses it: bounded by about two buckets, and reported.

Ordering contract: every rank of the group runs the same round with its own
`RankSchedule`; buckets are posted in increasing index.

Typical use::

    program = compile_program(mine.buckets, BucketIO(source, dest, dtypes), device)
    counters = run_program(program, transport, deadline, names=names, context="round 3")
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..planning.schedule import ALIGN, Message, RankBucket
from ..transport.base import Pending, Transport
from .batched_copy import BatchedCopy
from .endpoint import Endpoint, as_bytes, region

LARGE_COPY_BYTES = 4 << 20
"""Local copies at least this large run as single copies (full copy-engine bandwidth);
smaller ones are batched into one `_foreach_copy_` launch."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _widest(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two byte views retyped to the widest word both are aligned to (a batched copy of
    bytes moves one byte per thread step; of 8-byte integers, eight)."""
    n = dst.numel()
    for width, dtype in _WORDS:
        if n % width == 0 and dst.data_ptr() % width == 0 and src.data_ptr() % width == 0:
            return dst.view(dtype), src.view(dtype)
    return dst, src


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

    def add(self, other: Counters) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass(frozen=True)
class BucketIO:
    """How a runner finds storage: `source(bucket, tensor)` / `dest(bucket, tensor)`."""

    source: Callable[[int, int], Endpoint]
    dest: Callable[[int, int], Endpoint]
    dtypes: Sequence[torch.dtype]


@dataclass
class Copies:
    """Copies to run together: big contiguous ones singly (copy engines at full bandwidth),
    small contiguous ones in one batched launch, strided ones in one `_foreach_copy_`."""

    big: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    small: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    strided: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _batched: BatchedCopy | None = None
    _fallback: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `dst.copy_(src)`; a copy between dtypes casts (typed, never as bytes)."""
        dst_bytes, src_bytes = (as_bytes(dst), as_bytes(src)) if dst.dtype == src.dtype else (None, None)
        if dst_bytes is None or src_bytes is None:
            self.strided.append((dst, src))
        elif dst_bytes.numel() >= LARGE_COPY_BYTES:
            self.big.append((dst_bytes, src_bytes))
        else:
            self.small.append((dst_bytes, src_bytes))

    def _prepare(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Decided once: Triton's one-launch copy on CUDA, else `_foreach_copy_` over words;
        returns the `_foreach_copy_` lists."""
        dsts, srcs = [d for d, _ in self.small], [s for _, s in self.small]
        self._batched = BatchedCopy.build(dsts, srcs)
        words = [_widest(d, s) for d, s in self.small] + self.strided
        self._fallback = ([d for d, _ in words], [s for _, s in words])
        if self._batched is not None:
            self._fallback = ([d for d, _ in self.strided], [s for _, s in self.strided])
        return self._fallback

    def run(self) -> None:
        for dst, src in self.big:
            dst.copy_(src)
        fallback = self._fallback if self._fallback is not None else self._prepare()
        if self._batched is not None:
            self._batched.run()
        if fallback[0]:
            torch._foreach_copy_(*fallback)


@dataclass
class BucketOps:
    """One bucket with every view resolved."""

    bucket: RankBucket
    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    pack: Copies = field(default_factory=Copies)
    unpack: Copies = field(default_factory=Copies)
    local: Copies = field(default_factory=Copies)
    counters: Counters = field(default_factory=Counters)
    pending: Pending | None = None
    forwards: bool = False
    """Forwards relayed boxes (`rl_sync.planning.relay`): the bucket before it must complete first."""
    label: str = ""
    """Names the bucket in a transport's errors (`describe_bucket`), set at its first run."""


def _staged(msg: Message, endpoint: Callable[[int, int], Endpoint], bucket: int, dtypes: Sequence[torch.dtype]) -> bool:
    """Whether `msg` goes through staging: several segments, a strided box, or a source of
    another dtype than the wire's (cast while packing)."""
    if len(msg.segments) != 1:
        return True
    seg = msg.segments[0]
    view = endpoint(bucket, seg.tensor).view(seg.offsets, seg.sizes)
    return not view.is_contiguous() or view.dtype != dtypes[seg.tensor]


def _storage(side: str, msg: Message, io: BucketIO) -> Callable[[int, int], Endpoint]:
    """Where a message's boxes live here: a send's in the sources, except a forwarded one
    (`rl_sync.planning.relay`), read where this worker received it; a receive's in the destinations."""
    return io.source if side == "send" and msg.relay is None else io.dest


def staging_need(bucket: RankBucket, io: BucketIO) -> int:
    """Bytes of staging `bucket` needs on this rank."""
    staged = [
        m
        for side, messages in (("send", bucket.sends), ("recv", bucket.recvs))
        for m in messages
        if _staged(m, _storage(side, m, io), bucket.index, io.dtypes)
    ]
    return sum(_aligned(m.nbytes) for m in staged)


def compile_bucket(bucket: RankBucket, io: BucketIO, buf: torch.Tensor) -> BucketOps:
    """Resolve every view of `bucket`; staged messages take consecutive slices of `buf`."""
    ops, cursor = BucketOps(bucket), 0
    for side, messages in (("send", bucket.sends), ("recv", bucket.recvs)):
        for msg in messages:
            endpoint = _storage(side, msg, io)
            ops.forwards |= side == "send" and msg.relay is not None
            if _staged(msg, endpoint, bucket.index, io.dtypes):
                target = buf[cursor : cursor + msg.nbytes]
                cursor += _aligned(msg.nbytes)
                ops.counters.staged_bytes += msg.nbytes
                for seg in msg.segments:
                    box = endpoint(bucket.index, seg.tensor).view(seg.offsets, seg.sizes)
                    packed = region(target, seg, io.dtypes[seg.tensor])
                    if side == "send":
                        ops.pack.add(packed, box)
                    else:
                        ops.unpack.add(box, packed)
            else:
                seg = msg.segments[0]
                direct = as_bytes(endpoint(bucket.index, seg.tensor).view(seg.offsets, seg.sizes))
                assert direct is not None  # not staged: one contiguous box
                target = direct
                ops.counters.zero_copy_bytes += msg.nbytes
            (ops.sends if side == "send" else ops.recvs).append((msg.peer, target))
    for seg in bucket.local:
        dst = io.dest(bucket.index, seg.tensor).view(seg.offsets, seg.sizes)
        src = io.source(bucket.index, seg.tensor).view(seg.offsets, seg.sizes)
        ops.counters.local_bytes += seg.nbytes
        if dst.data_ptr() != src.data_ptr() or dst.stride() != src.stride():
            ops.local.add(dst, src)
    ops.counters.sent_bytes = sum(seg.nbytes for m in bucket.sends for seg in m.segments)
    ops.counters.received_bytes = sum(seg.nbytes for m in bucket.recvs for seg in m.segments)
    ops.counters.messages = len(bucket.sends) + len(bucket.recvs)
    ops.counters.buckets = 1
    return ops


def start_bucket(ops: BucketOps, transport: Transport) -> None:
    """Pack, copy locally, and post the bucket's grouped send/recv."""
    ops.pack.run()
    ops.local.run()
    ops.pending = transport.post(ops.sends, ops.recvs, label=ops.label) if ops.sends or ops.recvs else None


def complete_bucket(ops: BucketOps, deadline: float) -> None:
    """Wait for the bucket's transfers, then unpack what was staged."""
    if ops.pending is not None:
        ops.pending.wait(deadline)
        ops.pending = None
    ops.unpack.run()


@dataclass
class Program:
    """A compiled round: its buckets and the staging they share."""

    buckets: list[BucketOps]
    staging: list[torch.Tensor]

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() for b in self.staging)


def compile_program(buckets: Sequence[RankBucket], io: BucketIO, device: torch.device) -> Program:
    """Compile `buckets` with two alternating staging buffers (see the module docstring)."""
    needs = [staging_need(b, io) for b in buckets]
    sizes = [max(needs[slot::2], default=0) for slot in (0, 1)]
    staging = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    return Program([compile_bucket(b, io, staging[i % 2]) for i, b in enumerate(buckets)], staging)


class BucketError(RuntimeError):
    """A bucket failed on this rank; the message names the bucket and its tensors."""


def run_program(
    program: Program, transport: Transport, deadline: float, *, names: Sequence[str], context: str
) -> Counters:
    """Replay a compiled round, bucket k+1 packed while bucket k is in flight."""
    counters, previous, where = Counters(), None, "before the first bucket"
    try:
        for ops in program.buckets:
            ops.label = ops.label or describe_bucket(ops.bucket, names)
            if previous is not None and ops.forwards:
                where = previous.label
                complete_bucket(previous, deadline)  # what this bucket forwards has landed
                previous = None
            where = ops.label
            start_bucket(ops, transport)
            if previous is not None:
                where = previous.label
                complete_bucket(previous, deadline)
            previous = ops
            counters.add(ops.counters)
        if previous is not None:
            where = previous.label
            complete_bucket(previous, deadline)
        where = "completing the round"
        transport.finish(deadline)
    except Exception as exc:
        for ops in program.buckets:
            ops.pending = None  # nothing may keep the aborted group alive (`transport.gloo`)
        transport.abort()
        raise BucketError(f"rank {transport.rank}, {context}, {where}: {type(exc).__name__}: {exc}") from exc
    return counters


def describe_bucket(bucket: RankBucket, names: Sequence[str]) -> str:
    tensors = sorted(
        {s.tensor for m in bucket.sends + bucket.recvs for s in m.segments} | {s.tensor for s in bucket.local}
    )
    shown = ", ".join(repr(names[t]) for t in tensors[:4]) + (
        f" and {len(tensors) - 4} more" if len(tensors) > 4 else ""
    )
    return f"bucket {bucket.index} (tensors {shown})"


def deadline_in(seconds: float) -> float:
    """A `time.monotonic()` deadline `seconds` from now."""
    return time.monotonic() + seconds
