"""Integrity of every transfer: a digest per bucket and peer, checked before the bucket counts.

`DigestTransport` wraps any transport. In each `post`, after the payload a
rank sends to a peer, it sends a 32-byte tag over that payload; the peer
computes the same tag over what it received and raises `IntegrityError`
(naming the sender) before the bucket is complete. Tags bind the sender,
the receiver and a per-peer sequence number that runs over the group's whole
life, so a payload cannot be redirected, replayed from an earlier bucket or
round, or reordered. Broadcasts carry a tag the same way.

Modes (`SyncConfig.integrity`):

- `keyed`: HMAC-SHA256 under a key derived from the group's secret, which
  only members hold (handed out through Ray at init). Catches accidental
  corruption and deliberate tampering alike.
- `checksum`: the same construction with a public key: catches corrupted
  bits, not an attacker who recomputes it.
- `off`: no tag.

On CUDA, the payload is first compressed on the device by NH, the
almost-universal hash of UMAC (RFC 4418): each 1 KiB block becomes two
64-bit words under a secret key, in two lanes, so two different blocks of
equal length collide with probability at most 2**-64. Only the compressed
words (1/64 of the payload) cross to the host, where HMAC-SHA256 makes the
tag; the NH words themselves never travel.

Ordering contract: that of the wrapped transport; the tag to a peer follows
the payload to it within the same `post`.

Typical use::

    transport = DigestTransport(GlooTransport(...), Digester("keyed", key, label=b"sync-0"))
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import Literal

import torch

from .base import Ops, Pending, Transport

Integrity = Literal["off", "checksum", "keyed"]
TAG_BYTES = 32
NH_BLOCK_WORDS = 256
"""32-bit words per NH block (1 KiB)."""
NH_LANES = 2
NH_CHUNK_BYTES = 64 << 20
"""Payload bytes compressed per device step (bounds the temporaries to a few times this)."""
PUBLIC_KEY = b"rl-sync public checksum key"
_MASK32 = 0xFFFFFFFF


class IntegrityError(RuntimeError):
    """A received payload does not match its digest: altered or corrupted on the way."""


class Digester:
    """Computes the tag of one peer's payload in one bucket (see the module docstring)."""

    def __init__(self, mode: Integrity, key: bytes, *, label: bytes):
        if mode not in ("checksum", "keyed"):
            raise ValueError(f"Digester: mode must be 'checksum' or 'keyed', got {mode!r}")
        self.mode, self.label = mode, label
        self._key = key if mode == "keyed" else PUBLIC_KEY
        self._nh_keys: dict[torch.device, torch.Tensor] = {}

    def tag(self, src: int, dst: int, seq: int, bufs: Sequence[torch.Tensor]) -> bytes:
        """HMAC-SHA256 over who sent what to whom, when, and the payload (or its NH on CUDA)."""
        mac = hmac.new(self._key, self.label, hashlib.sha256)
        mac.update(struct.pack(">qqqq", src, dst, seq, len(bufs)))
        for buf in bufs:
            mac.update(struct.pack(">q", buf.numel()))
            mac.update(self._nh(buf) if buf.is_cuda else memoryview(buf.detach().numpy()))
        return mac.digest()

    def _nh(self, buf: torch.Tensor) -> bytes:
        key = self._nh_keys.get(buf.device)
        if key is None:
            key = self._nh_keys[buf.device] = nh_key(self._key, buf.device)
        return nh_compress(buf, key)


def nh_key(key: bytes, device: torch.device) -> torch.Tensor:
    """NH's key words (int64 holding uint32), expanded from `key` by SHAKE-256."""
    words = NH_BLOCK_WORDS + 4 * (NH_LANES - 1)
    raw = hashlib.shake_256(b"rl-sync nh" + key).digest(4 * words)
    return torch.tensor(struct.unpack(f"<{words}I", raw), dtype=torch.int64, device=device)


