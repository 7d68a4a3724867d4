"""Unit-test fixtures shared by several files: the watch's two passes, the two memory swaps, a
rendezvous store."""

from __future__ import annotations

import socket

import pytest
import torch

from rl_sync.rank import native, swap
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


@pytest.fixture(params=["PyTorch's swap", "C++ swap"])
def each_swap(request, monkeypatch) -> str:
    """Run a test once with PyTorch's exchange of storages' memory (skipped where this PyTorch
    lacks it) and once with rl-sync's C++ module (which must build on this machine), as PyTorch
    releases without it swap."""
    if request.param == "C++ swap":
        assert swap._native() is not None, "the C++ swap of rl_sync.rank.native builds and loads here"
        monkeypatch.setattr(swap, "_swapper", swap._native)
    elif not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        pytest.skip("this PyTorch has no UntypedStorage._swap_data_ptr_")
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
