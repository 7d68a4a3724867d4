"""A rank's per-round host time around its transfers, at 10k, 30k and 140k tensors (CPU, no Ray).

What a trainer rank does each round before it sends (`rl_sync_sources()`, then the
watch of `rl_sync.rank.watch`: identity passes, every tensor's layout compared
with what was recorded, and the names resolved again), and what a
worker rank does before it receives (the same watch over the destinations it
bound). Every tensor is its own storage (the worst case: views of a few fused
parameters share their owner's pointer and version reads). Cases:

* nothing moved: the usual round of an inference worker, or a trainer pushing
  twice between steps;
* values written in place: every trainer shard written since the last round (an
  optimizer step), so every version moved and every shard's geometry is read;
* one tensor moved: one shard or weight given new storage (`.data = ...`), found
  and resolved again (the rank's entries rebuilt; the session then compiles its
  round anew, not timed here).

"geometry of every tensor" is the check this replaced (a Python walk over every
tensor's address, shape, strides and dtype), timed on the same tensors. Times
are this process's CPU time (`time.process_time`), so that a machine shared
with other work measures what the rank spends rather than its waits for a core.
The watch runs its C pass (`rl_sync.rank.native`) where it is built, or its
Python pass with `--scan python` (data pointers and version counters, then the
geometry of what moved).

    python benchmarks/host_round_bench.py [--sizes 10000,30000,140000] [--repeat 9] [--device cuda]
                                          [--scan c|python]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from rl_sync.planning.layout import Layout, Mesh
from rl_sync.rank import TrainerRank, WorkerRank, native
from rl_sync.rank.side import DescribeOptions
from rl_sync.storage import Destination
from rl_sync.wire.messages import RoundInfo

WHOLE = Layout.replicated(Mesh((1,)))
SHAPE = (4, 8)


class Trainer(TrainerRank):
    def __init__(self, n: int, device: str):
        self.held = {f"t.{i}": torch.zeros(SHAPE, device=device) for i in range(n)}

    def rl_sync_sources(self):
        return self.held


class Worker(WorkerRank):
    def __init__(self, n: int, device: str):
        self.held = {
            f"t.{i}": Destination(torch.zeros(SHAPE, device=device), WHOLE, SHAPE, torch.float32) for i in range(n)
        }

    def rl_sync_destinations(self, checkpoint):
        return self.held

    def local(self, name: str) -> torch.Tensor:
        local = self.held[name].local
        assert local is not None  # every weight is held here
        return local


def _timed(step: Callable[[], object], before: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, fastest) CPU seconds of this process in `step`, each run after an untimed
    `before`: on a shared machine, the time the rank spends, not the time it waits for a core."""
    times = []
    for _ in range(repeat):
        before()
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return statistics.median(times), min(times)


def _every_geometry(tensors: list[torch.Tensor]) -> list[tuple]:
    return [(t.data_ptr(), tuple(t.shape), t.stride(), t.dtype) for t in tensors]


def _move(tensor: torch.Tensor) -> Callable[[], None]:
    """Give `tensor` new storage (`.data = ...`), as an engine reallocating a weight does."""

    def move() -> None:
        tensor.data = torch.zeros_like(tensor)

    return move


def _nothing() -> None:
    """No change between rounds."""


def trainer_rows(n: int, repeat: int, device: str) -> list[tuple[str, tuple[float, float]]]:
    rank = Trainer(n, device)
    rank._rl_sync_describe("trainer", 0, 1)
    shards = list(rank.held.values())

    def round_() -> None:
        rank._rl_sync_endpoints("trainer")

    return [
        ("trainer, nothing moved", _timed(round_, _nothing, repeat)),
        ("trainer, values written in place", _timed(round_, lambda: torch._foreach_add_(shards, 1.0), repeat)),
        ("trainer, one tensor moved", _timed(round_, _move(shards[0]), repeat)),
        ("trainer, geometry of every tensor", _timed(lambda: _every_geometry(shards), _nothing, repeat)),
    ]


def worker_rows(n: int, repeat: int, device: str) -> list[tuple[str, tuple[float, float]]]:
    rank = Worker(n, device)
    checkpoint = dict.fromkeys(rank.held, ("float32", SHAPE))
    rank._rl_sync_describe("worker", 0, 1, DescribeOptions(checkpoint=checkpoint))
    info = RoundInfo(1, "m2n", None, 60.0, False)
    weights = [rank.local(name) for name in rank.held]

    def round_() -> None:
        rank._rl_sync_before_round(info)
        rank._rl_sync_endpoints("worker")

    return [
        ("worker, nothing moved", _timed(round_, _nothing, repeat)),
        ("worker, one tensor moved", _timed(round_, _move(weights[0]), repeat)),
        ("worker, geometry of every tensor", _timed(lambda: _every_geometry(weights), _nothing, repeat)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,30000,140000")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--device", default="cpu", help="where the tensors live (the checks run on the host)")
    parser.add_argument("--scan", choices=("c", "python"), default="c", help="the watch's C pass or Python pass")
    args = parser.parse_args()
    if args.scan == "python":
        native.scan = lambda: None  # (what the watch uses where the C pass cannot be built)
    elif native.scan() is None:
        raise SystemExit("the C pass of rl_sync.rank.native cannot be built here (the log says why)")
    sizes = [int(s) for s in args.sizes.split(",")]
    columns: dict[str, dict[int, tuple[float, float]]] = {}
    for n in sizes:
        for label, seconds in trainer_rows(n, args.repeat, args.device) + worker_rows(n, args.repeat, args.device):
            columns.setdefault(label, {})[n] = seconds
    title = (
        f"A rank's per-round host CPU time, ms ({args.device} tensors, the watch's {args.scan} pass; "
        f"median / fastest of {args.repeat})"
    )
    table = Table(title=title)
    table.add_column("case")
    for n in sizes:
        table.add_column(f"{n:,} tensors", justify="right")
    for label, by_size in columns.items():
        table.add_row(label, *(f"{by_size[n][0] * 1e3:.1f} / {by_size[n][1] * 1e3:.1f}" for n in sizes))
    Console(width=140).print(table)


if __name__ == "__main__":
    main()
