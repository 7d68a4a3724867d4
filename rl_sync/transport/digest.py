"""Integrity of every transfer: a digest per bucket and peer, checked before the round counts.

`DigestTransport` wraps any transport. When a bucket is waited for, each rank
digests what it sent to and received from each peer (on the host for CPU
buffers, overlapping the next bucket's transfer; on the device for CUDA
buffers, queued on the current stream with no host wait). At `finish` the
ranks exchange the 32-byte tags of everything since the last `finish` in one
small grouped launch per peer, and a rank raises `IntegrityError` naming the
bucket and the sender of the first payload whose tag does not match. The
engine calls `finish` before anything of a round counts (before a sparse
header is read, before the round reports success), so with double buffering
a tampered round never reaches the live weights. Tags bind the sender, the
receiver and a per-peer sequence number that runs over the group's whole
life, so a payload cannot be redirected, replayed from an earlier bucket or
round, or reordered. Each broadcast carries its tag in a second broadcast.

Modes (`SyncConfig.integrity`):

- `keyed`: BLAKE3 in its keyed mode (a MAC: a PRF under a 256-bit key)
  under a key derived from the group's secret, which only members hold
  (handed out through Ray at init). Catches accidental corruption and
  deliberate tampering alike. BLAKE3 rather than HMAC-SHA256: on CPUs the tag
  covers every payload byte on both sides, and BLAKE3 makes it 2.5x faster
  per core than SHA-256 even with the SHA extensions (`benchmarks/digest_bench.py`).
- `checksum`: the same construction with a public key: catches corrupted
  bits, not an attacker who recomputes it.
- `off`: no tag.

On CUDA, the payload is first compressed on its device by NH, level after
level (`rl_sync.transport.nh`, keyed too, about 2**-64 collision bound per
level); only the last level's words (at most 4 KiB per buffer) cross to the
host, in one copy per `finish`, where BLAKE3 tags them; they never travel. Host waits for the
device are polled against the deadline, so a stalled peer fails the round in
time instead of hanging it.

Ordering contract: that of the wrapped transport. Every rank waits for its
buckets in posting order and calls `finish` at the same points (the engine
does), so the tag launches of all ranks line up.

Typical use::

    transport = DigestTransport(GlooTransport(...), Digester("keyed", key, label=b"sync-0"))
    transport.post(sends, recvs, label="bucket 0").wait(deadline)
    transport.finish(deadline)      # raises IntegrityError on a mismatch
"""

from __future__ import annotations

import hmac
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch
from blake3 import blake3

from ..config.sync import Integrity
from .base import Ops, Pending, Transport, event_reached
from .nh import nh_keys, nh_reduce

TAG_BYTES = 32
PUBLIC_KEY = b"rl-sync public checksum key"
KEY_CONTEXT = "rl-sync 2026-12 transfer digest key"
"""BLAKE3 key derivation context: the tag key is `blake3(key, derive_key_context=KEY_CONTEXT)`."""
T = TypeVar("T")


class IntegrityError(RuntimeError):
    """A received payload does not match its digest: altered or corrupted on the way."""


