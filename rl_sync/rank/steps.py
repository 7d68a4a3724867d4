"""Commits of staged rounds between an engine's generation steps.

A staged round (`WeightSync.stage`) lands in a worker's shadows while its engine
generates; its commit must change the live weights between two of the engine's
steps, never during one, and the engine should stop for the commit alone, not for
the Ray call that brought it. `StepGate` orders the two on one rank:

* the engine's generation (anything that runs its steps) runs inside
  `gate.generating()`, and `gate.boundary()` runs before each step (rl-sync's
  vLLM ranks wrap vLLM's `LLMEngine.step`, `actors.vllm`); the gate numbers
  the boundaries from 0 (again at `forget()`: every rank of an engine binds
  together), across generations;
* the commit (`gate.commit(version, timeout_s)`) arrives on another thread of
  the rank's process (the actor's control calls, `CONTROL_GROUP`). While the
  engine generates, it is handed to the next boundary, where the engine's own
  thread makes it and goes on with its next step; while the engine is idle, it
  is made at once, and a generation starting meanwhile waits for it.

The ranks of a tensor-parallel engine must all switch before the same step. They
run their steps in lockstep (each step's collectives wait for every rank), so
their boundary numbers agree, and a commit takes two calls on every rank:

1. `arm(version, timeout_s)` holds the rank at its next boundary and returns that
   boundary's number;
2. once every rank of the engine answered, `commit(version, timeout_s, at_step=S)`
   with S the largest number: a rank held at a smaller one runs its steps up to S
   (another rank is already inside that step and waits for it) and each commits
   before step S, or at once where it is idle there. `disarm(version)` releases a
   rank whose engine will not commit (another rank's arming failed).

A rank held without its step past `timeout_s` gives up, withdrawn, and the
commit then refuses step S (it ran past it): the coordinator breaks the group.

Typical use (the engine's thread; `commit` on another)::

    gate = StepGate(apply=rank_commit)          # rank_commit(version): the round made live
    with gate.generating():
        while engine.has_unfinished_requests():
            gate.boundary()
            engine.step()
    held = gate.commit(version, timeout_s=60.0)  # seconds the engine stopped for it
    # a tensor-parallel engine: on every rank, then
    step = max(rank.arm(version, 60.0) for rank in engine_ranks)
    held = [rank.commit(version, 60.0, at_step=step) for rank in engine_ranks]  # (at once)
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

    def __init__(self, apply: Callable[[int], None], ahead: Callable[[], None] = lambda: None):
        self._apply, self._ahead = apply, ahead
        """`apply(version)` makes a commit; `ahead()` does what it can of the next one's work before
        the commit waits for the engine, on the commit's thread, while the engine runs."""
        self._cond = threading.Condition()
        self._generating = 0
        """Generations (and other calls that may run the engine's steps) under way."""
        self._held_over = 0
        """Those of them during which commits wait for the end rather than the next step."""
        self._epoch = 0
        """Bindings so far (`forget`): a commit waiting across one is refused."""
        self._steps = 0
        """Boundaries passed: the number of the next one."""
        self._asked = NONE
        """The newest version this rank was asked to commit."""
        self._at_step: int | None = None
        """The boundary it is to be made at (a tensor-parallel engine's), None: the next one."""
        self._armed = NONE
        """The version whose commit's step this rank waits for, held at a boundary (`arm`)."""
        self._armed_until = 0.0
        self._done = NONE
        """The newest version committed here (or failed: it is never tried again)."""
        self._failures: dict[int, BaseException] = {}
        self._held: dict[int, float] = {}
        self.between_steps = 0
        """Commits made at a step boundary, by the engine's thread, while it generated."""
        self.last_at_step: int | None = None
        """The number of the boundary where the last of them was made (the same on every rank of
        a tensor-parallel engine)."""

    def forget(self) -> None:
        """A new group's versions start anew (the rank bound again, as every rank of its engine
        is, before any of them generates again), and its step numbers; a commit still waiting
        is refused."""
        with self._cond:
            self._asked = self._done = self._armed = NONE
            self._at_step = self.last_at_step = None
            self._steps = self.between_steps = 0
            self._failures.clear()
            self._held.clear()
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
        """Before one of the engine's steps: held while armed without a step; then make the commit
        asked for at this boundary (or, without a step, since the last one)."""
        with self._cond:
            here, epoch = self._steps, self._epoch
            start = time.perf_counter()
            while self._armed > self._done and self._at_step is None:
                left = self._armed_until - time.monotonic()
                if left <= 0 or epoch != self._epoch:
                    self._armed = NONE  # (withdrawn: a commit at this step is refused, `commit`)
                    break
                self._cond.wait(left)
            if self._asked > self._done and not self._held_over and self._at_step in (None, here):
                self._run(self._asked, held=time.perf_counter() - start)
                self.between_steps, self.last_at_step = self.between_steps + 1, here
            self._steps = here + 1
            self._cond.notify_all()

    def arm(self, version: int, timeout_s: float) -> int:
        """A tensor-parallel engine's commit of `version`, first call: hold this rank at its next
        boundary (at most `timeout_s` seconds) and return that boundary's number. (Only for an
        engine whose generations take commits between steps: one that holds them over to its
        generation's end takes every call in order instead, `VllmWorkerMixin._rl_sync_control_of`.)"""
        self._ahead()
        with self._cond:
            self._armed, self._armed_until = version, time.monotonic() + timeout_s
            return self._steps

    def disarm(self, version: int) -> None:
        """Release a rank armed for `version` whose commit will not come (no commit is made)."""
        with self._cond:
            if self._armed == version and self._at_step is None:
                self._armed = NONE
                self._cond.notify_all()

    def commit(self, version: int, timeout_s: float, at_step: int | None = None) -> float:
        """Commit `version` on this rank: at the engine's next step (`at_step`: before that one)
        while it generates, else now; waits at most `timeout_s` seconds for it. Returns the
        seconds the engine stopped for it; raises what the commit raised, `TimeoutError` (the
        commit withdrawn, not made) or `RuntimeError` (the rank bound anew meanwhile, ran past
        `at_step`, or a later version was made in its place)."""
        deadline, epoch = time.monotonic() + timeout_s, self._epoch
        if at_step is None:
            self._ahead()  # (an agreed step's ran at the arming)
        with self._cond:
            self._asked = max(self._asked, version)
            self._at_step = at_step
            if at_step is None:
                self._armed = NONE  # (no step agreed: the next boundary makes it)
            self._cond.notify_all()
            while self._done < version:
                self._check_step(version, at_step)
                if not self._generating and at_step in (None, self._steps):
                    self._run(version, held=0.0)
                    break
                self._cond.wait(max(0.0, deadline - time.monotonic()))
                if epoch != self._epoch:
                    raise RuntimeError(f"commit of version {version}: the rank was bound anew meanwhile")
                if self._done < version and time.monotonic() >= deadline:
                    self._withdraw()
                    raise TimeoutError(
                        f"commit of version {version}: the engine reached no step boundary and did not "
                        f"stop generating within {timeout_s:.1f} s; not made"
                    )
            return self._outcome(version)

    def _check_step(self, version: int, at_step: int | None) -> None:
        """`RuntimeError` (the commit withdrawn) where this rank is past `at_step`."""
        if at_step is not None and self._steps > at_step:
            passed = self._steps
            self._withdraw()
            raise RuntimeError(
                f"commit of version {version} before step {at_step}: this rank is past it (step {passed}: "
                "it gave up waiting for the step, or its engine's ranks do not run in lockstep); not made"
            )

    def _withdraw(self) -> None:
        """The commit asked for is not made: no later step makes it."""
        self._asked, self._armed, self._at_step = self._done, NONE, None
        self._cond.notify_all()

    def _outcome(self, version: int) -> float:
        failure = self._failures.pop(version, None)
        if failure is not None:
            raise failure
        if version not in self._held:
            raise RuntimeError(f"commit of version {version}: version {self._done} was made instead")
        for older in [v for v in self._held if v < version]:
            del self._held[older]
        return self._held[version]

    def _run(self, version: int, held: float) -> None:
        """Commit `version` here and now (the lock held; `held`: seconds the engine already stood
        for it); its failure goes to its caller."""
        start = time.perf_counter()
        try:
            self._apply(version)
        except BaseException as exc:  # (handed to the commit call waiting for it)
            self._failures[version] = exc
        else:
            self._held[version] = held + time.perf_counter() - start
        self._done = max(self._done, version)
        self._armed, self._at_step = NONE, None
        self._cond.notify_all()
