"""Drive a vLLM engine service through its weight-transfer calls (no Ray here).

`ServiceDriver` is what a sync group's coordinator uses, through a Ray actor
(`actors.service`), to treat one vLLM engine of N ranks as N workers: it
issues vLLM's own calls with `rl_sync.vllm.service` messages and collects
every rank's answer from the group's rendezvous store, bounded in time. The
engine is reached in one of two ways (`EngineControl`):

* `LlmControl`: an `LLM` in this process (its workers are vLLM's processes);
* `HttpControl`: `vllm serve` over HTTP (its weight-transfer and cache routes
  exist with `VLLM_SERVER_DEV_MODE=1`), pausing generation around each round
  (`mode=wait`), never around a staged round's transfer, and around a commit
  only while it runs (`mode=keep`: requests in flight freeze, then go on).

After a round or commit, the engine's prefix cache is reset: a prefix cached
with the old weights would otherwise be served after the update.

Typical use::

    driver = ServiceDriver(LlmControl(llm), ranks=2)
    reports = driver.describe(request)          # one RankReport per rank
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol, runtime_checkable

from ..wire.codec import decode, encode
from ..wire.failure import RankFailure, RemoteTraceback, kept_type
from .prefix import forget_cached_prefixes
from .service import (
    ERROR,
    CloseRequest,
    ConnectRequest,
    DescribeRequest,
    IpcRequest,
    Op,
    Rendezvous,
    RoundRequest,
    pack,
    reply_key,
    store_client,
)


class EngineControl(Protocol):
    """vLLM's weight-transfer calls on one engine, and its prefix cache: `update` runs a round."""

    def init(self, info: dict) -> None: ...

    def update(self, info: dict) -> None: ...

    def reset_prefix_cache(self) -> None: ...


@runtime_checkable
class StagingControl(EngineControl, Protocol):
    """An engine that takes staged rounds: `stage` starts one the engine generates through,
    `commit` makes one live (and resets the prefix cache). Without these, a commit is an
    `update` and a prefix-cache reset, and a stage is refused."""

    def stage(self, info: dict) -> None: ...

    def commit(self, info: dict) -> None: ...