class Digester:
    """Computes the tag of one peer's payload in one bucket (see the module docstring)."""

    def __init__(self, mode: Integrity, key: bytes, *, label: bytes):
        if mode not in ("checksum", "keyed"):
            raise ValueError(f"Digester: mode must be 'checksum' or 'keyed', got {mode!r}")
        self.mode, self.label = mode, label
        self._key = blake3(key if mode == "keyed" else PUBLIC_KEY, derive_key_context=KEY_CONTEXT).digest()
        self._nh_keys: dict[torch.device, list[torch.Tensor]] = {}

    def reduce(self, bufs: Sequence[torch.Tensor]) -> torch.Tensor:
        """CUDA buffers compressed on their device, queued on the current stream (no host wait)."""
        keys = self._keys(bufs[0].device)
        return torch.cat([nh_reduce(b, keys) for b in bufs])

    def seal(self, src: int, dst: int, seq: int, lengths: Sequence[int], chunks: Sequence[memoryview]) -> bytes:
        """Keyed BLAKE3 (one thread; it releases the GIL) over the label, who sent what to whom,
        when, the lengths, and the payload (or its NH words)."""
        mac = blake3(struct.pack(">q", len(self.label)) + self.label, key=self._key)
        mac.update(struct.pack(f">qqqq{len(lengths)}q", src, dst, seq, len(lengths), *lengths))
        for chunk in chunks:
            mac.update(chunk.cast("B"))  # (NH words are int64: BLAKE3 takes bytes)
        return mac.digest(TAG_BYTES)

    def tag(self, src: int, dst: int, seq: int, bufs: Sequence[torch.Tensor], deadline: float) -> bytes:
        """The tag of `bufs` (all on one device), made now: host waits bounded by `deadline`."""
        lengths = [b.numel() for b in bufs]
        if bufs and bufs[0].is_cuda:
            words = self.reduce(bufs)
            device_ready(bufs[0].device, deadline, "digest")
            return self.seal(src, dst, seq, lengths, [words.cpu().numpy().data])
        return self.seal(src, dst, seq, lengths, [b.detach().numpy().data for b in bufs])

    def _keys(self, device: torch.device) -> list[torch.Tensor]:
        if device not in self._nh_keys:
            self._nh_keys[device] = nh_keys(self._key, device)
        return self._nh_keys[device]


def device_ready(device: torch.device, deadline: float, what: str) -> None:
    """Block the host until `device`'s current stream has done its queued work, or `TimeoutError`
    at `deadline` (never an unbounded CUDA synchronize)."""
    if device.type != "cuda":
        return
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    event_reached(done, deadline, what)


@dataclass
class _Transfer:
    """What one rank sent to, or received from, one peer in one bucket: its digest input."""

    peer: int
    src: int
    dst: int
    seq: int
    label: str
    lengths: tuple[int, ...]
    words: torch.Tensor | None = None
    """CUDA: NH words still on the device (the tag is made at `finish`)."""
    tag: bytes | None = None

    @property
    def sealed(self) -> bytes:
        """The tag, which `finish` has made by the time it reads it."""
        assert self.tag is not None, f"{self.label}: tag read before it was made"
        return self.tag


def _by_peer(pairs: Iterable[tuple[int, T]]) -> dict[int, list[T]]:
    """The values of (peer, value) pairs grouped by peer, in order; peers in order of first appearance."""
    grouped: dict[int, list[T]] = {}
    for peer, value in pairs:
        grouped.setdefault(peer, []).append(value)
    return grouped


class _DigestedPending(Pending):
    def __init__(self, inner: Pending, digest: Callable[[float], None] | None):
        self.inner, self.digest = inner, digest

    def wait(self, deadline: float) -> None:
        self.inner.wait(deadline)
        if self.digest is not None:
            digest, self.digest = self.digest, None
            digest(deadline)


