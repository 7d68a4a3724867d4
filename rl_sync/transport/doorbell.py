"""A colocated pair's host handshake: one shared page between a worker and its trainer.

A colocated round (`rl_sync.transport.cuda_ipc`) has two host steps that must
happen in order across two processes: the worker checks what it binds (its
watch) and marks its last reads of the old weights before its trainer writes;
the trainer's writes are issued before the worker reads again. CUDA events
order the device work; this page orders the host steps, so the coordinator can
start both sides of a round at once rather than one after the other (one Ray
call each, not three in turn).

The page is a `memfd` the worker creates with its export and hands over with
it (`rl_sync.transport.fd_passing`). Each side writes only its own word, as one
aligned 8-byte store: the round's ticket (`RoundInfo.ticket`, a number the
coordinator gives each colocated round, larger than any before it, so a round
run again under the same version never reads an earlier attempt's word) and a
state (`READY`, `READY_ALTERNATE`, `MOVED`, `FAILED` for the worker; `WRITTEN`,
`SKIPPED`, `FAILED` for the trainer). The other side polls it (yielding the core for the first
milliseconds, then sleeping 100 µs at a time) until the word names the round,
its deadline passes (`TimeoutError`), or its peer process is found gone
(`ConnectionError`: each side writes its process id, start time and process-id
namespace, and a peer in this process's namespace is gone once `/proc` no
longer shows that process; in another namespace only the deadline bounds the
wait).

Typical use::

    bell = Doorbell.create()                         # worker, with its export
    fd = bell.fd                                     # handed to the trainer
    peer = Doorbell.attach(fd, TRAINER)              # trainer
    bell.ring(WORKER, ticket, READY)                 # worker: checked, ready event recorded
    peer.wait(WORKER, ticket, deadline)              # trainer: READY (or MOVED / FAILED)
    peer.ring(TRAINER, ticket, WRITTEN)              # trainer: writes issued, done event recorded
    bell.wait(TRAINER, ticket, deadline)             # worker: WRITTEN (or SKIPPED / FAILED)
    bell.close(); peer.close()
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from typing import Literal

Side = Literal["worker", "trainer"]
WORKER: Side = "worker"
TRAINER: Side = "trainer"

READY, MOVED, FAILED, READY_ALTERNATE = 1, 2, 3, 4
"""The worker's states: checked and ready for writes; its memory moved (the trainer must map a new
export before writing); it failed before the writes (nothing may be written); ready for writes
into its export's alternate face (`rl_sync.transport.cuda_ipc`: after an odd number of commits
that swapped its shadows with its live weights)."""
READIES = (READY, READY_ALTERNATE)
WRITTEN, SKIPPED = 1, 2
"""The trainer's states (and `FAILED`): its writes are issued and its done event recorded; it wrote
nothing (its group agreed to skip the round); it failed (some writes may have landed)."""

PAGE = 4096
_WORD = struct.Struct("=q")
_OFFSETS = {WORKER: 0, TRAINER: 64}
"""Each side's word, on a cache line of its own; its process id, start time and process-id namespace
follow it."""
_IDENTITY = struct.Struct("=qqq")
SPIN_S = 0.002
SLEEP_S = 0.0001
ALIVE_EVERY_S = 0.1


def _namespace() -> int:
    """This process's process-id namespace (the inode of its `/proc` entry), or 0 if unknown."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int) -> int | None:
    """The start time of process `pid` as this process's `/proc` shows it, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[19])


class Doorbell:
    """One side's view of the shared page (see the module docstring)."""

    def __init__(self, fd: int, side: Side):
        self.fd, self.side = fd, side
        self._page = mmap.mmap(fd, PAGE)
        self._write_identity()

    @classmethod
    def create(cls) -> Doorbell:
        """A new page, for the worker (it owns `fd` and hands a copy over with its export)."""
        fd = os.memfd_create("rl-sync-doorbell", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, PAGE)
            return cls(fd, WORKER)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, fd: int, side: Side) -> Doorbell:
        """The page behind `fd` (received from the worker; owned from now on), as `side`."""
        size = os.fstat(fd).st_size
        if size != PAGE:
            os.close(fd)
            raise ValueError(f"a doorbell page is {PAGE} bytes; the descriptor received holds {size}")
        try:
            return cls(fd, side)
        except BaseException:
            os.close(fd)
            raise

    def _write_identity(self) -> None:
        pid = os.getpid()
        _IDENTITY.pack_into(self._page, _OFFSETS[self.side] + 8, pid, _start_time(pid) or 0, _namespace())

    def ring(self, side: Side, ticket: int, state: int) -> None:
        """Write `side`'s word: round `ticket` reached `state`."""
        if side != self.side:
            raise ValueError(f"the {self.side}'s doorbell rings only its own word, not the {side}'s")
        _WORD.pack_into(self._page, _OFFSETS[side], ticket << 4 | state)

    def state(self, side: Side, ticket: int) -> int | None:
        """`side`'s state for round `ticket`, or None while its word names an earlier round."""
        word = _WORD.unpack_from(self._page, _OFFSETS[side])[0]
        if word >> 4 > ticket:
            raise RuntimeError(
                f"the {side}'s doorbell names ticket {word >> 4}, after ticket {ticket}: a later round ran"
            )
        return word & 15 if word >> 4 == ticket else None

    def wait(self, side: Side, ticket: int, deadline: float) -> int:
        """`side`'s state once its word names round `ticket`; `TimeoutError` past `deadline` (a
        `time.monotonic()` value), `ConnectionError` once the peer process is gone."""
        spin_until = time.monotonic() + SPIN_S
        alive_at = time.monotonic() + ALIVE_EVERY_S
        while True:
            state = self.state(side, ticket)
            if state is not None:
                return state
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"colocated round ticket {ticket}: the {side} did not reach it before the deadline")
            if now > alive_at:
                self._check_alive(side, ticket)
                alive_at = now + ALIVE_EVERY_S
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(SLEEP_S)

    def _check_alive(self, side: Side, ticket: int) -> None:
        pid, started, namespace = _IDENTITY.unpack_from(self._page, _OFFSETS[side] + 8)
        if pid <= 0 or not started or not namespace or namespace != _namespace():
            return  # (not attached yet, or where this process cannot see it: only the deadline bounds the wait)
        if _start_time(pid) != started:
            raise ConnectionError(f"colocated round ticket {ticket}: the {side} (process {pid}) is gone")

    def close(self) -> None:
        """Unmap the page and close its descriptor (idempotent)."""
        if not self._page.closed:
            self._page.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
