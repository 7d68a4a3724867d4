"""vLLM engines run as a service: rl-sync as their weight-transfer backend.

The engine owns its workers (vLLM's own processes); rl-sync is registered
in each of them as the `rl_sync` weight-transfer backend (a
`vllm.general_plugins` entry point, nothing to import) and driven only by
vLLM's calls. Give `WeightSync` a `VllmService` among the workers; it counts
as all of the engine's ranks (tensor-parallel order) and is reached through
its host:

* `VllmServiceMixin`: your Ray actor owns an `LLM` built with
  `weight_transfer_config={"backend": "rl_sync"}`; define `rl_sync_llm()`.
  `VllmServiceActor` is a ready one (`VllmService.launch`).
* `VllmService.http(url, ranks)`: an engine started with `vllm serve MODEL
  --weight-transfer-config '{"backend": "rl_sync"}'` and
  `VLLM_SERVER_DEV_MODE=1` (vLLM mounts its weight-transfer and cache routes
  only then); generation pauses (waiting for requests in flight) around each
  round.

Typical use::

    service = VllmService.launch("/models/qwen2", tp=2, llm_kwargs={"dtype": "bfloat16"})
    sync = WeightSync.create(trainers, [service], config)
    sync.push()
    service.generate([[1, 2, 3]], max_tokens=8)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import ray

from rl_sync.rank.claim import Claim, GroupTag
from rl_sync.vllm.driver import HttpControl, LlmControl, ServiceDriver
from rl_sync.vllm.service import CloseRequest, ConnectRequest, IpcRequest, Rendezvous, RoundRequest
from rl_sync.wire.codec import decode

from .participant import coordinator_alive

if TYPE_CHECKING:
    from vllm import LLM

BACKEND = {"backend": "rl_sync"}
"""The `weight_transfer_config` that makes vLLM load rl-sync into its workers."""


class _ServiceHost:
    """The calls a `ServiceMember` makes; `_rl_sync_driver()` reaches the engine."""

    _rl_sync_versions: list | None = None
    _rl_sync_unrecorded: int | None = None
    _rl_sync_claim: Claim | None = None

    def _rl_sync_driver(self) -> ServiceDriver:
        raise TypeError(f"{type(self).__name__} must reach a vLLM engine (_rl_sync_driver)")

    def _rl_sync_service_ping(self) -> None:
        """Answers while the host is alive."""

    def _rl_sync_service_describe(self, request: bytes, group: GroupTag | None = None) -> list[bytes]:
        """Bind the engine's ranks for `group`'s trainers; refused while another live group holds
        the engine (`rl_sync.rank.claim`)."""
        from rl_sync.vllm.service import DescribeRequest

        if group is not None:
            if self._rl_sync_claim is None:
                self._rl_sync_claim = Claim()
            self._rl_sync_claim.take(group, coordinator_alive)
        driver = self._rl_sync_driver()
        self._rl_sync_written(None, driver.ranks)
        node = ray.get_runtime_context().get_node_id()
        return driver.describe(replace(decode(DescribeRequest, request), node=node))

    def _rl_sync_service_connect(
        self, inits: tuple[bytes, ...], plan: bytes, bind_host: str | None, reply: bytes
    ) -> None:
        self._rl_sync_driver().connect(ConnectRequest(tuple(inits), plan, bind_host, decode(Rendezvous, reply)))

    def _rl_sync_service_run(self, request: bytes, live: bool) -> list[bytes]:
        """One round; `live`: it writes the live weights (no double buffering)."""
        round_request = decode(RoundRequest, request)
        driver = self._rl_sync_driver()
        if live:
            self._rl_sync_written(None, driver.ranks)
        stats = driver.run(round_request)
        if live:
            self._rl_sync_written(round_request.version, driver.ranks)
        return stats

    def _rl_sync_service_stage(self, request: bytes) -> None:
        """Start a staged round: the engine's ranks receive on threads of their own, the live
        weights (and the versions they hold) stay until the commit."""
        self._rl_sync_driver().stage(decode(RoundRequest, request))

    def _rl_sync_service_staged(self, request: bytes) -> list[bytes]:
        """Every rank's statistics of the staged round, once it ended (bounded)."""
        return self._rl_sync_driver().staged(decode(RoundRequest, request))

    def _rl_sync_service_commit(self, request: bytes) -> None:
        round_request = decode(RoundRequest, request)
        driver = self._rl_sync_driver()
        self._rl_sync_written(None, driver.ranks)
        driver.commit(round_request)
        self._rl_sync_written(round_request.version, driver.ranks)

    def _rl_sync_written(self, version: int | None, ranks: int) -> None:
        """The live weights are being written (None), or hold `version`, not recorded yet."""
        self._rl_sync_versions, self._rl_sync_unrecorded = [None] * ranks, version

    def _rl_sync_service_record(self, version: int) -> bool:
        """The coordinator recorded `version`: report it, if it is the last one written."""
        if self._rl_sync_unrecorded != version:
            return False
        self._rl_sync_versions, self._rl_sync_unrecorded = [version] * self._rl_sync_driver().ranks, None
        return True

    def _rl_sync_service_ipc_export(self, request: bytes) -> list[bytes]:
        """Every rank's export of its destinations' memory to its colocated trainer."""
        return self._rl_sync_driver().ipc_export(decode(IpcRequest, request))

    def _rl_sync_service_ipc_begin(self, request: bytes) -> list[bytes | None]:
        """Open a colocated round (the trainers write the live weights from now on)."""
        driver = self._rl_sync_driver()
        self._rl_sync_written(None, driver.ranks)
        return driver.ipc_begin(decode(IpcRequest, request))

    def _rl_sync_service_ipc_end(self, request: bytes) -> None:
        step = decode(IpcRequest, request)
        driver = self._rl_sync_driver()
        driver.ipc_end(step)
        self._rl_sync_written(step.version, driver.ranks)

    def _rl_sync_service_versions(self) -> list:
        return list(self._rl_sync_versions or [None] * self._rl_sync_driver().ranks)

    def _rl_sync_service_close(self, request: bytes, group: str | None = None) -> None:
        """Close the engine's ranks for the group with token `group` (None: whichever holds them);
        a group that no longer holds the engine changes nothing."""
        if self._rl_sync_claim is not None and not self._rl_sync_claim.release(group):
            return
        self._rl_sync_driver().close(decode(CloseRequest, request))