def nh_compress(buf: torch.Tensor, key: torch.Tensor) -> bytes:
    """NH over `buf` (uint8) in 1 KiB blocks, the last one zero-padded: `NH_LANES` int64 per block."""
    block = 4 * NH_BLOCK_WORDS
    full = buf.numel() // block * block
    parts = [_nh_rows(_words(buf[start:min(full, start + NH_CHUNK_BYTES)]), key)
             for start in range(0, full, NH_CHUNK_BYTES)]
    if full < buf.numel():
        tail = torch.zeros(block, dtype=torch.uint8, device=buf.device)
        tail[: buf.numel() - full] = buf[full:]
        parts.append(_nh_rows(_words(tail), key))
    if not parts:
        return b""
    return torch.cat(parts).cpu().numpy().tobytes()


def _words(chunk: torch.Tensor) -> torch.Tensor:
    """`chunk` as rows of NH_BLOCK_WORDS int32 words (copied when not 4-byte aligned)."""
    if chunk.storage_offset() % 4:
        chunk = chunk.clone()
    return chunk.view(torch.int32).view(-1, NH_BLOCK_WORDS)


def _nh_rows(rows: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Per row and lane: sum over word pairs of ((m0 + k0) mod 2**32) * ((m1 + k1) mod 2**32), mod 2**64."""
    words = rows.to(torch.int64) & _MASK32
    lanes = []
    for lane in range(NH_LANES):
        mixed = (words + key[4 * lane: 4 * lane + NH_BLOCK_WORDS]) & _MASK32
        lanes.append((mixed[:, 0::2] * mixed[:, 1::2]).sum(dim=1))
    return torch.stack(lanes, dim=1).flatten()


def _by_peer(ops: Ops) -> dict[int, list[torch.Tensor]]:
    """Each peer's buffers, in posting order, peers in order of first appearance."""
    out: dict[int, list[torch.Tensor]] = {}
    for peer, buf in ops:
        out.setdefault(peer, []).append(buf)
    return out


class _CheckedPending(Pending):
    def __init__(self, inner: Pending, owner: DigestTransport, expected: list[tuple[int, int, list, torch.Tensor]]):
        self.inner, self.owner, self.expected = inner, owner, expected

    def wait(self, deadline: float) -> None:
        self.inner.wait(deadline)
        expected, self.expected = self.expected, []
        for peer, seq, bufs, tag in expected:
            self.owner.check(peer, seq, bufs, tag)


class DigestTransport(Transport):
    """`inner`, with every payload followed by its tag and checked on arrival."""

    def __init__(self, inner: Transport, digester: Digester):
        self.inner, self.digester = inner, digester
        self.rank, self.world_size, self.device = inner.rank, inner.world_size, inner.device
        self._sent: dict[int, int] = {}
        self._received: dict[int, int] = {}
        self._broadcasts = 0

    def _tag_tensor(self, tag: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(tag), dtype=torch.uint8).to(self.device)

    def post(self, sends: Ops, recvs: Ops) -> Pending:
        tags_out, expected = [], []
        for peer, bufs in _by_peer(sends).items():
            seq = self._sent[peer] = self._sent.get(peer, -1) + 1
            tags_out.append((peer, self._tag_tensor(self.digester.tag(self.rank, peer, seq, bufs))))
        for peer, bufs in _by_peer(recvs).items():
            seq = self._received[peer] = self._received.get(peer, -1) + 1
            expected.append((peer, seq, bufs, torch.empty(TAG_BYTES, dtype=torch.uint8, device=self.device)))
        pending = self.inner.post([*sends, *tags_out], [*recvs, *((p, t) for p, _, _, t in expected)])
        return _CheckedPending(pending, self, expected)

    def check(self, peer: int, seq: int, bufs: Sequence[torch.Tensor], tag: torch.Tensor) -> None:
        """Raise `IntegrityError` unless `tag` is the tag of `bufs` from `peer` (`seq`: its transfer)."""
        self._verify(self.digester.tag(peer, self.rank, seq, bufs), tag, f"the payload from rank {peer} (transfer {seq})")

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        seq, self._broadcasts = self._broadcasts, self._broadcasts + 1
        tag = self._tag_tensor(self.digester.tag(root, -1, seq, [buf]) if self.rank == root else bytes(TAG_BYTES))
        self.inner.broadcast(buf, root, deadline)
        self.inner.broadcast(tag, root, deadline)
        if self.rank != root:
            self._verify(self.digester.tag(root, -1, seq, [buf]), tag, f"the broadcast from rank {root} (broadcast {seq})")

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
