"""`auto` rounds: the sparse engine or a dense round, chosen from what rounds cost here.

Every finished round teaches the policy its cost in seconds per dense byte (the bytes a
dense round moves for the same tensors): dense rounds measure the links and copies, sparse
rounds the diff, the codec and their smaller wire at the density they saw (the bytes they
sent, as a fraction of dense, are shown with the prediction). An `auto` round
then runs the engine predicted faster for its tensors, and says why (`Choice.reason`, shown
in the round's statistics):

* until `WARMUP` sparse rounds are measured it runs sparse, to measure it; then, if no dense
  round has been measured (the group's first round, which compiles, is not), one dense;
* a round whose dense prediction (or, before one, its sparse prediction) is under
  `MIN_DECIDING_S` runs sparse: at that size the times are latency and noise, and within the
  sparse engine each transfer still takes its smallest encoding (dense included);
* after `PROBE_EVERY` dense choices in a row it runs sparse once, because the density
  moves with training and only a sparse round measures it.

Costs are exponential moving averages (`SMOOTHING`), so one slow round does not flip the
choice. Pure: the coordinator feeds it `RoundCost`s and asks `choose`.

Typical use::

    policy = AutoPolicy()
    policy.record(RoundCost("dense", seconds=0.125, dense_bytes=92_000_000))
    policy.choose(92_000_000)     # Choice(engine='sparse', reason='measuring the sparse engine ...')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..config.sync import SPARSE_MODES
from ..wire.stats import RoundStats

Engine = Literal["dense", "sparse"]
WARMUP = 2
MIN_DECIDING_S = 0.05
PROBE_EVERY = 8
SMOOTHING = 0.25


@dataclass(frozen=True)
class RoundCost:
    """What one finished round cost: its engine, wall seconds and the bytes a dense round moves
    for its tensors; `wire` is the fraction of those a sparse round sent."""

    engine: Engine
    seconds: float
    dense_bytes: int
    wire: float = 1.0


@dataclass(frozen=True)
class Choice:
    engine: Engine
    reason: str


class AutoPolicy:
    """Learns seconds per dense byte of each engine and picks the faster (see module docstring)."""

    def __init__(self) -> None:
        self.rate: dict[str, float] = {}
        self.sparse_rounds = 0
        self.wire = 1.0
        self.dense_streak = 0

    def record(self, cost: RoundCost) -> None:
        if cost.dense_bytes <= 0 or cost.seconds <= 0:
            return
        rate = cost.seconds / cost.dense_bytes
        old = self.rate.get(cost.engine)
        self.rate[cost.engine] = rate if old is None else SMOOTHING * rate + (1 - SMOOTHING) * old
        if cost.engine == "sparse":
            self.sparse_rounds += 1
            self.wire = cost.wire

    def learn(self, stats: RoundStats, dense_bytes: int) -> None:
        """Record what a round cost: a dense M2N or sparse-engine round of `dense_bytes` (any
        other mode teaches nothing)."""
        if stats.mode == "m2n":
            self.record(RoundCost("dense", stats.seconds, dense_bytes))
        elif stats.mode in SPARSE_MODES:
            sent = sum(r.sent_bytes for r in stats.ranks if r.role != "worker")
            self.record(RoundCost("sparse", stats.seconds, dense_bytes, sent / max(1, stats.dense_bytes)))

    def choose(self, dense_bytes: int) -> Choice:
        """The engine of an `auto` round that would move `dense_bytes` dense."""
        choice = self._choose(dense_bytes)
        self.dense_streak = self.dense_streak + 1 if choice.engine == "dense" else 0
        return choice

    def _choose(self, dense_bytes: int) -> Choice:
        if self.sparse_rounds < WARMUP:
            return Choice("sparse", f"measuring the sparse engine ({self.sparse_rounds} of {WARMUP} rounds measured)")
        sparse = self.rate["sparse"] * dense_bytes
        if "dense" not in self.rate:
            if sparse < MIN_DECIDING_S:
                return Choice(
                    "sparse",
                    f"a sparse round takes {sparse * 1e3:.1f} ms, under the "
                    f"{MIN_DECIDING_S * 1e3:.0f} ms where timings decide",
                )
            return Choice(
                "dense", f"measuring the dense engine (sparse {sparse:.3f} s predicted, no dense round measured)"
            )
        dense = self.rate["dense"] * dense_bytes
        figures = (
            f"sparse {sparse:.3f} s against dense {dense:.3f} s predicted "
            f"(the last sparse round sent {self.wire:.1%} of dense)"
        )
        if dense < MIN_DECIDING_S:
            return Choice(
                "sparse",
                f"a dense round would take {dense * 1e3:.1f} ms, under the {MIN_DECIDING_S * 1e3:.0f} "
                "ms where timings decide; each transfer takes its smallest encoding",
            )
        if sparse <= dense:
            return Choice("sparse", figures)
        if self.dense_streak >= PROBE_EVERY:
            return Choice("sparse", f"re-measuring after {self.dense_streak} dense rounds ({figures})")
        return Choice("dense", figures)
