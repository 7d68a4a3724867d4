"""Hand file descriptors to one other process on this host, once, over a Unix socket.

A colocated worker exports its VMM memory as file descriptors
(`rl_sync.transport.cuda_memory`); they reach its trainer as `SCM_RIGHTS`
messages. The worker offers them on a `SOCK_SEQPACKET` socket in a fresh
directory only its user can enter; the trainer connects, presents the offer's
random token (which reached it through Ray, like the group secret) and
receives every descriptor. The offer serves exactly one process that presents
the token and runs under the same user (`SO_PEERCRED`), drops any other
connection, and ends after `timeout_s` either way, closing its own copies.

Typical use::

    offer = FdOffer(fds, timeout_s=60)                        # exporter
    fds = receive_fds(offer.path, offer.token, len(fds), 60)  # importer
    offer.close()
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Sequence

BATCH = 250
"""Descriptors per message (the kernel's SCM_MAX_FD is 253)."""
_TOKEN = 32
_CRED = struct.Struct("3i")


class FdOffer:
    """Serve `fds` (owned from now on: closed when served, timed out or closed) to the first
    same-user process that presents `token` on `path` within `timeout_s` seconds."""

    def __init__(self, fds: Sequence[int], timeout_s: float):
        self.fds, self.token = list(fds), secrets.token_bytes(_TOKEN)
        self._dir = tempfile.mkdtemp(prefix="rl-sync-fds-")  # mode 0700: only this user can connect
        self.path = os.path.join(self._dir, "s")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.bind(self.path)
        self._sock.listen(8)
        self._deadline = time.monotonic() + timeout_s
        self.served = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rl-sync-fd-offer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self.served.is_set():
                left = self._deadline - time.monotonic()
                if left <= 0:
                    return
                try:
                    self._sock.settimeout(left)
                    conn, _ = self._sock.accept()
                except OSError:  # timed out, or closed under us
                    return
                with conn:
                    if self._admit(conn):
                        self._send(conn)
                        self.served.set()
        finally:
            self._release()

    def _admit(self, conn: socket.socket) -> bool:
        conn.settimeout(max(0.1, self._deadline - time.monotonic()))
        try:
            _, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
            token = conn.recv(_TOKEN)
        except OSError:
            return False
        return uid == os.getuid() and hmac.compare_digest(token, self.token)

    def _send(self, conn: socket.socket) -> None:
        for start in range(0, len(self.fds), BATCH):
            batch = self.fds[start : start + BATCH]
            socket.send_fds(conn, [struct.pack("!I", len(batch))], batch)
        conn.recv(1)  # the receiver's acknowledgement: every descriptor arrived

    def _release(self) -> None:
        while self.fds:
            os.close(self.fds.pop())
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        """Stop offering and close what was not served (waits for the serving thread)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)


def receive_fds(path: str, token: bytes, count: int, timeout_s: float) -> list[int]:
    """Every descriptor an `FdOffer` at `path` holds (`count` of them), within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    got: list[int] = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
            sock.sendall(token)
            while len(got) < count:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                data, fds, flags, _ = socket.recv_fds(sock, 4, BATCH)
                got += fds
                if not data or flags & socket.MSG_CTRUNC or struct.unpack("!I", data)[0] != len(fds):
                    raise ConnectionError(f"the descriptor offer at {path} ended after {len(got)} of {count}")
            sock.sendall(b"\x01")
        except BaseException as exc:
            for fd in got:
                os.close(fd)
            if isinstance(exc, OSError):
                raise ConnectionError(f"receiving {count} descriptors from {path} failed: {exc}") from None
            raise
    return got
