"""Unit-test fixtures shared by several files: the watch's two passes, a rendezvous store."""

from __future__ import annotations

import socket

import pytest

from rl_sync.rank import native
from rl_sync.rendezvous import StoreServer, new_secret


@pytest.fixture(params=["C scan", "Python pass"])
def each_scan(request, monkeypatch) -> str:
    """Run a test once with the watch's C scan (which must build on this machine) and once with
    its Python pass."""
    if request.param == "Python pass":
        monkeypatch.setattr(native, "scan", lambda: None)
    else:
        assert native.scan() is not None, "the C scan of rl_sync.rank.native builds and loads here"
    return request.param


@pytest.fixture
def served():
    """A rendezvous store on loopback, and the secret its members hold: `(server, secret)`."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    secret = new_secret()
    server = StoreServer(sock, secret)
    yield server, secret
    server.close()
