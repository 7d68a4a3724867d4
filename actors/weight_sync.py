"""`WeightSync`: the driver-side handle of one sync group.

Typical use, between training steps::

    sync = WeightSync.create(trainers, workers, SyncConfig(bucket_bytes=64 << 20))
    stats = sync.push()                 # every tensor, next version
    stats = sync.push(names=["lm_head.weight"], mode="broadcast")
    sync.close()

Asynchronous RL, with `SyncConfig(double_buffer=True)`: the next version travels while the
engines generate with the last, and becomes live at a step boundary::

    staged = sync.stage()               # returns once every worker receives in the background
    rollouts = engine.generate(...)     # the engines serve the previous version meanwhile
    stats = staged.commit()             # waits for the transfer, then swaps it in everywhere

LoRA, with trainers that expose a PEFT adapter (`docs/lora.md`)::

    sync = WeightSync.create(trainers, engine.ranks, config, lora=LoraSpec(name="policy", lora_id=1, rank=8, alpha=16))
    sync.push()                         # the adapter only, into one LoRA slot of each engine
    engine.generate(prompts, lora_request=sync.lora_request())

`trainers[i]` must be the actor whose layouts call it rank i (its default
process-group rank for DTensors); workers follow in their own order.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import ray
from ray.actor import ActorHandle
from rich.console import Console

from rl_sync.config.lora import LoraSpec
from rl_sync.config.push_args import check_push_args, check_version
from rl_sync.config.sync import SyncConfig, check_seconds
from rl_sync.wire.failure import RemoteTraceback
from rl_sync.wire.stats import RoundStats, SyncSummary

from .calls import SyncError, failure_reason, remote_text
from .coordinator import Coordinator
from .elastic import CATCH_UPS, CatchUp
from .fence import Fence, Settler
from .group import Membership
from .hooks import check_hooks
from .members import leave
from .service import VllmService

log = logging.getLogger("rl_sync")


SLACK_S = 30.0
"""How much longer than a call's budget the driver waits for the coordinator's answer (Ray's
scheduling, the coordinator's own planning time), at most: a call of a shorter budget waits
twice its budget."""


def _slack(budget_s: float) -> float:
    return min(SLACK_S, budget_s)


def _unwrap(ref, budget_s: float, gave_up: Callable[[], str] = lambda: ""):
    """The coordinator's answer to a call bounded by `budget_s`; should it not answer even
    `_slack(budget_s)` later, `SyncError` ending with what `gave_up()` says (a push: whether its
    version was applied). A caller's mistake stays a `ValueError` / `TypeError`, any other
    failure is a `SyncError`; either way the coordinator's traceback (and in it the failing
    ranks') is its `__cause__`."""
    slack = _slack(budget_s)
    try:
        return ray.get(ref, timeout=budget_s + slack)
    except ray.exceptions.GetTimeoutError:
        raise SyncError(
            f"the coordinator did not answer within {budget_s + slack:.0f} s (the call's budget of "
            f"{budget_s:.0f} s plus {slack:.0f} s){gave_up()}"
        ) from None
    except ray.exceptions.RayTaskError as exc:
        cause, remote = exc.cause, RemoteTraceback(remote_text(exc))
        if isinstance(cause, (ValueError, TypeError, SyncError)):
            raise cause from remote
        raise SyncError(str(cause)) from remote


def _recorded(version: int | None) -> Callable[[Fence, bool], str]:
    """What a call recording `version` (a push, patches, a commit) that the driver stopped waiting
    for did, by whose claim on its fence landed first (`WeightSync._fenced`)."""
    which = "the next version" if version is None else f"version {version}"

    def outcome(_fence: Fence, abandoned: bool) -> str:
        if abandoned:
            return (
                f"; {which} was not applied and never will be (a round finishing later is not recorded, and "
                "workers it wrote into report no version): push it again"
            )
        return f"; {which} was applied just before the driver gave up: versions() says what each worker holds"

    return outcome


def _budget(timeout_s, default: float, what: str) -> float:
    return default if timeout_s is None else check_seconds(f"{what}: timeout_s", timeout_s)


def _discard(coordinator, config: SyncConfig) -> None:
    """A create that failed leaves nothing behind: the actors it reached leave the group (bounded)
    and the coordinator goes; an actor it could not reach is freed all the same, since a group
    whose coordinator is dead holds no actor (`rl_sync.rank.claim`)."""
    try:
        ray.get(coordinator.close.remote(), timeout=config.init_timeout_s + SLACK_S)
    except ray.exceptions.RayError:
        pass
    finally:
        ray.kill(coordinator)


class WeightSync:
    """Handle to a Coordinator actor that owns one sync group; `summary` (`SyncSummary`) says
    what forming it decided. `trainers`, `workers` and `token` (the group's, `GroupTag`) let
    `close` release the actors should the coordinator be gone."""

    def __init__(
        self,
        coordinator,
        config: SyncConfig,
        summary: SyncSummary,
        *,
        trainers: Sequence = (),
        workers: Sequence = (),
        token: str = "",
        lora: LoraSpec | None = None,
    ):
        self.coordinator, self.config, self.summary, self.lora = coordinator, config, summary, lora
        self.trainers, self.workers, self.token = list(trainers), list(workers), token
        self.closed = False
        self._abandoned: list[Fence] = []
        """Fences of calls the driver gave up on: the coordinator may yet refuse them (`settle`s
        each it sees); `close` forgets the rest."""
        self._settler = Settler()
        """Forgets the fences of answered calls off the driver's path."""

    def _open(self):
        """The coordinator, unless the group was closed."""
        if self.closed:
            raise SyncError(f"sync group {self.config.name!r} is closed; create a new WeightSync")
        return self.coordinator

    @classmethod
    def create(
        cls,
        trainers: list,
        workers: list,
        config: SyncConfig | None = None,
        *,
        lora: LoraSpec | None = None,
        progress: bool = True,
    ) -> WeightSync:
        """Start a coordinator, plan, and connect every rank (bounded by `init_timeout_s`);
        `progress` shows a spinner on the driver's terminal meanwhile. The coordinator runs on
        the driver's node: a node that drops off the network then takes ranks out of the round,
        not the group's control. `lora`: the trainers expose a PEFT LoRA adapter
        (`rl_sync.lora.adapter_sources`) and every round writes it into one LoRA slot of each
        vLLM engine (`docs/lora.md`); requests name it with `lora_request()`."""
        config = config or SyncConfig()
        if not isinstance(config, SyncConfig):
            raise TypeError(f"WeightSync.create: config must be a SyncConfig, got {type(config).__name__}")
        trainers, workers = list(trainers), list(workers)
        Membership.of(trainers, workers)  # bad entries are refused here, before any actor is reached
        _check_lora(lora, dict(enumerate(workers)), "WeightSync.create")
        token = uuid.uuid4().hex[:12]
        coordinator = (
            ray.remote(Coordinator)
            .options(num_cpus=0, **_beside_driver())
            .remote(trainers, workers, config, token, lora)
        )
        try:
            with (
                Console(stderr=True).status(
                    f"rl-sync: planning and connecting {len(trainers)} trainers and {len(workers)} workers",
                    spinner="dots",
                )
                if progress
                else nullcontext()
            ):
                setup = coordinator.setup.remote(config.init_budget_s)  # type: ignore[attr-defined]  # Ray's ActorProxy
                summary = _unwrap(setup, config.init_budget_s)
        except BaseException:
            _discard(coordinator, config)
            raise
        log.info("rl-sync group %r: %s", config.name, summary)
        return cls(coordinator, config, summary, trainers=trainers, workers=workers, token=token, lora=lora)

    def lora_request(self, name: str | None = None):
        """vLLM's `LoRARequest` for the adapter this LoRA group pushes (`name`, if given, must be
        its name): pass it to `generate` to serve the version last pushed."""
        if self.lora is None:
            raise ValueError("lora_request: this group pushes model weights, not a LoRA adapter (create it with lora=)")
        if name is not None and name != self.lora.name:
            raise ValueError(f"lora_request: unknown adapter {name!r}; this group pushes {self.lora.name!r}")
        return self.lora.request()

    def push(
        self,
        version: int | None = None,
        names: list[str] | None = None,
        mode: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> RoundStats:
        """Move the trainers' current weights into every worker; returns the round's statistics
        (also logged, and recorded as Ray metrics by the coordinator).

        The whole push (a repair first, after a failed round) is bounded by `timeout_s`
        (default `SyncConfig.push_budget_s`); the driver waits at most as long again (30 s at
        most) for the answer. A push that raises recorded nothing, now or later (`actors.fence`),
        unless its error says its version was applied: the group's version stays, and a retry
        with the same version is taken (workers may hold part of the failed round until then and
        report no version; `versions()` says which hold what)."""
        version, names, mode = check_push_args(version, names, mode)
        budget = _budget(timeout_s, self.config.push_budget_s, "push")
        stats = self._fenced(
            lambda fence: self._open().push.remote(version, names, mode, budget, fence), budget, _recorded(version)
        )
        log.info(stats.log_line())
        return stats

    def stage(
        self,
        version: int | None = None,
        names: list[str] | None = None,
        mode: str | None = None,
        *,
        timeout_s: float | None = None,
    ) -> StagedRound:
        """Start a round (arguments as for `push`) that lands in the workers' shadow copies while
        their engines keep serving the version they hold; returns once every worker receives, on a
        thread of its own. Needs `SyncConfig(double_buffer=True)`. `StagedRound.commit()` makes it
        live; until then no other round may start. Bounded like `push`; a stage that raises left
        nothing staged, now or later (`actors.fence`; the next push repairs the group if it must)."""
        version, names, mode = check_push_args(version, names, mode)
        budget = _budget(timeout_s, self.config.push_budget_s, "stage")

        def unstaged(fence: Fence, abandoned: bool) -> str:
            which = "the next version" if version is None else f"version {version}"
            if abandoned:
                return f"; {which} was not staged and never will be: stage or push it again"
            self.coordinator.unstage.remote(fence.token)  # (runs before any later call of this driver)
            return f"; {which} was staged just before the driver gave up, and is dropped: the next push repairs"

        staged = self._fenced(
            lambda fence: self._open().stage.remote(version, names, mode, budget, fence), budget, unstaged
        )
        return StagedRound(self, *staged)

    def _commit(self, version: int, timeout_s: float | None) -> RoundStats:
        budget = _budget(timeout_s, self.config.push_budget_s, "commit")
        stats = self._fenced(
            lambda fence: self._open().commit.remote(version, budget, fence), budget, _recorded(version)
        )
        log.info(stats.log_line())
        return stats

    def _fenced(self, call: Callable[[str], Any], budget: float, outcome: Callable[[Fence, bool], str]) -> Any:
        """The answer of a call that decides what the group keeps (a version, a staged round, its
        members), run under a fresh fence (`actors.fence`): should the driver stop waiting, its
        claim decides whether the call took effect, and `outcome(fence, abandoned)` says which."""
        fence = Fence.new()
        ref = call(fence.token)
        claims: list[bool] = []

        def gave_up() -> str:
            claims.append(fence.abandon())
            return outcome(fence, claims[-1])

        try:
            return _unwrap(ref, budget, gave_up)
        finally:
            if claims == [True]:
                self._abandoned.append(fence)  # the coordinator settles it, should it ever reach the call
            else:
                self._settler.later(fence)

    def push_patches(self, patches, version: int | None = None, *, timeout_s: float | None = None) -> int:
        """Drop-in for vLLM's sparse patches: `SparseWeightPatch(name, indices, values)` with flat
        indices into the whole tensor, for any destination layout, after at least one `push`.
        Patches travel through Ray's object store; each worker then runs what a round runs after
        it for the patched names (its engine's hook: vLLM's processing, cached prefixes forgotten,
        a LoRA slot's scaling). Returns the version now held everywhere. Bounded like `push`."""
        version = check_version(version)
        budget = _budget(timeout_s, self.config.push_budget_s, "push_patches")
        patches = list(patches)
        return self._fenced(
            lambda fence: self._open().push_patches.remote(patches, version, budget, fence),
            budget,
            _recorded(version),
        )

    def versions(self) -> list[int | None]:
        """The version each worker's live weights fully hold (None: torn, in flight, never synced, dead)."""
        return _unwrap(self._open().versions.remote(), self.config.init_timeout_s)

    def repair(self, *, timeout_s: float | None = None) -> SyncSummary:
        """Re-form the group now (push does this by itself after a failure with `auto_repair`),
        within `timeout_s` (default `SyncConfig.init_budget_s`)."""
        budget = _budget(timeout_s, self.config.init_budget_s, "repair")
        return _unwrap(self._open().repair.remote(budget), budget)

    def replace_worker(self, index: int, handle) -> None:
        """Swap in a new actor for worker `index`; the next push re-forms the group and brings it
        to the current version with a full dense round."""
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"replace_worker: index must be an int, got {index!r}")
        if not isinstance(handle, (ActorHandle, VllmService)):
            raise TypeError(
                f"replace_worker: the new worker must be a Ray actor handle or a VllmService, got "
                f"{type(handle).__name__} {handle!r:.60}"
            )
        if isinstance(handle, ActorHandle):
            check_hooks(handle, "worker", f"replace_worker: worker {index}")
        _check_lora(self.lora, {index: handle}, "replace_worker")
        _unwrap(self._open().replace_worker.remote(index, handle), self.config.init_timeout_s)
        self.workers[index] = handle

    def add_engine(self, workers: list, *, catch_up: CatchUp = "relay", timeout_s: float | None = None) -> SyncSummary:
        """Grow the live group by one engine: `workers`, its ranks in tensor-parallel order (Ray actors
        with the worker mixin, e.g. a new `VllmEngine`'s `ranks`), which bind for the grown worker
        count. The group's ranks keep their bindings and buffers (nothing restarts), and the next
        push includes the newcomer. How it gets the group's weights, `catch_up`:

        * `"relay"`: a replica already in the group sends it the version it holds, within this
          call (laid out otherwise, or holding no recorded version, the next push carries every
          tensor dense, as with `"next_push"`);
        * `"next_push"`: nothing is sent now, and the next push carries every tensor to every
          worker, dense; until then the newcomer reports no version (`versions()`: None). The
          cheaper join when the trainers push before the newcomer serves anyway (a push that is
          dense costs the same).

        Between rounds, bounded by `timeout_s` (default `SyncConfig.init_budget_s`); a join that
        fails leaves the group as it was, unless one of its own ranks failed (the next push
        repairs it then). Returns the group's new summary (also `self.summary`)."""
        if catch_up not in CATCH_UPS:
            raise ValueError(f"add_engine: catch_up must be one of {list(CATCH_UPS)}, got {catch_up!r}")
        return self._regroup("add_engine", workers, timeout_s, (catch_up,))

    def remove_engine(self, workers: list, *, timeout_s: float | None = None) -> SyncSummary:
        """Shrink the live group by one engine: `workers`, all of its ranks. The others keep their
        bindings and buffers and go on at the same version; the engine's ranks leave the group
        (free to join another). Bounded like `add_engine`; returns the new summary."""
        return self._regroup("remove_engine", workers, timeout_s)

    def _regroup(self, what: str, workers: list, timeout_s: float | None, args: tuple = ()) -> SyncSummary:
        if not isinstance(workers, (list, tuple)) or not workers:
            raise TypeError(
                f"{what}: workers must be a non-empty list of one engine's rank actors, got {workers!r:.80}"
            )
        for i, handle in enumerate(workers):
            if not isinstance(handle, ActorHandle):
                raise TypeError(
                    f"{what}: rank {i} of the engine must be a Ray actor handle, got {type(handle).__name__}"
                )
            check_hooks(handle, "worker", f"{what}: rank {i} of the engine")
        budget, handles = _budget(timeout_s, self.config.init_budget_s, what), list(workers)
        verb = "join" if what == "add_engine" else "leave"

        def outcome(_fence: Fence, abandoned: bool) -> str:
            if abandoned:
                return f"; the engine did not {verb} the group and never will (the group is as it was): {what} again"
            self._members(what, handles)
            return f"; the engine did {verb} the group just before the driver gave up (versions() lists the workers)"

        self.summary = self._fenced(
            lambda fence: getattr(self._open(), what).remote(handles, budget, fence, *args), budget, outcome
        )
        self._members(what, handles)
        log.info("rl-sync group %r after %s: %s", self.config.name, what, self.summary)
        return self.summary

    def _members(self, what: str, handles: list) -> None:
        """`workers` once `what` took effect with the engine's ranks `handles` (what `close`
        releases should the coordinator be gone)."""
        if what == "add_engine":
            self.workers += handles
        else:
            self.workers = [w for w in self.workers if w not in handles]

    def close(self) -> None:
        """Release the group and the coordinator; closing again does nothing, and closing never
        raises. A coordinator that died (or does not answer within `init_timeout_s`) cannot
        release the group: the driver then asks each actor to leave it
        (`actors.members.leave`, bounded the same; an engine service's ranks stay until the next
        group takes them over)."""
        if self.closed:
            return
        self.closed = True
        timeout = self.config.init_timeout_s
        try:
            ray.get(self.coordinator.close.remote(), timeout=timeout + SLACK_S)
        except ray.exceptions.RayError as exc:
            log.warning(
                "rl-sync group %r: the coordinator did not close it (%s); releasing its actors",
                self.config.name,
                failure_reason(exc),
            )
            if self.trainers:
                group = Membership.of(self.trainers, self.workers)
                leave(group.trainers + group.workers, True, None, self.token, timeout)
        finally:
            ray.kill(self.coordinator)
            for fence in self._abandoned:  # the coordinator is gone: no call of it can be recorded now
                self._settler.later(fence)
            self._settler.close(timeout)


class StagedRound:
    """A round `WeightSync.stage` started: `version` travels into the workers' shadows while their
    engines serve the previous one (`mode`, and `reason` when that is not simply what was asked)."""

    def __init__(self, sync: WeightSync, version: int, mode: str, reason: str):
        self.sync, self.version, self.mode, self.reason = sync, version, mode, reason
        self.committed = False

    def commit(self, *, timeout_s: float | None = None) -> RoundStats:
        """Wait until every rank has the round, then make it live on every worker at once (a swap of
        the memory behind each storage where the engine allows it, a copy otherwise); call it
        between generation steps. Returns the round's statistics (`commit_seconds`: what the
        engines waited for). Bounded by `timeout_s` (default `SyncConfig.push_budget_s`); a round
        that failed anywhere is committed nowhere (the workers keep the previous version in full,
        the next push repairs), and a round is committed once."""
        if self.committed:
            raise ValueError(f"commit: round {self.version} was committed already")
        self.committed = True
        return self.sync._commit(self.version, timeout_s)

    def __repr__(self) -> str:
        state = "committed" if self.committed else "staged"
        return f"StagedRound(version={self.version}, mode={self.mode!r}, {state})"


def _check_lora(lora: LoraSpec | None, workers: dict[int, object], label: str) -> None:
    """A LoRA group's spec is a `LoraSpec` and its workers (by index) are vLLM rank actors."""
    if lora is None:
        return
    if not isinstance(lora, LoraSpec):
        raise TypeError(f"{label}: lora must be a LoraSpec or None, got {type(lora).__name__}")
    services = [i for i, w in workers.items() if isinstance(w, VllmService)]
    if services:
        raise ValueError(
            f"{label}: workers {services} are vLLM engine services, which take no LoRA rounds yet; "
            "pass the engines' rank actors (actors.vllm.VllmEngine) to a LoRA group"
        )


def _beside_driver() -> dict:
    """Affinity to the driver's node, where the driver has one (not as a Ray client). Hard: Ray
    2.60 placed a zero-resource actor with soft affinity on another node (seen across network
    namespaces); it needs no resources, so the driver's node can always take it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    try:
        node = ray.get_runtime_context().get_node_id()
    except Exception:  # Ray client mode: no local node
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)} if node else {}
