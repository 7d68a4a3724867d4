"""A colocated pair's shared page (`rl_sync.transport.doorbell`) and the trainers' agreement
(`rl_sync.rank.pairing.agree`): across processes, bounded, refusing what does not fit."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest

from rl_sync.rank.pairing import agree
from rl_sync.transport.doorbell import (
    FAILED,
    MOVED,
    PAGE,
    READY,
    SKIPPED,
    TRAINER,
    WORKER,
    WRITTEN,
    Doorbell,
)
from rl_sync.transport.gloo import GlooTransport
from tests.unit.test_rendezvous import in_threads

FORK = multiprocessing.get_context("fork")


def _trainer(fd: int, tickets: list[int], answer: int, done) -> None:
    """A trainer process: for each ticket, wait for the worker's word, then answer it."""
    peer = Doorbell.attach(fd, TRAINER)
    try:
        for ticket in tickets:
            state = peer.wait(WORKER, ticket, time.monotonic() + 20)
            peer.ring(TRAINER, ticket, answer if state == READY else SKIPPED)
        done.wait(20)
    finally:
        peer.close()


def test_each_side_waits_for_the_other_across_processes():
    bell = Doorbell.create()
    done = FORK.Event()
    child = FORK.Process(target=_trainer, args=(os.dup(bell.fd), [3, 4], WRITTEN, done))
    child.start()
    try:
        bell.ring(WORKER, 3, READY)
        assert bell.wait(TRAINER, 3, time.monotonic() + 20) == WRITTEN
        assert bell.state(TRAINER, 4) is None, "ticket 4 not reached yet"
        bell.ring(WORKER, 4, MOVED)
        assert bell.wait(TRAINER, 4, time.monotonic() + 20) == SKIPPED
    finally:
        done.set()
        child.join(20)
        bell.close()
    assert child.exitcode == 0


def test_a_wait_ends_at_its_deadline():
    bell = Doorbell.create()
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match=r"^colocated round ticket 7: the trainer did not reach it before"):
            bell.wait(TRAINER, 7, start + 0.3)
        assert 0.3 <= time.monotonic() - start < 5
    finally:
        bell.close()


def _attach_and_exit(fd: int) -> None:
    Doorbell.attach(fd, TRAINER)


def test_a_wait_ends_once_the_peer_process_is_gone():
    bell = Doorbell.create()
    child = FORK.Process(target=_attach_and_exit, args=(os.dup(bell.fd),))
    child.start()
    child.join(20)
    try:
        start = time.monotonic()
        gone = rf"^colocated round ticket 2: the trainer \(process {child.pid}\) is gone$"
        with pytest.raises(ConnectionError, match=gone):
            bell.wait(TRAINER, 2, start + 20)
        assert time.monotonic() - start < 5, "the peer's death ends the wait, not the deadline"
    finally:
        bell.close()


def test_words_name_their_ticket_and_side():
    bell = Doorbell.create()
    try:
        assert bell.state(TRAINER, 1) is None
        with pytest.raises(ValueError, match=r"^the worker's doorbell rings only its own word, not the trainer's$"):
            bell.ring(TRAINER, 1, WRITTEN)
        bell.ring(WORKER, 5, FAILED)
        assert bell.state(WORKER, 5) == FAILED and bell.state(WORKER, 6) is None
        with pytest.raises(RuntimeError, match=r"^the worker's doorbell names ticket 5, after ticket 4: a later round"):
            bell.state(WORKER, 4)
    finally:
        bell.close()
        bell.close()  # idempotent


def test_a_descriptor_of_another_size_is_refused():
    fd = os.memfd_create("not-a-doorbell")
    os.ftruncate(fd, PAGE * 2)
    refused = rf"^a doorbell page is {PAGE} bytes; the descriptor received holds {PAGE * 2}$"
    with pytest.raises(ValueError, match=refused):
        Doorbell.attach(fd, TRAINER)


def test_trainers_agree_only_when_every_one_says_go(served):
    server, secret = served

    def join(r: int) -> GlooTransport:
        return GlooTransport(r, 3, "127.0.0.1", server.port, secret, bind_host="127.0.0.1", prefix="a", timeout_s=20)

    groups = in_threads(join, 3)
    for votes in ([True, True, True], [True, False, True], [False, False, False]):
        out = in_threads(lambda r: agree(groups[r], votes[r], time.monotonic() + 20), 3)
        assert out == [all(votes)] * 3, votes
    for g in groups:
        g.close()


def test_a_group_of_one_agrees_with_itself():
    class One:
        world_size, rank = 1, 0

    assert agree(One(), True, time.monotonic() + 1) is True
    assert agree(One(), False, time.monotonic() + 1) is False
