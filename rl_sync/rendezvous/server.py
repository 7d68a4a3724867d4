"""The rendezvous store the coordinator hosts: a small key-value store for members only.

It serves on a socket the caller has bound (the coordinator's node address,
never all interfaces), from an event loop on one daemon thread, so a flood of
connections costs a socket each and no thread. Until a connection has passed
the handshake (`auth`) it gets nothing; at most `MAX_UNPROVEN` connections
from one address may be in the handshake at once (more are closed on
arrival, so a flood from elsewhere never crowds out members), and each has
`HANDSHAKE_S` seconds. Requests (msgpack lists)::

    ["set", key, value]  ["get", key, timeout_s]  ["wait", keys, timeout_s]
    ["check", keys]      ["delete", key]

Replies: `["ok", result]`, `["timeout", message]` or `["error", message]`.
Keys are at most `MAX_KEY` characters and the store holds at most
`MAX_STORE_BYTES`.

Typical use::

    server = StoreServer(listening_socket, secret)
    ... ranks connect with `MemberStore(host, server.port, secret, timeout_s=...)` ...
    server.close()
"""

from __future__ import annotations

import asyncio
import hmac
import os
import socket
import threading

import msgpack

from .auth import HANDSHAKE_S, HELLO, MAC, NONCE, AuthError, Sealer, check_secret, frame_length, proof

MAX_UNPROVEN = 64
MAX_KEY = 1024
MAX_KEYS = 1 << 16
MAX_STORE_BYTES = 1 << 30
MAX_WAIT_S = 7 * 24 * 3600.0
_BROKEN = (AuthError, ConnectionError, OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError)


class StoreServer:
    """Serves the store on `sock` (bound and listening) for holders of `secret`."""

    def __init__(self, sock: socket.socket, secret: bytes):
        self._secret = check_secret(secret)
        self._data: dict[str, bytes] = {}
        self._bytes = 0
        self._unproven: dict[str, int] = {}
        self.refused = 0
        """Connections closed because they did not pass the handshake (or arrived in a flood)."""
        self._writers: set[asyncio.StreamWriter] = set()
        self.host, self.port = sock.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rl-sync-store", daemon=True)
        self._thread.start()
        self._changed = asyncio.Condition()
        started = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._serve, sock=sock), self._loop)
        self._server = started.result(timeout=10)

    def close(self) -> None:
        """Stop serving and drop every connection; idempotent, bounded by a few seconds."""
        if self._loop.is_closed():
            return
        done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
        try:
            done.result(timeout=5)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if not self._thread.is_alive():
                self._loop.close()

    async def _shutdown(self) -> None:
        self._server.close()
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        address = str((writer.get_extra_info("peername") or ("?",))[0])
        if self._unproven.get(address, 0) >= MAX_UNPROVEN:
            self.refused += 1
            writer.close()
            return
        self._unproven[address] = self._unproven.get(address, 0) + 1
        try:
            sealer = await asyncio.wait_for(self._handshake(reader, writer), HANDSHAKE_S)
        except _BROKEN:
            self.refused += 1
            writer.close()
            return
        finally:
            self._unproven[address] -= 1
            if not self._unproven[address]:
                del self._unproven[address]
        self._writers.add(writer)
        try:
            await self._requests(reader, writer, sealer)
        except _BROKEN:
            pass  # the member went away, or sent a frame that failed its digest: drop it
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Sealer:
        hello = await reader.readexactly(len(HELLO) + NONCE)
        if hello[: len(HELLO)] != HELLO:
            raise AuthError("not an rl-sync store client")
        cn, sn = hello[len(HELLO) :], os.urandom(NONCE)
        writer.write(sn + proof(self._secret, b"server", cn, sn))
        await writer.drain()
        answer = await reader.readexactly(MAC)
        if not hmac.compare_digest(answer, proof(self._secret, b"client", cn, sn)):
            raise AuthError("the client does not hold the group's secret")
        return Sealer(self._secret, cn, sn, client=False)

    async def _requests(self, reader, writer, sealer: Sealer) -> None:
        while True:
            body = await reader.readexactly(frame_length(await reader.readexactly(4)))
            request = msgpack.unpackb(sealer.open(body, await reader.readexactly(MAC)), raw=False)
            writer.write(sealer.seal(msgpack.packb(await self._answer(request), use_bin_type=True)))
            await writer.drain()

    async def _answer(self, request) -> list:
        try:
            return ["ok", await self._apply(request)]
        except asyncio.TimeoutError:
            return ["timeout", f"no value for {request[1]!r} within {request[2]} s"]
        except (ValueError, TypeError, IndexError) as exc:
            return ["error", str(exc)]

    async def _apply(self, request: list):
        op = request[0]
        if op == "set":
            return await self._set(_key(request[1]), request[2])
        if op in ("get", "wait"):
            keys = [_key(request[1])] if op == "get" else [_key(k) for k in request[1]]
            async with self._changed:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: all(k in self._data for k in keys)), _wait_s(request[2])
                )
            return self._data[keys[0]] if op == "get" else None
        if op == "check":
            return all(_key(k) in self._data for k in request[1])
        if op == "delete":
            value = self._data.pop(_key(request[1]), None)
            self._bytes -= len(value or b"")
            return value is not None
        raise ValueError(f"unknown store operation {op!r}")

    async def _set(self, key: str, value) -> None:
        if not isinstance(value, bytes):
            raise TypeError(f"store values are bytes, got {type(value).__name__}")
        grown = self._bytes + len(value) - len(self._data.get(key, b""))
        if grown > MAX_STORE_BYTES or (key not in self._data and len(self._data) >= MAX_KEYS):
            raise ValueError(f"the store is full ({len(self._data)} keys, {self._bytes} bytes)")
        async with self._changed:
            self._data[key], self._bytes = value, grown
            self._changed.notify_all()


def _key(key) -> str:
    if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY:
        raise ValueError(f"store keys are str of 1 to {MAX_KEY} characters, got {type(key).__name__}")
    return key


def _wait_s(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_WAIT_S:
        raise ValueError(f"a store wait takes (0, {MAX_WAIT_S:.0f}] seconds, got {value!r}")
    return float(value)