class DigestTransport(Transport):
    """`inner`, with every payload digested and the tags checked at `finish`."""

    def __init__(self, inner: Transport, digester: Digester):
        self.inner, self.digester = inner, digester
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self._counts: dict[tuple[str, int], int] = {}
        self._sent: list[_Transfer] = []
        self._received: list[_Transfer] = []
        self._broadcasts = 0

    def post(self, sends: Ops, recvs: Ops, label: str = "") -> Pending:
        pending = self.inner.post(sends, recvs, label=label)
        return _DigestedPending(pending, lambda deadline: self._digest(sends, recvs, label, deadline))

    def _digest(self, sends: Ops, recvs: Ops, label: str, deadline: float) -> None:
        """Digest a waited-for bucket (the device's part queued, no host wait)."""
        for side, ops, out in (("send", sends, self._sent), ("recv", recvs, self._received)):
            for peer, bufs in _by_peer(ops).items():
                seq = self._counts[side, peer] = self._counts.get((side, peer), -1) + 1
                src, dst = (self.rank, peer) if side == "send" else (peer, self.rank)
                transfer = _Transfer(peer, src, dst, seq, label, tuple(b.numel() for b in bufs))
                if self.device.type == "cuda":
                    transfer.words = self.digester.reduce(bufs)
                else:
                    transfer.tag = self.digester.tag(src, dst, seq, bufs, deadline)
                out.append(transfer)

    def complete(self, deadline: float) -> None:
        """Complete everything posted; the tags wait for `finish`."""
        self.inner.finish(deadline)

    def finish(self, deadline: float) -> None:
        """Complete everything posted, then exchange and check the tags of every transfer since
        the last `finish`; raises `IntegrityError` naming the first bucket and sender that fail."""
        self.inner.finish(deadline)
        sent, received, self._sent, self._received = self._sent, self._received, [], []
        if not sent and not received:
            return
        self._seal(sent, received, deadline)
        expected = _by_peer((t.peer, t) for t in received)
        outgoing = [
            (peer, self._tag_tensor(b"".join(t.sealed for t in ts)))
            for peer, ts in _by_peer((t.peer, t) for t in sent).items()
        ]
        incoming = [
            (peer, torch.empty(TAG_BYTES * len(ts), dtype=torch.uint8, device=self.device))
            for peer, ts in expected.items()
        ]
        self.inner.post(outgoing, incoming, label="digests").wait(deadline)
        self.inner.finish(deadline)
        for (peer, buf), transfers in zip(incoming, expected.values()):
            got = bytes(buf.cpu().numpy())
            for i, transfer in enumerate(transfers):
                if not hmac.compare_digest(got[TAG_BYTES * i : TAG_BYTES * (i + 1)], transfer.sealed):
                    self._fail(f"{transfer.label or 'a bucket'} from rank {peer} (transfer {transfer.seq})")

    def _seal(self, sent: list[_Transfer], received: list[_Transfer], deadline: float) -> None:
        """Make the tags still missing (CUDA: one copy of every transfer's NH words to the host)."""
        pending = [(t, t.words) for t in sent + received if t.words is not None]
        if not pending:
            return
        device_ready(self.device, deadline, f"rank {self.rank}: digest")
        host = torch.cat([words for _, words in pending]).cpu().numpy()
        start = 0
        for t, words in pending:
            chunk = host[start : start + words.numel()]
            start += words.numel()
            t.tag, t.words = self.digester.seal(t.src, t.dst, t.seq, t.lengths, [chunk.data]), None

    def _tag_tensor(self, tag: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(self.device)

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        seq, self._broadcasts = self._broadcasts, self._broadcasts + 1
        self.inner.broadcast(buf, root, deadline)
        want = self.digester.tag(root, -1, seq, [buf], deadline)
        tag = self._tag_tensor(want if self.rank == root else bytes(TAG_BYTES))
        self.inner.broadcast(tag, root, deadline)
        device_ready(self.device, deadline, f"rank {self.rank}: digest")
        if self.rank != root and not hmac.compare_digest(bytes(tag.cpu().numpy()), want):
            self._fail(f"broadcast {seq} from rank {root}")

    def _fail(self, what: str) -> None:
        raise IntegrityError(
            f"rank {self.rank}: {what} failed its {self.digester.mode} digest: altered or corrupted "
            "on the way; nothing of this round counts"
        )

    def barrier(self, deadline: float) -> None:
        self.inner.barrier(deadline)

    def destinations(self) -> Mapping[str, torch.Tensor]:
        return self.inner.destinations()

    def begin_round(self) -> None:
        self.inner.begin_round()

    def end_round(self) -> None:
        self.inner.end_round()

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self._sent, self._received = [], []
        self.inner.abort()
