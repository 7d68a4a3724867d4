"""Integrity of every transfer: a digest per bucket and peer, checked before the bucket counts.

`DigestTransport` wraps any transport. When a bucket is waited for, each rank
computes a 32-byte tag over what it sent to each peer and sends it in a
second, tiny grouped launch; the peer computes the same tag over what it
received and raises `IntegrityError` (naming the sender) unless they match,
before the bucket completes. Tags bind the sender, the receiver and a
per-peer sequence number that runs over the group's whole life, so a
payload cannot be redirected, replayed from an earlier bucket or round, or
reordered. Broadcasts carry a tag the same way.

Modes (`SyncConfig.integrity`):

- `keyed`: HMAC-SHA256 under a key derived from the group's secret, which
  only members hold (handed out through Ray at init). Catches accidental
  corruption and deliberate tampering alike.
- `checksum`: the same construction with a public key: catches corrupted
  bits, not an attacker who recomputes it.
- `off`: no tag.

On CUDA, the payload is first compressed on its device by NH, level after
level (`rl_sync.transport.nh`, keyed too, about 2**-64 collision bound per
level); only the last level's words (at most 4 KiB per buffer) cross to the
host for the HMAC, in one copy per peer, and they never travel. Host waits for the device are polled against the bucket's deadline,
so a stalled peer fails the round in time instead of hanging it.

Ordering contract: that of the wrapped transport. Every rank waits for its
buckets in posting order (the runner does), so the tag launches of all
ranks follow the same order as their payloads.

Typical use::

    transport = DigestTransport(GlooTransport(...), Digester("keyed", key, label=b"sync-0"))
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time
from collections.abc import Sequence
from typing import Literal

import torch

from .base import Ops, Pending, Transport, remaining
from .nh import nh_keys, nh_reduce

Integrity = Literal["off", "checksum", "keyed"]
TAG_BYTES = 32
PUBLIC_KEY = b"rl-sync public checksum key"
POLL_S = 0.0005


class IntegrityError(RuntimeError):
    """A received payload does not match its digest: altered or corrupted on the way."""


class Digester:
    """Computes the tag of one peer's payload in one bucket (see the module docstring)."""

    def __init__(self, mode: Integrity, key: bytes, *, label: bytes):
        if mode not in ("checksum", "keyed"):
            raise ValueError(f"Digester: mode must be 'checksum' or 'keyed', got {mode!r}")
        self.mode, self.label = mode, label
        self._key = key if mode == "keyed" else PUBLIC_KEY
        self._nh_keys: dict[torch.device, list[torch.Tensor]] = {}

    def tag(self, src: int, dst: int, seq: int, bufs: Sequence[torch.Tensor]) -> bytes:
        """HMAC-SHA256 over who sent what to whom, when, and the payload (its NH on CUDA)."""
        mac = hmac.new(self._key, self.label, hashlib.sha256)
        mac.update(struct.pack(f">qqqq{len(bufs)}q", src, dst, seq, len(bufs), *(b.numel() for b in bufs)))
        if bufs and bufs[0].is_cuda:
            keys = self._keys(bufs[0].device)
            mac.update(memoryview(torch.cat([nh_reduce(b, keys) for b in bufs]).cpu().numpy()))
        else:
            for buf in bufs:
                mac.update(memoryview(buf.detach().numpy()))
        return mac.digest()

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
    while not done.query():
        remaining(deadline, what)
        time.sleep(POLL_S)


Peers = list[tuple[int, int, list[torch.Tensor]]]
"""(peer, sequence number, buffers in posting order) per peer of one bucket."""


def _by_peer(ops: Ops, counters: dict[int, int]) -> Peers:
    """Each peer's buffers in posting order (peers in order of first appearance), numbered."""
    grouped: dict[int, list[torch.Tensor]] = {}
    for peer, buf in ops:
        grouped.setdefault(peer, []).append(buf)
    out = []
    for peer, bufs in grouped.items():
        counters[peer] = counters.get(peer, -1) + 1
        out.append((peer, counters[peer], bufs))
    return out


class _CheckedPending(Pending):
    def __init__(self, inner: Pending, owner: DigestTransport, sends: Peers, recvs: Peers):
        self.inner, self.owner, self.sends, self.recvs = inner, owner, sends, recvs

    def wait(self, deadline: float) -> None:
        self.inner.wait(deadline)
        if self.sends or self.recvs:
            sends, recvs, self.sends, self.recvs = self.sends, self.recvs, [], []
            self.owner.exchange_tags(sends, recvs, deadline)


class DigestTransport(Transport):
    """`inner`, with every payload followed by its tag and checked on arrival."""

    def __init__(self, inner: Transport, digester: Digester):
        self.inner, self.digester = inner, digester
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._broadcasts = 0

    def post(self, sends: Ops, recvs: Ops) -> Pending:
        pending = self.inner.post(sends, recvs)
        return _CheckedPending(pending, self, _by_peer(sends, self._sent), _by_peer(recvs, self._received))

    def exchange_tags(self, sends: Peers, recvs: Peers, deadline: float) -> None:
        """Send the tag of each peer's payload, receive each sender's, and check them."""
        device_ready(self.device, deadline, f"rank {self.rank}: digest")
        out = [(peer, self._tag_tensor(self.digester.tag(self.rank, peer, seq, bufs))) for peer, seq, bufs in sends]
        tags = [(peer, torch.empty(TAG_BYTES, dtype=torch.uint8, device=self.device)) for peer, _, _ in recvs]
        self.inner.post(out, tags).wait(deadline)
        device_ready(self.device, deadline, f"rank {self.rank}: digest")
        for (peer, seq, bufs), (_, tag) in zip(recvs, tags):
            want = self.digester.tag(peer, self.rank, seq, bufs)
            self._verify(want, tag, f"the payload from rank {peer} (transfer {seq})")

    def _tag_tensor(self, tag: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(self.device)

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        seq, self._broadcasts = self._broadcasts, self._broadcasts + 1
        self.inner.broadcast(buf, root, deadline)
        device_ready(self.device, deadline, f"rank {self.rank}: digest")
        want = self.digester.tag(root, -1, seq, [buf])
        tag = self._tag_tensor(want if self.rank == root else bytes(TAG_BYTES))
        self.inner.broadcast(tag, root, deadline)
        device_ready(self.device, deadline, f"rank {self.rank}: digest")
        if self.rank != root:
            self._verify(want, tag, f"the broadcast from rank {root} (broadcast {seq})")

    def _verify(self, want: bytes, tag: torch.Tensor, what: str) -> None:
        if not hmac.compare_digest(bytes(tag.cpu().numpy()), want):
            raise IntegrityError(f"rank {self.rank}: {what} failed its {self.digester.mode} digest: altered or "
                                 "corrupted on the way; nothing of this round counts")

    def barrier(self, deadline: float) -> None:
        self.inner.barrier(deadline)

    def finish(self, deadline: float) -> None:
        self.inner.finish(deadline)

    def close(self) -> None:
        self.inner.close()

    def abort(self) -> None:
        self.inner.abort()
