"""Gloo transport: CPU tensors over `torch.distributed.ProcessGroupGloo`.

The group is built on the coordinator's rendezvous store (`rl_sync.rendezvous`:
members only, every record authenticated) under a per-group prefix, so it is
independent of any default process group the user's trainer already has. Each rank binds its Gloo device to `bind_host`
(its own node address; `127.0.0.1` in tests). Every wait has a deadline;
Gloo's own timeout is set to the same bound so a stalled peer fails the round
instead of hanging it.

A rank joins from a `GlooRendezvous` (the store's address) through the
registry, or builds one directly. Typical use::

    t = GlooTransport(rank, world, store_host, store_port, secret, bind_host="127.0.0.1",
                      prefix="sync-0", timeout_s=60, broadcast_ranks=[0, 2, 3])
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config.sync import check_port
from ..rendezvous import MemberStore
from .base import Ops, Pending, Transport, check_ops, remaining


@dataclass(frozen=True)
class GlooRendezvous:
    """How a rank joins a Gloo group: the address of the coordinator's rendezvous store
    (`rl_sync.rendezvous`), which the group's secret opens."""

    store_host: str
    store_port: int

    def __post_init__(self) -> None:
        if not self.store_host:
            raise ValueError("GlooRendezvous.store_host must name the store's address, got ''")
        check_port("GlooRendezvous.store_port", self.store_port, 1)


class _GlooPending(Pending):
    def __init__(self, works: list[tuple[int, dist.Work]], rank: int):
        self.works, self.rank = works, rank
        """(peer, work) of every transfer still in flight."""

    def wait(self, deadline: float) -> None:
        try:
            while self.works:
                left = remaining(deadline, f"rank {self.rank}: Gloo bucket")
                if not self.works[0][1].wait(timedelta(seconds=left)):
                    raise TimeoutError(f"rank {self.rank}: Gloo bucket did not complete in time")
                self.works.pop(0)
        except Exception as exc:
            peers = sorted({peer for peer, _ in self.works})
            self.works = []  # see `_finished`
            raise PeerError(f"transfers with rank(s) {peers} did not complete: {type(exc).__name__}: {exc}") from None


class PeerError(ConnectionError):
    """Transfers with these peers failed or timed out (a dead peer, a link down, a stall)."""


def _finished(work: dist.Work, seconds: float, what: str) -> None:
    """Wait for one Gloo work. Nothing here keeps a reference to it once it fails: Gloo closes a
    group's connections (which is what makes peers fail at once) only when the last work of the
    aborted group is gone, and a failed wait's frame lives on in the traceback."""
    if not work.wait(timedelta(seconds=seconds)):
        raise TimeoutError(f"{what} did not complete in time")


def _group(store, prefix: str, rank: int, size: int, bind_host: str, timeout_s: float):
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs lack _Options
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
    options._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


class GlooTransport(Transport):
    """Grouped send/recv of CPU byte tensors through Gloo."""

    rendezvous_type = GlooRendezvous

    def __init__(
        self,
        rank: int,
        world_size: int,
        store_host: str,
        store_port: int,
        secret: bytes,
        *,
        bind_host: str,
        prefix: str,
        timeout_s: float,
        join_timeout_s: float | None = None,
        broadcast_ranks: Sequence[int] = (),
    ):
        """`join_timeout_s` (default `timeout_s`) bounds joining: every rank connected, or
        `TimeoutError` / `RuntimeError` here, and nothing left open; `timeout_s` then bounds each
        wait of the group's operations."""
        self.rank, self.world_size, self.device = rank, world_size, torch.device("cpu")
        joining = timeout_s if join_timeout_s is None else join_timeout_s
        store = self._store = MemberStore(store_host, store_port, secret, timeout_s=joining)
        self.bcast_ranks = list(broadcast_ranks)
        self.bcast = None
        try:
            self.pg = _group(store, f"{prefix}/p2p/", rank, world_size, bind_host, joining)
            if rank in self.bcast_ranks:
                index = self.bcast_ranks.index(rank)
                self.bcast = _group(store, f"{prefix}/bcast/", index, len(self.bcast_ranks), bind_host, joining)
        except BaseException:
            store.close()
            raise
        for group in (self.pg, self.bcast):
            if group is not None:
                group.set_timeout(timedelta(seconds=timeout_s))
        store.set_timeout(timedelta(seconds=timeout_s))
        self._closed = False

    @classmethod
    def join(
        cls, info, rendezvous: GlooRendezvous, *, bind_host: str, device: torch.device, broadcast_ranks: Sequence[int]
    ) -> GlooTransport:
        return cls(
            info.rank,
            info.world_size,
            rendezvous.store_host,
            rendezvous.store_port,
            info.secret,
            bind_host=bind_host,
            prefix=info.prefix,
            timeout_s=info.timeout_s,
            join_timeout_s=info.join_timeout_s,
            broadcast_ranks=broadcast_ranks,
        )

    def post(self, sends: Ops, recvs: Ops, label: str = "") -> Pending:
        check_ops(sends, self.world_size, self.rank, "send")
        check_ops(recvs, self.world_size, self.rank, "receive")
        works: list[tuple[int, dist.Work]] = []
        for ops, start in ((sends, self.pg.send), (recvs, self.pg.recv)):
            counts: dict[int, int] = {}
            for peer, buf in ops:
                tag = counts.get(peer, 0)
                counts[peer] = tag + 1
                works.append((peer, start([buf], peer, tag)))
        return _GlooPending(works, self.rank)

    def broadcast(self, buf: torch.Tensor, root: int, deadline: float) -> None:
        if self.bcast is None:
            raise ValueError(f"rank {self.rank} is not in the broadcast group {self.bcast_ranks}")
        opts = dist.BroadcastOptions()
        opts.rootRank = self.bcast_ranks.index(root)
        _finished(
            self.bcast.broadcast([buf], opts),
            remaining(deadline, f"rank {self.rank}: broadcast"),
            f"rank {self.rank}: broadcast",
        )

    def barrier(self, deadline: float) -> None:
        _finished(self.pg.barrier(), remaining(deadline, f"rank {self.rank}: barrier"), f"rank {self.rank}: barrier")

    def close(self) -> None:
        self._release("shutdown")

    def abort(self) -> None:
        self._release("abort")

    def _release(self, how: str) -> None:
        """Shut down or abort, then drop the groups: destroying them closes their connections,
        which is what makes peers blocked on this rank fail at once instead of at their deadline."""
        if self._closed:
            return
        self._closed = True
        for group in (self.pg, self.bcast):
            if group is not None:
                with contextlib.suppress(RuntimeError):  # already broken: dropping it below is all that is left
                    getattr(group, how)()
        self.pg = self.bcast = None
        gc.collect()
        self._store.close()
