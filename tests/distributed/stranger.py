"""A stranger on the network: a plain process that imports neither Ray nor rl-sync.

Run as `python -I stranger.py HOST STORE_PORT LISTENER_PORT...` (STORE_PORT 0: no store; isolated mode:
nothing of the project is importable). It tries what issue 20 found a stranger
could do against the rendezvous store: read it as a `torch.distributed`
`TCPStore` client (listing and reading keys, writing forged records), speak
to it raw, then floods it and the ranks' Gloo listeners with bounded numbers
of short connections. Prints one JSON object saying what it got; loopback
only, bounded in time.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from datetime import timedelta

STORE_FLOOD = 500
LISTENER_FLOOD = 100


def as_torch_client(host: str, port: int) -> str:
    """What a TCPStore client gets: the keys, or the error that stopped it."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=3))
        store.set("rl-sync-forged/0", "\x00" * 64)
        return f"listed {store.list_keys()!r}"
    except Exception as exc:
        return f"refused: {type(exc).__name__}"


def raw_reply(host: str, port: int, payload: bytes) -> bytes:
    """Bytes the store sends back to `payload` before it closes the connection (at most 4 KiB)."""
    with socket.create_connection((host, port), timeout=10) as sock:
        sock.sendall(payload)
        got = b""
        try:
            while len(got) < 4096:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def flood(host: str, port: int, count: int) -> int:
    """Open and close `count` connections, each sending junk; returns how many connected."""
    connected = 0
    for _ in range(count):
        try:
            with socket.create_connection((host, port), timeout=2) as sock:
                sock.sendall(os.urandom(64))
                connected += 1
        except OSError:
            pass
    return connected


def listening_sockets(_actor=None) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket the calling process listens on (run inside a rank's
    actor, before and after it joins a group, to find what the group opened)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                out.append(sock.getsockname()[:2])
        except OSError:
            pass
        finally:
            sock.detach()
    return out


def listening_ports(_actor=None) -> set[int]:
    """The ports of `listening_sockets`."""
    return {port for _, port in listening_sockets()}


def run_stranger(store_port: int, listeners) -> dict:
    """Run this file as an isolated stranger process against 127.0.0.1; its report."""
    import subprocess

    run = subprocess.run(
        [sys.executable, "-I", __file__, "127.0.0.1", str(store_port), *map(str, sorted(listeners))],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return json.loads(run.stdout)


def main() -> None:
    host, store_port, listeners = sys.argv[1], int(sys.argv[2]), [int(p) for p in sys.argv[3:]]
    report = {}
    if store_port:  # 0: the group has no store (NCCL ids travel through Ray)
        hello = b"rl-sync-store/1\n" + os.urandom(32)
        report = {
            "torch_client": as_torch_client(host, store_port),
            "junk_reply": raw_reply(host, store_port, b"GET / HTTP/1.0\r\n\r\n" + os.urandom(64)).hex(),
            # the right greeting, then a guessed proof: the store's own proof (random to us) comes back, nothing else
            "guessed_proof_reply_bytes": len(raw_reply(host, store_port, hello + os.urandom(32))),
            "store_flood": flood(host, store_port, STORE_FLOOD),
        }
    report["listener_flood"] = sum(flood(host, port, LISTENER_FLOOD) for port in listeners)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