class VllmServiceMixin(_ServiceHost):
    """Inherit in a Ray actor owning an `LLM` (with `weight_transfer_config=BACKEND`); define
    `rl_sync_llm()`. Its engine's ranks join sync groups as workers."""

    rl_sync_llm: Callable[[], LLM]
    """The subclass's: the `LLM` it owns."""

    def _rl_sync_driver(self) -> ServiceDriver:
        llm = self.rl_sync_llm()
        return ServiceDriver(LlmControl(llm), llm.llm_engine.vllm_config.parallel_config.world_size)


class VllmServiceActor(VllmServiceMixin):
    """A ready host: builds the `LLM` (vLLM's default executor) with rl-sync as its backend."""

    def __init__(self, model: str, tp: int, llm_kwargs: dict[str, Any], env: dict[str, str] | None = None):
        import os

        from vllm import LLM

        os.environ.update(env or {})
        self.llm = LLM(model=model, tensor_parallel_size=tp, weight_transfer_config=BACKEND, **llm_kwargs)

    def rl_sync_llm(self):
        return self.llm

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any]) -> list[dict]:
        from .vllm import completions

        return completions(self.llm, prompts, sampling)

    def call(self, fn, *args, **kwargs):
        """Run `fn(self, *args, **kwargs)` in this actor."""
        return fn(self, *args, **kwargs)


class HttpServiceHost(_ServiceHost):
    """A host for `vllm serve` at `url` (wrap with `ray.remote`; `VllmService.http` does)."""

    def __init__(self, url: str, ranks: int, timeout_s: float = 600.0):
        self.driver = ServiceDriver(HttpControl(url, timeout_s), ranks)

    def _rl_sync_driver(self) -> ServiceDriver:
        return self.driver


class VllmService:
    """One vLLM engine of `ranks` ranks behind `host` (an actor with the `_ServiceHost` calls)."""

    def __init__(self, host, ranks: int):
        self.host, self.ranks = host, ranks

    @classmethod
    def launch(
        cls,
        model: str,
        tp: int = 1,
        *,
        llm_kwargs: dict[str, Any] | None = None,
        actor_options: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> VllmService:
        """Start a `VllmServiceActor` building the engine; bounded by `timeout_s`."""
        host = (
            ray.remote(VllmServiceActor)
            .options(**(actor_options or {"num_cpus": 1}))
            .remote(model, tp, dict(llm_kwargs or {}), env)
        )
        try:
            ping = host._rl_sync_service_ping.remote()  # type: ignore[attr-defined]  # Ray's ActorProxy
            ray.get(ping, timeout=timeout_s)
        except BaseException:
            ray.kill(host)  # type: ignore[arg-type]  # Ray's ActorProxy
            raise
        return cls(host, tp)

    @classmethod
    def http(cls, url: str, ranks: int, timeout_s: float = 600.0) -> VllmService:
        """An engine served at `url` with `ranks` ranks (TP x PP)."""
        return cls(ray.remote(num_cpus=0)(HttpServiceHost).remote(url, ranks, timeout_s), ranks)

    def generate(self, prompts: Sequence[Sequence[int]], timeout_s: float = 300.0, **sampling) -> list[dict]:
        """Token ids and log-probabilities per prompt (a `VllmServiceActor` host)."""
        return ray.get(self.host.generate.remote(prompts, sampling), timeout=timeout_s)

    def versions(self, timeout_s: float = 60.0) -> list:
        return ray.get(self.host._rl_sync_service_versions.remote(), timeout=timeout_s)

    def shutdown(self) -> None:
        ray.kill(self.host)
