"""Unit-test fixtures shared by the watch's tests."""

from __future__ import annotations

import pytest

from rl_sync.rank import native


@pytest.fixture(params=["C scan", "Python pass"])
def each_scan(request, monkeypatch) -> str:
    """Run a test once with the watch's C scan (which must build on this machine) and once with
    its Python pass."""
    if request.param == "Python pass":
        monkeypatch.setattr(native, "scan", lambda: None)
    else:
        assert native.scan() is not None, "the C scan of rl_sync.rank.native builds and loads here"
    return request.param
