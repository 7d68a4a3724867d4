"""One rank's end of the service protocol, outside vLLM: run a call, answer it in the store.

A rank of a led group (`rl_sync.lead`) that runs in a process of its own (a
trainer rank other than 0, a framework's rollout rank) gets the same calls a
vLLM engine's rank gets through vLLM (`rl_sync.vllm.service`): `describe`,
`connect`, `run`, `commit`, `close`. `RankHandler` runs each on its
`Participant` and answers under `reply_key(prefix, op, tag, index)`: the
result, or `ERROR` and the encoded failure, which it then raises here too.

Typical use (a follower, see `rl_sync.lead.follower`)::

    handler = RankHandler(rank, side="trainer", index=0)
    handler.handle(*posts.next(timeout_s=60))
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from ..rank import TrainerRank, WorkerRank
from ..rank.side import DescribeOptions
from ..vllm.service import (
    ERROR,
    CloseRequest,
    ConnectRequest,
    DescribeRequest,
    Op,
    Rendezvous,
    RoundRequest,
    reply_key,
    store_client,
)
from ..wire.codec import decode, encode
from ..wire.failure import RankFailure
from ..wire.messages import RankReport
from .board import REQUESTS, Request


def answer(reply: Rendezvous, key: str, work: Callable[[], bytes]) -> None:
    """Run `work` and set its result, or what failed, under `key` where the leader waits;
    a failure is raised here as well."""
    store = store_client(reply)
    try:
        try:
            value = work()
        except Exception as exc:
            store.set(key, ERROR + encode(RankFailure.of(exc)))
            raise
        store.set(key, value)
    finally:
        store.close()


class RankHandler:
    """Runs the calls the leader posts on `rank`, which plays `side`; `index`: this rank among
    the ranks the leader reaches through one driver (its answer key)."""

    def __init__(self, rank: TrainerRank | WorkerRank, side: Literal["trainer", "worker"], index: int):
        self.rank, self.side, self.index = rank, side, index
        self.device = "cpu"

    def handle(self, op: Op, message: bytes) -> None:
        request: Request = decode(REQUESTS[op], message)
        tag = request.version if isinstance(request, RoundRequest) else getattr(request, "tag", 0)
        work = getattr(self, f"_{op}")
        answer(request.reply, reply_key(request.reply.prefix, op, tag, self.index), lambda: work(request))

    def _describe(self, request: DescribeRequest) -> bytes:
        options = DescribeOptions(
            checkpoint={n: (d, tuple(s)) for n, (d, s) in request.checkpoint.items()},
            sharded={n: tuple(d) for n, d in request.sharded.items()},
            double_buffer=request.double_buffer,
        )
        report = self.rank._rl_sync_describe(self.side, request.first + self.index, request.side_size, options)
        self.device = decode(RankReport, report).device
        return report

    def _connect(self, request: ConnectRequest) -> bytes:
        self.rank._rl_sync_connect(request.inits[self.index], request.plan, request.bind_host, self.device)
        return b""

    def _run(self, request: RoundRequest) -> bytes:
        return self.rank._rl_sync_run(request.round)

    def _commit(self, request: RoundRequest) -> bytes:
        assert isinstance(self.rank, WorkerRank)  # the leader asks workers only to commit
        self.rank._rl_sync_commit(request.version)
        return b""

    def _close(self, request: CloseRequest) -> bytes:
        self.rank._rl_sync_close(abort=request.abort)
        return b""
