"""Staged rounds on the coordinator: the next version travels while the engines serve the last.

`WeightSync.stage()` opens a round as `push()` does (checks, a repair first if
the group is broken, the mode and tensors decided), then starts it: trainers
send as in any round, and every worker receives into its shadow copies on a
thread of its own (`rl_sync.rank.background`), answering at once, so the
engines keep generating with the version they hold (in a colocated group, the
trainers write the workers' shadows through CUDA IPC themselves, the workers
only opening the round, `actors.colocated.begin`, and closing it at the commit,
`actors.colocated.end`). `StagedRound.commit()`
then waits for every rank to finish the transfer and commits the round on
every worker in one step (`Coordinator._commit`: a swap of the memory behind
each storage where the engine allows, a copy otherwise), which is all the
engines wait for. A staged round that fails anywhere is never committed
anywhere: the workers keep serving the previous version in full, and the next
push repairs the group. Both calls carry the driver's fence (`actors.fence`):
a stage the driver gave up on is dropped (claimed once every worker started,
or dropped by the driver's `unstage` should its claim come second), and a
commit is recorded only if its driver still waits (`Coordinator._record`).

Typical use (inside the coordinator)::

    version, mode, reason = stage(coordinator, None, None, "m2n", fence)
    ...                                   # the driver generates meanwhile
    stats = commit(coordinator, version, token)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rl_sync.config.sync import Mode
from rl_sync.wire.codec import decode
from rl_sync.wire.messages import RankStats
from rl_sync.wire.stats import RoundStats

from . import colocated
from .calls import SyncError
from .fence import Fence
from .members import Member, collect, failed, gather

if TYPE_CHECKING:
    from .coordinator import Coordinator


@dataclass(frozen=True)
class OpenRound:
    """A round decided and not yet recorded: what `Coordinator._open_round` settled."""

    version: int
    mode: Mode
    names: tuple[str, ...] | None
    reason: str
    dense_bytes: int
    start: float
    """`time.perf_counter()` when it opened."""
    blob: bytes
    """Its `RoundInfo`, as every rank gets it."""
    paired: bool = False
    """A colocated round whose workers take their side in one call, at the same time as the
    trainers (`actors.colocated.paired_round`); else they opened it already, if colocated."""

    @property
    def what(self) -> str:
        return f"round {self.version} ({self.mode})"


@dataclass(frozen=True)
class Staged:
    """A round started by `stage` and not yet committed."""

    round: OpenRound
    senders: list[Member]
    """Members running it in their actor (trainers), in rank order: `refs` are their calls."""
    refs: dict[int, object]
    """`id(member)` -> the Ray reference of its round."""
    receivers: list[Member]
    """Workers receiving it on a thread of their own, in rank order."""
    token: str
    """The stage call's fence (`actors.fence`), or "" without one."""


def stage(
    c: Coordinator, version: int | None, names: list[str] | None, mode: str | None, fence: Fence | None
) -> tuple[int, str, str]:
    """Open and start a staged round (see the module docstring); returns its version, mode and
    why that mode, once every worker has started receiving and the call's `fence` is claimed."""
    if not c.config.double_buffer:
        raise ValueError(
            "stage: a staged round lands in the workers' shadow copies while they serve, which only a "
            "double-buffered group keeps; create the group with SyncConfig(double_buffer=True)"
        )
    round_ = c._open_round(version, names, mode, "stage")
    receivers = [m for m in c.ranks if any(m is w for w in c.workers)]
    senders = [m for m in c.ranks if all(m is not w for w in receivers)]
    refs = {id(m): m.run(round_.blob, round_.version, c.reply) for m in senders}
    step = c.config.round_timeout_s + 5
    try:
        gather(
            receivers,
            lambda m: m.stage(round_.blob, round_.version, c.reply),
            c.budget.left(step),
            f"{round_.what}: starting the workers",
        )
    except Exception:  # (a worker's refusal too: the trainers are sending)
        c.broken = f"round {round_.version}"
        raise
    c.staged = Staged(round_, senders, refs, receivers, "" if fence is None else fence.token)
    try:
        c.claim(fence, f"stage: {round_.what} started after the driver gave up on it; it is dropped")
    except SyncError:
        _drop(c)
        raise
    return round_.version, round_.mode, round_.reason


def unstage(c: Coordinator, token: str) -> None:
    """Drop the staged round of the stage call whose fence is `token`, if it is still staged."""
    if c.staged is not None and c.staged.token == token:
        _drop(c)


def _drop(c: Coordinator) -> None:
    """The staged round will never be committed: the next push repairs the group (which ends the
    workers' threads); they serve the version they hold meanwhile."""
    assert c.staged is not None  # (callers check)
    c.broken, c.staged = f"round {c.staged.round.version}, staged and dropped", None


def commit(c: Coordinator, version: int, token: str | None) -> RoundStats:
    """Wait for staged round `version` on every rank, then commit it on every worker, and record
    it unless the driver gave up on the call (its fence `token`; a call it gave up on before it
    started drops the round); returns its statistics (`seconds`: the slowest rank's transfer;
    `commit_seconds`: the commit step; `stall_seconds`: what it stopped an engine for)."""
    staged = c.staged
    if staged is None or staged.round.version != version:
        held = (
            "another is" if staged is not None else "committed already, or dropped: a repair, a close, a stage given up"
        )
        raise ValueError(f"commit: round {version} is not staged ({held})")
    c.staged, round_ = None, staged.round
    what, step = f"{round_.what}, staged", c.config.round_timeout_s + 5
    try:
        fence = c._fence(token, "commit")
        timeout = c.budget.left(step)
        sent, failures = collect(staged.senders, lambda m: staged.refs[id(m)], timeout)
        if failures:
            raise failed(what, failures, len(staged.senders), timeout)
        left = c.budget.left(c.config.round_timeout_s)
        received = gather(staged.receivers, lambda m: m.staged(version, left, c.reply), c.budget.left(step), what)
        results = [decode(RankStats, r) for r in sent + received]
        if c.ipc:
            results = colocated.end(c, version, round_.names, results, what, staged=True)
        committed = c._commit(version, what)
    except Exception:  # (a worker's refusal too: no worker committed, their shadows hold the round)
        c.broken = f"round {version}"
        raise
    return c._close_round(round_, results, committed, fence, seconds=max(r.seconds for r in results))
