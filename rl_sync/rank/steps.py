"""Commits of staged rounds between an engine's generation steps.

A staged round (`WeightSync.stage`) lands in a worker's shadows while its engine
generates; its commit must change the live weights between two of the engine's
steps, never during one, and the engine should stop for the commit alone, not for
the Ray call that brought it. `StepGate` orders the two on one rank:

* the engine's generation runs inside `gate.generating(...)` and calls
  `gate.boundary()` before each step (rl-sync's vLLM ranks wrap vLLM's
  `LLMEngine.step`, `actors.vllm`);
* the commit (`gate.commit(version, timeout_s)`) arrives on another thread of
  the rank's process (the rank's control calls: `CONTROL_GROUP`). While the
  engine generates, it is handed to the next boundary, where the engine's own
  thread runs it and goes on with its next step; while the engine is idle, it
  runs at once, and a generation starting meanwhile waits for it.

Collective ordering contract: the ranks of one tensor-parallel engine must switch
at the same step, or one step would mix two versions. Such ranks pass `agree`
(the largest of every rank's argument, a collective over the engine's ranks) to
`generating`, which every rank calls at the start of every generation, in the
same order: there they agree on the newest commit any of them was asked for, and
each rank that has not made it makes it before the generation's first step. They
commit nowhere else during a generation: a commit asked of them mid-generation
waits for it to end. A lone rank (`agree` None) commits at the next step.

Typical use (the engine's thread; `commit` on another)::

    gate = StepGate(apply=rank_commit)          # rank_commit(version): the round made live
    with gate.generating(agree=None):
        while engine.has_unfinished_requests():
            gate.boundary()
            engine.step()
    held = gate.commit(version, timeout_s=60.0)  # seconds the engine stopped for it
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("rl_sync")

CONTROL_GROUP = "rl_sync_control"
"""The Ray concurrency group of a rank's control calls (stage, staged, commit), when its actor
declares one (`SyncWorkerMixin.rl_sync_control_group`): they run beside generation."""
NONE = -1
"""No version (versions are counted from 0)."""


class StepGate:
    """When a rank's commits run against its engine's steps (see the module docstring)."""

    def __init__(self, apply: Callable[[int], None]):
        self._apply = apply
        self._cond = threading.Condition()
        self._generating = False
        self._at_steps = False
        """The current generation commits at its steps (a lone rank)."""
        self._asked = NONE
        """The newest version this rank was asked to commit (or its engine's ranks agreed on)."""
        self._done = NONE
        """The newest version committed here (or failed: it is never tried again)."""
        self._failures: dict[int, BaseException] = {}
        self._held: dict[int, float] = {}
        self.ready = NONE
        """The version this rank's shadows hold in full, set by the rank: what an agreement may
        commit here before this rank's own commit call arrives."""
        self.between_steps = 0
        """Commits made at a step boundary, by the engine's thread, while it generated."""

    def forget(self) -> None:
        """A new group's versions start anew (the rank bound again)."""
        with self._cond:
            self._asked = self._done = self.ready = NONE
            self._failures.clear()
            self._held.clear()
            self.between_steps = 0

    @contextmanager
    def generating(self, agree: Callable[[int], int] | None = None) -> Iterator[None]:
        """The engine generates inside: commits wait for `boundary()` (see the module docstring).
        `agree`: the engine's ranks' collective, for a tensor-parallel engine."""
        with self._cond:
            if agree is not None:
                self._catch_up(agree(self._asked))
            self._generating, self._at_steps = True, agree is None
        try:
            yield
        finally:
            with self._cond:
                self._generating = self._at_steps = False
                self._cond.notify_all()

    @property
    def generating_now(self) -> bool:
        """Whether the engine is inside a generation."""
        return self._generating

    def boundary(self) -> None:
        """Before one of the engine's steps: make a commit asked for since the last one."""
        if self._asked <= self._done or not self._at_steps:  # (no lock: the common case, every step)
            return
        with self._cond:
            if self._asked > self._done:
                self._run(self._asked)
                self.between_steps += 1

    def commit(self, version: int, timeout_s: float) -> float:
        """Commit `version` on this rank: at the engine's next step while it generates, else now;
        waits at most `timeout_s` seconds for it. Returns the seconds the engine stopped for it;
        raises what the commit raised, or `TimeoutError` (the commit may still run later, at the
        engine's next step or, for a tensor-parallel engine, when its next generation starts)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._asked = max(self._asked, version)
            while self._done < version:
                if not self._generating:
                    self._run(version)
                    break
                if not self._cond.wait(max(0.0, deadline - time.monotonic())) and self._done < version:
                    raise TimeoutError(
                        f"commit of version {version}: the engine did not reach a step boundary within "
                        f"{timeout_s:.1f} s (a tensor-parallel engine commits when its generation ends)"
                    )
            failure = self._failures.pop(version, None)
            if failure is not None:
                raise failure
            return self._held.pop(version, 0.0)

    def _catch_up(self, agreed: int) -> None:
        """At a generation's start: make the newest commit the engine's ranks agreed on, if this
        rank has not (its own call may not have arrived yet)."""
        if agreed <= self._done:
            return
        self._asked = max(self._asked, agreed)
        if self.ready != agreed:
            log.error("rl-sync: the engine's ranks committed version %d, which this rank does not hold", agreed)
            self._fail(agreed, RuntimeError(f"version {agreed} is not staged on this rank"))
            return
        self._run(agreed)

    def _run(self, version: int) -> None:
        """Commit `version` here and now (the lock held); its failure goes to its caller."""
        start = time.perf_counter()
        try:
            self._apply(version)
        except BaseException as exc:  # (handed to the commit call waiting for it)
            self._fail(version, exc)
            return
        self._held[version] = time.perf_counter() - start
        self._done = max(self._done, version)
        self._cond.notify_all()

    def _fail(self, version: int, exc: BaseException) -> None:
        self._failures[version] = exc
        self._done = max(self._done, version)
        self._cond.notify_all()
