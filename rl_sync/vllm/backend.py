"""rl-sync as a vLLM weight-transfer backend: `weight_transfer_config={"backend": "rl_sync"}`.

vLLM loads the `vllm.general_plugins` entry point (`rl_sync.vllm.plugin`) in
every process it starts, which registers this engine; each of the engine's
workers then holds one `RlSyncTransferEngine` next to its live model. The
driver side (`actors.service`) reaches it only through vLLM's own calls, in
process (`LLM` / `AsyncLLM` methods) or over HTTP (`vllm serve` routes):

* `init_weight_transfer_engine({"op": "describe", ...})`: bind the trainers'
  checkpoint to this rank's live model (`rl_sync.vllm.rank`); `"connect"`: join
  the sync group; `"close"`: leave it;
* `start_weight_update()`, `update_weights({"op": "run", ...})` (one round; or
  `"stage"`, a round received on a thread of its own while the engine
  generates, answered when it ends; or `"commit"` for double buffering),
  `finish_weight_update()`.

Every answer goes to the group's rendezvous store (`rl_sync.vllm.service`),
since vLLM's calls return nothing. The worker side itself is the same
`WorkerRank` every other destination runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from ..engine.sources import Destination
from ..rank import WorkerRank
from ..rank.side import DescribeOptions
from ..wire.codec import decode, encode
from ..wire.failure import RankFailure
from . import compat
from .rank import VllmDestinations, engine_rank
from .service import (
    ERROR,
    CloseRequest,
    ConnectRequest,
    DescribeRequest,
    IpcRequest,
    Rendezvous,
    RoundRequest,
    reply_key,
    store_client,
    unpack,
)


@dataclass(kw_only=True)
class RlSyncInitInfo(WeightTransferInitInfo):
    """One `ServiceCall` (see `rl_sync.vllm.service`)."""

    op: str
    payload: str


@dataclass(kw_only=True)
class RlSyncUpdateInfo(WeightTransferUpdateInfo):
    """One `ServiceCall` (see `rl_sync.vllm.service`)."""

    op: str
    payload: str


class ServiceRank(WorkerRank):
    """A worker rank living in a vLLM worker process: destinations from its live model."""

    def __init__(self, destinations: VllmDestinations, side: tuple[int, int], sharded: dict, node: str):
        self.vllm, self.side, self.sharded, self.node = destinations, side, sharded, node
        self.bind_host = ""

    def _rl_sync_node(self) -> tuple[str, str]:
        """The node of the engine's host (where an `LLM` it owns runs its workers: a GPU's UUID
        names one physical GPU, so a wrong node can only hide a colocated trainer, never invent
        one) and the address rounds bind, set at connect."""
        return self.node, self.bind_host

    def rl_sync_destinations(self, checkpoint) -> dict[str, Destination]:
        return self.vllm.bind(checkpoint, *self.side, self.sharded)

    def rl_sync_load_fallbacks(self, pairs) -> None:
        self.vllm.load_fallbacks(pairs)

    def rl_sync_weights_updated(self, names) -> None:
        self.vllm.after_update(names)

    def rl_sync_write_modes(self) -> dict[str, str]:
        return self.vllm.write_modes()

    def rl_sync_swappable(self) -> list[str]:
        return self.vllm.swappable()

    def rl_sync_prepare(self, names, spare) -> None:
        self.vllm.prepare(names, spare)


class RlSyncTransferEngine(WeightTransferEngine[RlSyncInitInfo, RlSyncUpdateInfo]):
    """One vLLM worker's end of an rl-sync group (see the module docstring)."""

    init_info_cls = RlSyncInitInfo
    update_info_cls = RlSyncUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.rank: ServiceRank | None = None

    def _answer(self, reply: Rendezvous, op: str, tag: int, work: Callable[[], bytes]) -> bytes:
        """Run `work` and put its result, or what failed, where the driver waits for it."""
        key = reply_key(reply.prefix, op, tag, engine_rank().rank)
        try:
            value = work()
        except Exception as exc:
            _put(reply, key, ERROR + encode(RankFailure.of(exc)))
            raise
        _put(reply, key, value)
        return value

    def init_transfer_engine(self, init_info: RlSyncInitInfo) -> None:
        op, payload = unpack({"op": init_info.op, "payload": init_info.payload})
        if op == "describe":
            describe = decode(DescribeRequest, payload)
            self._answer(describe.reply, op, 0, lambda: self._describe(describe))
        elif op == "connect":
            connect = decode(ConnectRequest, payload)
            self._answer(connect.reply, op, 0, lambda: self._connect(connect))
        elif op == "close":
            close = decode(CloseRequest, payload)
            self._answer(close.reply, op, close.tag, lambda: self._close(close.abort))
        elif op == "ipc_export":
            export = decode(IpcRequest, payload)
            rank = self._described()
            self._answer(export.reply, op, 0, lambda: rank._rl_sync_ipc_export(str(self.device), export.timeout_s))
        else:
            raise ValueError(
                "rl_sync weight transfer: init_weight_transfer_engine takes describe, connect, close or "
                f"ipc_export, got {op!r}"
            )

    def _describe(self, request: DescribeRequest) -> bytes:
        where = engine_rank()
        if self.rank is not None:
            self.rank._rl_sync_close(abort=True)
        destinations = VllmDestinations(self.model, self.vllm_config)
        side = (request.first + where.rank, request.side_size)
        self.rank = ServiceRank(destinations, side, {k: list(v) for k, v in request.sharded.items()}, request.node)
        options = DescribeOptions(
            checkpoint={n: (d, tuple(s)) for n, (d, s) in request.checkpoint.items()},
            sharded={n: tuple(d) for n, d in request.sharded.items()},
            double_buffer=request.double_buffer,
        )
        return self.rank._rl_sync_describe("worker", request.first + where.rank, request.side_size, options)

    def _connect(self, request: ConnectRequest) -> bytes:
        rank = self._described()
        rank.bind_host = request.bind_host or request.reply.host
        rank._rl_sync_connect(request.inits[engine_rank().rank], request.plan, request.bind_host, str(self.device))
        return b""

    def _close(self, abort: bool) -> bytes:
        if self.rank is not None:
            self.rank._rl_sync_close(abort=abort)
        return b""

    def _stage(self, rank: ServiceRank, request: RoundRequest) -> None:
        """Start a staged round on a thread of the rank's own, which answers when the round ends;
        a refusal to start is answered at once."""
        try:
            rank._rl_sync_stage(request.round, lambda run: self._answer(request.reply, "stage", request.version, run))
        except Exception as exc:
            self._answer(request.reply, "stage", request.version, partial(_raise, exc))

    @staticmethod
    def _commit(rank: ServiceRank, version: int) -> bytes:
        rank._rl_sync_commit(version)
        return b""

    def _described(self) -> ServiceRank:
        if self.rank is None:
            raise RuntimeError(
                "rl_sync weight transfer: connect or run before describe; the driver must describe first"
            )
        return self.rank

    def start_weight_update(self) -> None:
        """Rounds write straight into live weights or loader buffers; nothing to prepare."""

    def finish_weight_update(self) -> None:
        """vLLM's post-load processing ran at the end of the round already."""

    def update_weights(self, update_info: dict) -> None:
        """One round (or its commit); no accelerator-wide sync: the round ends synchronized."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: RlSyncUpdateInfo) -> None:
        op, payload = unpack({"op": update_info.op, "payload": update_info.payload})
        rank = self._described()
        if op in ("ipc_begin", "ipc_end"):
            step = decode(IpcRequest, payload)
            begin = lambda: rank._rl_sync_ipc_begin(step.ticket, step.writes_all) or b""  # noqa: E731
            work = begin if op == "ipc_begin" else lambda: _end(rank, step)
            self._answer(step.reply, op, step.version, work)
            return
        request = decode(RoundRequest, payload)
        if op == "run":
            self._answer(request.reply, op, request.version, lambda: rank._rl_sync_run(request.round))
        elif op == "stage":
            self._stage(rank, request)
        elif op == "commit":
            self._answer(request.reply, op, request.version, lambda: self._commit(rank, request.version))
        else:
            raise ValueError(
                f"rl_sync weight transfer: update_weights takes run, stage, commit, ipc_begin or ipc_end, got {op!r}"
            )

    @staticmethod
    def trainer_send_weights(iterator, trainer_args) -> None:
        """Refused: vLLM 0.26 declares this abstract; rl-sync's trainers send through their group."""
        raise TypeError(compat.TRAINER_SEND_REFUSED)

    def shutdown(self) -> None:
        if self.rank is not None:
            self.rank._rl_sync_close(abort=False)
            self.rank = None


def _end(rank: ServiceRank, step: IpcRequest) -> bytes:
    """End a colocated round: the engine's later work waits for the trainer's writes, then vLLM's
    processing for what it wrote."""
    rank._rl_sync_ipc_end(step.version, step.names)
    return b""


def _raise(exc: Exception) -> bytes:
    raise exc


def _put(reply: Rendezvous, key: str, value: bytes) -> None:
    store = store_client(reply)
    try:
        store.set(key, value)
    finally:
        store.close()
