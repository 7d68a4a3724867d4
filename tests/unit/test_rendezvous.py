"""The rendezvous store admits members only, and Gloo forms its group on it."""

from __future__ import annotations

import socket
import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from rl_sync.engine.runner import deadline_in
from rl_sync.rendezvous import AuthError, MemberStore, new_secret
from rl_sync.rendezvous.auth import MAX_FRAME, Sealer
from rl_sync.transport.gloo import GlooTransport


def in_threads(fn, n: int) -> list:
    out, errors = [None] * n, []

    def run(i):
        try:
            out[i] = fn(i)
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return out


def test_gloo_forms_on_the_member_store_and_moves_bytes_exactly(served):
    server, secret = served
    transports = in_threads(
        lambda r: GlooTransport(
            r, 2, "127.0.0.1", server.port, secret, bind_host="127.0.0.1", prefix="g", timeout_s=20
        ),
        2,
    )
    payload, out = torch.randint(0, 256, (1000,), dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    sent = transports[0].post([(1, payload)], [])
    got = transports[1].post([], [(0, out)])
    sent.wait(deadline_in(30))
    got.wait(deadline_in(30))
    assert torch.equal(payload, out)
    for t in transports:
        t.close()


def test_a_client_without_the_secret_is_refused_and_learns_nothing(served):
    server, _ = served
    with pytest.raises(
        AuthError, match=r"^the rendezvous store at \('127.0.0.1', \d+\) does not hold the group's secret$"
    ):
        MemberStore("127.0.0.1", server.port, new_secret(), timeout_s=5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"\x00" * 200)
        assert sock.recv(100) == b"", "junk gets the connection closed, nothing else"
    assert server.refused == 2


def test_store_operations_bounds_and_timeouts(served):
    server, secret = served
    store = MemberStore("127.0.0.1", server.port, secret, timeout_s=5)
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.check(["a"]) and not store.check(["a", "b"])
    assert store.delete_key("a") and not store.delete_key("a")
    store.set_timeout(timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match=r"rendezvous store 127.0.0.1:\d+: no value for 'b' within 0.2 s"):
        store.get("b")
    with pytest.raises(ValueError, match=r"store keys are str of 1 to 1024 characters, got str"):
        store.set("k" * 1025, b"")
    with pytest.raises(ValueError, match=rf"a rendezvous frame holds at most {MAX_FRAME} bytes, got \d+"):
        store.set("big", bytes(MAX_FRAME))
    store.set("after", b"still served")  # a refused request leaves the connection usable
    assert store.get("after") == b"still served"


def test_a_frame_altered_or_replayed_is_dropped():
    secret, cn, sn = new_secret(), b"c" * 32, b"s" * 32
    client, server = Sealer(secret, cn, sn, client=True), Sealer(secret, cn, sn, client=False)
    frame = client.seal(b"hello")
    body, mac = frame[4:-32], frame[-32:]
    assert server.open(body, mac) == b"hello"
    with pytest.raises(AuthError, match=r"failed its digest \(altered, replayed or out of order\)"):
        server.open(body, mac)  # replayed
    frame = client.seal(b"hellp")
    with pytest.raises(AuthError):
        server.open(b"hello", frame[-32:])  # altered
    reflected = server.seal(b"x")
    with pytest.raises(AuthError):
        Sealer(secret, cn, sn, client=False).open(reflected[4:-32], reflected[-32:])  # sent back to its sender


def test_a_flood_of_strangers_leaves_members_served(served):
    server, secret = served
    for _ in range(500):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
            sock.sendall(b"rl-sync-store/1\n")  # an unfinished greeting
    store = MemberStore("127.0.0.1", server.port, secret, timeout_s=10)
    store.set("x", b"y")
    assert store.get("x") == b"y"
