"""An engine joining and leaving a live group, against a dense round.

The setup of `staged_bench.py` (Qwen2-0.5B shapes, `--layers` of them, FSDP2 trainers, a vLLM
engine with its TP ranks as Ray actors). The group forms with one engine and pushes; a second
engine starts (not timed: vLLM's own start-up), then, `--rounds` times (medians):

* **dense round, one engine**: `WeightSync.push()`: what the join is held against;
* **join**: `WeightSync.add_engine(second.ranks)`: the joining ranks bind (vLLM's loader probed
  on meta tensors), every rank joins the grown group beside its current one, the first engine
  sends the second what it holds (catch-up by relay: as many bytes as one engine keeps, then
  vLLM's processing on the second), and every rank switches; nothing of the first engine
  restarts or binds anew;
* **dense round, two engines**, then **leave**: `WeightSync.remove_engine(second.ranks)` (the
  next join binds it again);
* a push into the first engine alone (not timed), then the **join for the next push**:
  `add_engine(second.ranks, catch_up="next_push")`: bind, regroup and switch, nothing sent; and
  **the dense round after it**, into both engines, which catches the second up (against the
  dense round into two engines above); the second engine leaves again (not timed).

Same script on GPUs (`--device cuda`: a trainer GPU and a GPU per engine rank, so 1 + 2 x TP).

    python benchmarks/elastic_bench.py [--layers 12] [--rounds 3] [--tp 2] [--device cpu]
"""

from __future__ import annotations

import statistics
import time

import ray
from rich.console import Console
from rich.table import Table
from staged_bench import _config, _engine, _sync, defaults, parser_of, placement, scratch_checkpoint, start_trainers


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def run(args) -> dict:
    config, options = _config(args.layers, args.device), placement(args)
    trainers = start_trainers(args, config, options)
    state = ray.get([t.full_state.remote() for t in trainers])[0]
    path = scratch_checkpoint("rl-sync-elastic-", config, state)
    del state
    engines = [_engine(path, args.tp, args.device, cuda_graphs=False, options=options)]
    try:
        sync = _sync(trainers, engines[0], double_buffer=False)
        sync.push()  # the first round compiles
        engines.append(_engine(path, args.tp, args.device, cuda_graphs=False, options=options))
        out: dict[str, list] = {k: [] for k in ("one", "join", "two", "leave", "defer", "after", "caught_up")}
        for _ in range(args.rounds):
            out["one"].append(sync.push().seconds)
            out["join"].append(_seconds(lambda: sync.add_engine(engines[1].ranks)))
            out["caught_up"].append(sync.versions())
            out["two"].append(sync.push().seconds)
            out["leave"].append(_seconds(lambda: sync.remove_engine(engines[1].ranks)))
            sync.push()  # the group moves on: the second engine holds an older version
            out["defer"].append(_seconds(lambda: sync.add_engine(engines[1].ranks, catch_up="next_push")))
            out["after"].append(sync.push().seconds)
            sync.remove_engine(engines[1].ranks)
        sync.close()
        return out
    finally:
        for engine in engines:
            engine.shutdown()
        for t in trainers:
            ray.kill(t)


def show(args, result: dict) -> None:
    table = Table(
        title=f"vLLM TP{args.tp} engines ({args.device}), Qwen2-0.5B shapes x {args.layers} layers, "
        f"{args.trainers} FSDP2 trainers; medians of {args.rounds}"
    )
    for column in ("what", "seconds"):
        table.add_column(column)
    one, join = statistics.median(result["one"]), statistics.median(result["join"])
    rows = [
        ("dense round, one engine", one),
        ("add_engine: the second engine joins (bind, regroup, catch-up from the first, switch)", join),
        ("dense round, two engines", statistics.median(result["two"])),
        ("remove_engine: the second engine leaves", statistics.median(result["leave"])),
        ('add_engine(catch_up="next_push"): bind, regroup, switch', statistics.median(result["defer"])),
        ("the dense round after it, two engines (catches the second up)", statistics.median(result["after"])),
    ]
    for what, seconds in rows:
        table.add_row(what, f"{seconds:.3f}")
    table.add_row("join against one dense round", f"{join / one:.2f}x")
    deferred = statistics.median(result["defer"])
    table.add_row('join (catch_up="next_push") against one dense round', f"{deferred / one:.2f}x")
    Console().print(table)
    print(f"versions after each join (caught up from the first engine): {result.pop('caught_up')}")
    print({k: [round(v, 3) for v in values] for k, values in result.items()})


def main(argv: list[str] | None = None) -> int:
    parser = parser_of(__doc__)
    defaults(parser, args := parser.parse_args(argv))
    show(args, run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
