"""Descriptor offers (`rl_sync.transport.fd_passing`): one taker, with the token, same user, bounded."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import pytest

from rl_sync.transport import fd_passing
from rl_sync.transport.fd_passing import BATCH, FdOffer, receive_fds


def _pipes(count: int) -> tuple[list[int], list[int], set[str]]:
    """`count` pipes: their read ends, write ends, and the links (`pipe:[inode]`) that any
    descriptor of them shows in /proc/self/fd."""
    pairs = [os.pipe() for _ in range(count)]
    links = {os.readlink(f"/proc/self/fd/{r}") for r, _ in pairs}
    return [r for r, _ in pairs], [w for _, w in pairs], links


def _still_open(links: set[str]) -> list[str]:
    """The descriptors of this process that still refer to the pipes of `links`. Counted by
    what they refer to, not in all: other threads of the process (Ray's, in a pytest worker
    that ran distributed tests) open and close descriptors meanwhile."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in links:
                held.append(fd)
        except FileNotFoundError:  # closed since the listing
            pass
    return held


def test_every_descriptor_arrives_in_order_across_batches_and_the_offer_closes_its_copies():
    reads, writes, links = _pipes(BATCH + 7)
    offer = FdOffer(reads, timeout_s=30)
    assert stat.S_IMODE(os.stat(os.path.dirname(offer.path)).st_mode) == 0o700
    got = receive_fds(offer.path, offer.token, len(reads), timeout_s=30)
    assert offer.served.wait(5)
    offer.close()
    assert not os.path.exists(offer.path)
    for i, (fd, w) in enumerate(zip(got, writes)):
        os.write(w, i.to_bytes(2, "big"))
        assert int.from_bytes(os.read(fd, 2), "big") == i
    for fd in got + writes:
        os.close(fd)
    assert _still_open(links) == []


def test_another_process_receives_a_descriptor_and_writes_through_it():
    read, write = os.pipe()
    offer = FdOffer([write], timeout_s=30)
    child = (
        f"import importlib.util, os; spec = importlib.util.spec_from_file_location('fdp', {fd_passing.__file__!r}); "
        f"m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
        f"fd, = m.receive_fds({offer.path!r}, bytes.fromhex({offer.token.hex()!r}), 1, 30); "
        f"os.write(fd, b'from the child'); os.close(fd)"
    )
    subprocess.run([sys.executable, "-I", "-c", child], check=True, timeout=60)  # no torch: the module alone
    assert offer.served.wait(5)
    offer.close()
    assert os.read(read, 64) == b"from the child"
    os.close(read)


def test_a_wrong_token_gets_nothing_and_the_right_one_still_does():
    reads, writes, _ = _pipes(3)
    offer = FdOffer(reads, timeout_s=30)
    with pytest.raises(ConnectionError, match=r"ended after 0 of 3"):
        receive_fds(offer.path, b"x" * 32, 3, timeout_s=5)
    assert not offer.served.is_set()
    got = receive_fds(offer.path, offer.token, 3, timeout_s=30)
    offer.close()
    assert len(got) == 3
    for fd in got + writes:
        os.close(fd)


def test_an_offer_nobody_takes_closes_its_descriptors_when_it_times_out():
    reads, writes, links = _pipes(4)
    offer = FdOffer(reads, timeout_s=0.3)
    deadline = time.monotonic() + 10
    while os.path.exists(offer.path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(offer.path)
    with pytest.raises(ConnectionError, match=r"receiving 4 descriptors from .* failed"):
        receive_fds(offer.path, offer.token, 4, timeout_s=1)
    offer.close()
    for fd in writes:
        os.close(fd)
    assert _still_open(links) == []


def test_closing_an_offer_withdraws_it_at_once():
    reads, writes, links = _pipes(2)
    offer = FdOffer(reads, timeout_s=60)
    start = time.monotonic()
    offer.close()
    assert time.monotonic() - start < 5 and not os.path.exists(offer.path)
    for fd in writes:
        os.close(fd)
    assert _still_open(links) == []
