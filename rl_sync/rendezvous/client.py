"""`MemberStore`: a `torch.distributed.Store` client of the group's `StoreServer`.

Gloo forms its group on it (`set`, `wait`, `get`), and vLLM service ranks
answer the driver through it. It connects (retrying a refused connection
until `timeout_s`), proves it holds the secret and checks that the server
does too (`auth`), then sends one sealed request at a time. Every call is
bounded by the store timeout; a timeout or a broken frame closes the
connection, and later calls fail at once.

Typical use::

    store = MemberStore(host, port, secret, timeout_s=60)
    store.set("rank/0", record); other = store.get("rank/1")
"""

from __future__ import annotations

import hmac
import os
import socket
import threading
import time
from datetime import timedelta

import msgpack
import torch.distributed as dist

from .auth import HELLO, MAC, NONCE, AuthError, Sealer, check_secret, frame_length, proof

IO_SLACK_S = 5.0
"""Extra seconds a reply may take beyond the wait it answers."""


class MemberStore(dist.Store):
    """A member's connection to the rendezvous store (see the module docstring)."""

    _sock: socket.socket | None
    """None once closed."""

    def __init__(self, host: str, port: int, secret: bytes, *, timeout_s: float):
        super().__init__()
        self.where, self._timeout_s = f"{host}:{port}", float(timeout_s)
        self._sock, self._sealer = _connect(host, port, check_secret(secret), time.monotonic() + timeout_s)
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:  # type: ignore[override]  # torch's stub says str; C++ passes bytes
        self._call(["set", key, bytes(value)], 0.0)

    def get(self, key: str) -> bytes:
        return self._call(["get", key, self._timeout_s], self._timeout_s)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self._timeout_s if timeout is None else timeout.total_seconds()
        self._call(["wait", list(keys), wait_s], wait_s)

    def check(self, keys: list[str]) -> bool:
        return self._call(["check", list(keys)], 0.0)

    def delete_key(self, key: str) -> bool:
        return self._call(["delete", key], 0.0)

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def _call(self, request: list, wait_s: float):
        with self._lock:
            if self._sock is None:
                raise ConnectionError(f"the rendezvous store connection to {self.where} is closed")
            frame = self._sealer.seal(msgpack.packb(request, use_bin_type=True))  # too large: refused here
            try:
                self._sock.settimeout(wait_s + IO_SLACK_S)
                self._sock.sendall(frame)
                body = _read(self._sock, frame_length(_read(self._sock, 4)))
                status, value = msgpack.unpackb(self._sealer.open(body, _read(self._sock, MAC)), raw=False)
            except (OSError, AuthError, ValueError) as exc:
                self._sock.close()
                self._sock = None
                raise ConnectionError(f"rendezvous store {self.where}: {type(exc).__name__}: {exc}") from None
        if status == "timeout":
            raise dist.DistStoreError(f"rendezvous store {self.where}: {value}")
        if status != "ok":
            raise ValueError(f"rendezvous store {self.where}: {value}")
        return value


def _connect(host: str, port: int, secret: bytes, deadline: float) -> tuple[socket.socket, Sealer]:
    """Connect and run the client's half of the handshake, retrying until `deadline` while the
    store refuses or drops the connection (not yet listening, or shedding a flood); a store
    that fails its proof is final (`AuthError`)."""
    delay = 0.05
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the rendezvous store at {host}:{port} did not accept a connection in time")
        try:
            with socket.create_connection((host, port), timeout=min(left, 10.0)) as sock:
                sealer = _handshake(sock, secret)
                return sock.dup(), sealer
        except AuthError:
            raise
        except (TimeoutError, ConnectionError):
            time.sleep(min(delay, max(left, 0)))
            delay = min(2 * delay, 1.0)


def _handshake(sock: socket.socket, secret: bytes) -> Sealer:
    cn = os.urandom(NONCE)
    sock.sendall(HELLO + cn)
    answer = _read(sock, NONCE + MAC)
    sn = answer[:NONCE]
    if not hmac.compare_digest(answer[NONCE:], proof(secret, b"server", cn, sn)):
        raise AuthError(f"the rendezvous store at {sock.getpeername()} does not hold the group's secret")
    sock.sendall(proof(secret, b"client", cn, sn))
    return Sealer(secret, cn, sn, client=True)


def _read(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the rendezvous store closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
