"""Mutual authentication and sealed frames for the rendezvous store.

Handshake (both sides hold the group's 32-byte secret `S`; `cn`, `sn` are
fresh random 32-byte nonces)::

    client -> server   HELLO | cn
    server -> client   sn | HMAC(S, "server" | cn | sn)
    client -> server   HMAC(S, "client" | cn | sn)

Each side checks the other's proof with a constant-time compare and closes
the connection on a mismatch; the server reads exactly these fixed sizes,
within `HANDSHAKE_S`, before it reads anything else. Both then derive the
session key `K = HMAC(S, "session" | cn | sn)`. A frame is::

    length (4 bytes, big endian, at most MAX_FRAME) | body | HMAC(K, direction | seq | body)

with `direction` b"c" (client to server) or b"s", and `seq` counting that
direction's frames from 0 (8 bytes), so a frame cannot be altered, replayed,
reordered or reflected. Frames are authenticated, not encrypted: an observer
on the path sees the records (Gloo listener addresses), never the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct

HELLO = b"rl-sync-store/1\n"
NONCE = 32
MAC = 32
SECRET_BYTES = 32
HANDSHAKE_S = 5.0
MAX_FRAME = 64 << 20
"""Largest frame either side accepts: a record or a vLLM rank's describe answer."""


class AuthError(ConnectionError):
    """The peer did not prove it holds the group's secret, or a frame failed its digest."""


def new_secret() -> bytes:
    """A fresh per-group secret."""
    return secrets.token_bytes(SECRET_BYTES)


def derive(secret: bytes, purpose: bytes, *context: bytes) -> bytes:
    """A key for one purpose, from the group secret (HMAC-SHA256 as a PRF)."""
    return hmac.new(secret, purpose + b"".join(struct.pack(">I", len(c)) + c for c in context), hashlib.sha256).digest()


def check_secret(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        raise ValueError(
            f"the group secret must be {SECRET_BYTES} bytes, got "
            f"{len(secret) if isinstance(secret, bytes) else type(secret).__name__}"
        )
    return secret


def proof(secret: bytes, who: bytes, cn: bytes, sn: bytes) -> bytes:
    return derive(secret, who, cn, sn)


class Sealer:
    """Seals outgoing and opens incoming frames of one connection (see the module docstring)."""

    def __init__(self, secret: bytes, cn: bytes, sn: bytes, *, client: bool):
        self._key = derive(secret, b"session", cn, sn)
        self._out, self._in = (b"c", b"s") if client else (b"s", b"c")
        self._sent = self._received = 0

    def _mac(self, direction: bytes, seq: int, body: bytes) -> bytes:
        return hmac.new(self._key, direction + struct.pack(">Q", seq) + body, hashlib.sha256).digest()

    def seal(self, body: bytes) -> bytes:
        if len(body) > MAX_FRAME:
            raise ValueError(f"a rendezvous frame holds at most {MAX_FRAME} bytes, got {len(body)}")
        frame = struct.pack(">I", len(body)) + body + self._mac(self._out, self._sent, body)
        self._sent += 1
        return frame

    def open(self, body: bytes, mac: bytes) -> bytes:
        if not hmac.compare_digest(mac, self._mac(self._in, self._received, body)):
            raise AuthError("a rendezvous frame failed its digest (altered, replayed or out of order)")
        self._received += 1
        return body


def frame_length(header: bytes) -> int:
    (length,) = struct.unpack(">I", header)
    if length > MAX_FRAME:
        raise AuthError(f"a rendezvous frame announced {length} bytes, more than the {MAX_FRAME} allowed")
    return length
