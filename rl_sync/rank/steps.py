"""Commits of staged rounds between an engine's generation steps.

A staged round (`WeightSync.stage`) lands in a worker's shadows while its engine
generates; its commit must change the live weights between two of the engine's
steps, never during one, and the engine should stop for the commit alone, not for
the Ray call that brought it. `StepGate` orders the two on one rank:

* the engine's generation (anything that runs its steps) runs inside
  `gate.generating()`, and `gate.boundary()` runs before each step (rl-sync's
  vLLM ranks wrap vLLM's `LLMEngine.step`, `actors.vllm`);
* the commit (`gate.commit(version, timeout_s)`) arrives on another thread of
  the rank's process (the actor's control calls, `CONTROL_GROUP`). While the
  engine generates, it is handed to the next boundary, where the engine's own
  thread makes it and goes on with its next step; while the engine is idle, it
  is made at once, and a generation starting meanwhile waits for it.

Only a lone rank commits this way: the ranks of a tensor-parallel engine must
switch at the same step, so their actors declare no control group and take every
call, the commit included, between two generations, in the order sent
(`VllmWorkerMixin._rl_sync_control_of`).

Typical use (the engine's thread; `commit` on another)::

    gate = StepGate(apply=rank_commit)          # rank_commit(version): the round made live
    with gate.generating():
        while engine.has_unfinished_requests():
            gate.boundary()
            engine.step()
    held = gate.commit(version, timeout_s=60.0)  # seconds the engine stopped for it
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

CONTROL_GROUP = "rl_sync_control"
"""The Ray concurrency group of a rank's control calls (a staged round's), when its actor declares
one (`WorkerRank.rl_sync_control_group`): they run beside generation."""
NONE = -1
"""No version (versions are counted from 0)."""


class StepGate:
    """When a rank's commits run against its engine's steps (see the module docstring)."""

    def __init__(self, apply: Callable[[int], None]):
        self._apply = apply
        self._cond = threading.Condition()
        self._generating = 0
        """Generations (and other calls that may run the engine's steps) under way."""
        self._held_over = 0
        """Those of them during which commits wait for the end rather than the next step."""
        self._epoch = 0
        """Bindings so far (`forget`): a commit waiting across one is refused."""
        self._asked = NONE
        """The newest version this rank was asked to commit."""
        self._done = NONE
        """The newest version committed here (or failed: it is never tried again)."""
        self._failures: dict[int, BaseException] = {}
        self._held: dict[int, float] = {}
        self.between_steps = 0
        """Commits made at a step boundary, by the engine's thread, while it generated."""

    def forget(self) -> None:
        """A new group's versions start anew (the rank bound again); a commit still waiting is
        refused."""
        with self._cond:
            self._asked = self._done = NONE
            self._failures.clear()
            self._held.clear()
            self.between_steps = 0
            self._epoch += 1
            self._cond.notify_all()

    @property
    def generations(self) -> int:
        """Generations (and other calls that may run the engine's steps) under way now."""
        return self._generating

    @contextmanager
    def generating(self, at_steps: bool = True) -> Iterator[None]:
        """The engine generates (or may run its steps) inside: commits wait for `boundary()` or,
        where not `at_steps` (the engine cannot take one mid-generation), for the last such
        context to end."""
        with self._cond:
            self._generating += 1
            self._held_over += not at_steps
        try:
            yield
        finally:
            with self._cond:
                self._generating -= 1
                self._held_over -= not at_steps
                self._cond.notify_all()

    def boundary(self) -> None:
        """Before one of the engine's steps: make the commit asked for since the last one."""
        if self._asked <= self._done:  # (no lock: the common case, every step)
            return
        with self._cond:
            if self._asked > self._done and not self._held_over:
                self._run(self._asked)
                self.between_steps += 1

    def commit(self, version: int, timeout_s: float) -> float:
        """Commit `version` on this rank: at the engine's next step while it generates, else now;
        waits at most `timeout_s` seconds for it. Returns the seconds the engine stopped for it;
        raises what the commit raised, `TimeoutError` (the commit withdrawn, not made) or
        `RuntimeError` (the rank bound anew meanwhile, or a later version made in its place)."""
        deadline, epoch = time.monotonic() + timeout_s, self._epoch
        with self._cond:
            self._asked = max(self._asked, version)
            while self._done < version:
                if not self._generating:
                    self._run(version)
                    break
                self._cond.wait(max(0.0, deadline - time.monotonic()))
                if epoch != self._epoch:
                    raise RuntimeError(f"commit of version {version}: the rank was bound anew meanwhile")
                if self._done < version and time.monotonic() >= deadline:
                    self._asked = self._done  # (withdrawn: no later step makes it)
                    raise TimeoutError(
                        f"commit of version {version}: the engine reached no step boundary and did not "
                        f"stop generating within {timeout_s:.1f} s; not made"
                    )
            failure = self._failures.pop(version, None)
            if failure is not None:
                raise failure
            if version not in self._held:
                raise RuntimeError(f"commit of version {version}: version {self._done} was made instead")
            for older in [v for v in self._held if v < version]:
                del self._held[older]
            return self._held[version]

    def _run(self, version: int) -> None:
        """Commit `version` here and now (the lock held); its failure goes to its caller."""
        start = time.perf_counter()
        try:
            self._apply(version)
        except BaseException as exc:  # (handed to the commit call waiting for it)
            self._failures[version] = exc
        else:
            self._held[version] = time.perf_counter() - start
        self._done = max(self._done, version)
        self._cond.notify_all()