class LlmControl:
    """An `LLM` built with `weight_transfer_config={"backend": "rl_sync"}`, in this process."""

    def __init__(self, llm):
        self.llm = llm

    def init(self, info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": info})

    def update(self, info: dict) -> None:
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update()

    def stage(self, info: dict) -> None:
        """(This engine generates only inside calls of its owner, never during this one.)"""
        self.update(info)

    def commit(self, info: dict) -> None:
        self.update(info)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """O(1) where the engine core runs in this process (`rl_sync.vllm.prefix`)."""
        forget_cached_prefixes(self.llm)


class HttpControl:
    """`vllm serve` at `url` (started with `VLLM_SERVER_DEV_MODE=1` and
    `--weight-transfer-config '{"backend": "rl_sync"}'`)."""

    def __init__(self, url: str, timeout_s: float = 600.0):
        self.url, self.timeout_s = url.rstrip("/"), timeout_s

    def _post(self, route: str, body: dict | None = None) -> None:
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + route, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            raise RuntimeError(
                f"vLLM at {self.url}: POST {route} answered {exc.code}: {exc.read().decode(errors='replace')[:2000]}"
            ) from None

    def init(self, info: dict) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": info})

    def _weights(self, info: dict) -> None:
        self._post("/start_weight_update")
        self._post("/update_weights", {"update_info": info})
        self._post("/finish_weight_update")

    def update(self, info: dict) -> None:
        self._post("/pause?mode=wait&clear_cache=false")
        try:
            self._weights(info)
        finally:
            self._post("/resume")

    def stage(self, info: dict) -> None:
        """The engine keeps generating: the rank answers at once and receives on a thread."""
        self._weights(info)

    def commit(self, info: dict) -> None:
        """Requests in flight freeze for the commit only; those holding cache blocks are moved back
        to the queue (their cached prefixes are the old weights'), then all go on."""
        self._post("/pause?mode=keep")
        try:
            self._weights(info)
            self._post("/reset_prefix_cache?reset_running_requests=true")
        finally:
            self._post("/resume")

    def reset_prefix_cache(self) -> None:
        self._post("/reset_prefix_cache")


def _reported(blob: bytes) -> RankFailure:
    """A rank's failure report, or what can be said of one that does not decode."""
    try:
        return decode(RankFailure, blob)
    except ValueError as exc:
        return RankFailure("RuntimeError", f"an unreadable failure report ({exc})", "")


def _service_error(label: str, op: str, failed: dict[str, RankFailure]) -> Exception:
    """The error for call `op` that `failed` ranks (by name) answered with: one line per rank,
    the ranks' own type when they share a caller's-mistake type
    (`rl_sync.wire.failure.kept_type`), and their tracebacks as the `__cause__`."""
    reason = "; ".join(f"{rank}: {f}" for rank, f in failed.items())
    error = kept_type([f.kept for f in failed.values()], RuntimeError)(f"{label}, {op}: {reason}")
    tracebacks = [f"{rank}:\n{f.traceback}" for rank, f in failed.items() if f.traceback]
    error.__cause__ = RemoteTraceback("\n".join(tracebacks)) if tracebacks else None
    return error


class ServiceDriver:
    """One engine's ranks as workers of a sync group (see the module docstring). `label` and
    `rank_name(i)` name the engine and its rank `i` in errors (other ranks reached through
    the same calls, `rl_sync.lead`, name theirs)."""

    def __init__(
        self,
        control: EngineControl,
        ranks: int,
        label: str = "vLLM engine service",
        rank_name: Callable[[int], str] = "vLLM rank {}".format,
    ):
        self.control, self.ranks, self.label, self.rank_name = control, ranks, label, rank_name

    def _answers(self, reply: Rendezvous, op: str, tag: int, failure: BaseException | None = None) -> list[bytes]:
        """Every rank's answer to call `op`; raises naming each rank that failed."""
        store = store_client(reply)
        out: list[bytes] = []
        failed: dict[str, RankFailure] = {}
        try:
            for rank in range(self.ranks):
                key = reply_key(reply.prefix, op, tag, rank)
                try:
                    value = store.get(key)
                except Exception as exc:  # the store's timeout: this rank never answered
                    failed[self.rank_name(rank)] = RankFailure(
                        "RuntimeError", f"no answer to {op} ({type(exc).__name__})", ""
                    )
                    continue
                store.delete_key(key)
                if value.startswith(ERROR):
                    failed[self.rank_name(rank)] = _reported(value[len(ERROR) :])
                out.append(value)
        finally:
            store.close()
        if failed:
            raise _service_error(self.label, op, failed)
        if failure is not None:
            raise RuntimeError(f"{self.label}, {op}: {type(failure).__name__}: {failure}") from failure
        return out

    def _issue(self, issue, info: dict, reply: Rendezvous, op: str, tag: int) -> None:
        """Issue one vLLM call; when it fails, raise with what the ranks answered (waited for 2 s)."""
        try:
            issue(info)
        except Exception as exc:
            short = replace(reply, timeout_s=min(reply.timeout_s, 2.0))
            self._answers(short, op, tag, failure=exc)

    def _call(self, issue, info: dict, reply: Rendezvous, op: str, tag: int) -> list[bytes]:
        self._issue(issue, info, reply, op, tag)
        return self._answers(reply, op, tag)

    def describe(self, request: DescribeRequest) -> list[bytes]:
        return self._call(self.control.init, pack("describe", encode(request)), request.reply, "describe", 0)

    def connect(self, request: ConnectRequest) -> None:
        self._call(self.control.init, pack("connect", encode(request)), request.reply, "connect", 0)

    def run(self, request: RoundRequest) -> list[bytes]:
        stats = self._call(self.control.update, pack("run", encode(request)), request.reply, "run", request.version)
        self.control.reset_prefix_cache()
        return stats

    def stage(self, request: RoundRequest) -> None:
        """Start a staged round on every rank; returns once each receives on a thread of its own."""
        if not isinstance(self.control, StagingControl):
            raise ValueError(
                f"{self.label}: reached through {type(self.control).__name__}, which takes no staged rounds "
                "(it cannot let the engine generate while one arrives); push() instead"
            )
        self._issue(self.control.stage, pack("stage", encode(request)), request.reply, "stage", request.version)

    def staged(self, request: RoundRequest) -> list[bytes]:
        """Every rank's `RankStats` of staged round `request.version`, once it ended (waiting at
        most `request.reply.timeout_s` for each)."""
        return self._answers(request.reply, "stage", request.version)

    def commit(self, request: RoundRequest) -> None:
        """Make a double-buffered or staged round live (the engine's prefix cache reset)."""
        info = pack("commit", encode(request))
        if isinstance(self.control, StagingControl):
            self._call(self.control.commit, info, request.reply, "commit", request.version)
            return
        self._call(self.control.update, info, request.reply, "commit", request.version)
        self.control.reset_prefix_cache()

    def ipc_export(self, request: IpcRequest) -> list[bytes]:
        """Every rank's export of the memory behind its destinations."""
        return self._call(self.control.init, pack("ipc_export", encode(request)), request.reply, "ipc_export", 0)

    def ipc_begin(self, request: IpcRequest) -> list[bytes | None]:
        """Open a colocated round on every rank: a new export from each whose memory moved."""
        return [a or None for a in self._round_step("ipc_begin", request)]

    def ipc_end(self, request: IpcRequest) -> None:
        """End a colocated round on every rank (vLLM's processing), then a fresh prefix cache."""
        self._round_step("ipc_end", request)
        self.control.reset_prefix_cache()

    def _round_step(self, op: Op, request: IpcRequest) -> list[bytes]:
        return self._call(self.control.update, pack(op, encode(request)), request.reply, op, request.version)

    def close(self, request: CloseRequest) -> None:
        self._call(self.control.init, pack("close", encode(request)), request.reply, "close", request.tag)
