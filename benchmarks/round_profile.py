"""Where a round's time goes inside the actors: timers around its parts, in the actor processes.

`install(actor)` (run in an actor through its `call`) wraps the functions a
round passes through, in that process, so each call records its wall-clock
start and end (`time.time()`: one clock for every process of the host).
`take(actor)` returns and clears what was recorded. Around each timed call
(`timed_calls`: a push, or a staged round's commit) the driver notes its own
start and end, and `report` prints, for the median call: the time of each
part in each actor, and the call's timeline (each actor's outermost parts in
order, and the gaps between them, where Ray calls, the coordinator and the
driver spend the rest).

Used by `gpu_bench.py --profile` (colocated CUDA IPC on one GPU), by
`staged_bench.py --profile` (a staged round's commit: the shadows made live,
vLLM's hook) and, as `python benchmarks/round_profile.py [--tensors 30000]
[--repeat 5]`, on this host's CPU: a Gloo round between one trainer and one
worker actor.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

_RANK, _WORKER, _SESSION, _RUNNER, _IPC, _SHADOW, _RELOAD = (
    "rl_sync.rank.participant",
    "rl_sync.rank.worker",
    "rl_sync.engine.session",
    "rl_sync.engine.runner",
    "rl_sync.transport.cuda_ipc",
    "rl_sync.rank.shadow",
    "rl_sync.vllm.reload",
)
PARTS: list[tuple[str, str, str, str]] = [
    ("trainer/worker: sources or destinations (watch, rebinding)", _RANK, "Participant", "_rl_sync_endpoints"),
    ("watch check", "rl_sync.rank.watch", "Watch", "changed"),
    ("worker: follow what moved (watch, rebinding)", _WORKER, "WorkerRank", "_rl_sync_follow"),
    ("worker: before the round (in flight)", _WORKER, "WorkerRank", "_rl_sync_before_round"),
    ("worker: after the round (fallbacks, hook)", _WORKER, "WorkerRank", "_rl_sync_after_round"),
    ("handover (RankSession.run)", _SESSION, "RankSession", "run"),
    ("round lookup or compile", _SESSION, "RankSession", "_program"),
    ("transport begin_round (IPC: stream waits on the worker)", _IPC, "IpcTransport", "begin_round"),
    ("copies launched (pack, local)", _RUNNER, "Copies", "run"),
    ("bucket waits (transfers)", _RUNNER, "complete_bucket", ""),
    ("sync (transport finish)", "rl_sync.transport.local", "LocalTransport", "finish"),
    ("sync (transport finish)", "rl_sync.transport.gloo", "GlooTransport", "finish"),
    ("transport end_round (IPC: done event)", _IPC, "IpcTransport", "end_round"),
    ("worker IPC: open the round (check, ready event, page)", _WORKER, "WorkerRank", "_rl_sync_ipc_begin"),
    ("worker IPC: export moved?", _IPC, "WorkerExport", "moved"),
    ("worker IPC: ready event", _IPC, "WorkerExport", "begin"),
    ("worker IPC: waits for the trainer's word (page)", _IPC, "WorkerExport", "await_trainer"),
    ("worker IPC: end the round (stream waits, hook)", _WORKER, "WorkerRank", "_rl_sync_ipc_end"),
    ("worker IPC: stream waits on done", _IPC, "WorkerExport", "end"),
    ("trainer: waits for its worker and agrees (pairing)", "rl_sync.rank.pairing", "Pair", "agreed"),
    ("trainer: waits for the worker's word (page)", _IPC, "IpcTransport", "await_worker"),
    ("worker: a staged round's thread waited for", "rl_sync.rank.background", "BackgroundRound", "result"),
    ("commit: staged thread joined", _WORKER, "WorkerRank", "_rl_sync_end_background"),
    ("commit: shadows made live (KeptDestinations.commit)", "rl_sync.rank.kept", "KeptDestinations", "commit"),
    ("commit: copy or swap (Shadows.commit)", _SHADOW, "Shadows", "commit"),
    ("shadows: stale spares caught up (Shadows.prepare)", _SHADOW, "Shadows", "prepare"),
    ("shadows: copies (torch._foreach_copy_)", _SHADOW, "_copy", ""),
    ("CUDA synchronize (any caller)", "torch.cuda", "synchronize", ""),
    ("commit: watch slots over swapped storages", "rl_sync.rank.watch", "Watch", "over"),
    ("commit: watch settles swapped tensors", "rl_sync.rank.watch", "Watch", "settle"),
    ("commit: fallbacks loaded", _WORKER, "WorkerRank", "_rl_sync_load_fallbacks"),
    ("worker: weights-updated hook", _WORKER, "WorkerRank", "_rl_sync_updated"),
    ("vLLM hook (rl_sync_weights_updated)", "actors.vllm", "VllmWorkerMixin", "rl_sync_weights_updated"),
    ("vLLM: post-load processing (after_update)", _RELOAD, "Processor", "after_update"),
    ("vLLM: twins installed (install)", _RELOAD, "install", ""),
    ("vLLM: modules processed at the commit (reprocess)", _RELOAD, "reprocess", ""),
    ("vLLM: attention layers processed", _RELOAD, "Processor", "process_attention"),
    ("vLLM: cached prefixes forgotten", "rl_sync.vllm.prefix", "forget_cached_prefixes", ""),
    ("vLLM: its own prefix-cache reset", "vllm.entrypoints.llm", "LLM", "reset_prefix_cache"),
    ("vLLM: twins processed before the commit (prepare)", _RELOAD, "Processor", "prepare"),
]
"""(label, module, class or function, method): what is timed, in the processes that loaded the
module. A function (method "") is replaced in every loaded module that holds it by that name.
The methods Ray calls on an actor (`_rl_sync_commit`, `_rl_sync_staged`, `_rl_sync_record`)
cannot be: Ray holds them since the actor started. What they run is timed instead, and the
timeline's gaps hold the calls themselves."""


class _Recorder:
    """(label, start, end, depth) of every timed call in this process since the last `take`; kept
    on the actor (what the driver sends is unpickled anew each call, its globals with it). The
    depth counts per thread (a staged round runs on a thread of its own)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, float, float, int]] = []
        self._depth = threading.local()

    def timed(self, label: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            depth = getattr(self._depth, "value", 0)
            self._depth.value = depth + 1
            start = time.time()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.value = depth
                self.records.append((label, start, time.time(), depth))

        return timed


def install(actor) -> None:
    """Wrap every part of `PARTS` whose module this process loaded (once)."""
    if getattr(actor, "_round_profile", None) is not None:
        return
    recorder = actor._round_profile = _Recorder()
    for label, module_name, owner, method in PARTS:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        if method:
            cls = getattr(module, owner)
            if isinstance(actor, cls):  # Ray copies an actor's methods onto the class it makes of it
                cls = type(actor)
            setattr(cls, method, recorder.timed(label, getattr(cls, method)))
            continue
        original = getattr(module, owner)
        timed = recorder.timed(label, original)
        for used in list(sys.modules.values()):
            if getattr(used, "__dict__", {}).get(owner) is original:
                setattr(used, owner, timed)


def take(actor) -> list[tuple[str, float, float, int]]:
    """What was recorded since the last call, and forget it."""
    out, actor._round_profile.records = actor._round_profile.records, []
    return out


def timed_calls(actors: dict, repeat: int, call: Callable[[Any], float], before: Callable[[], Any]) -> list[dict]:
    """`repeat` times: `before()` (untimed; what it recorded is dropped), then `call(what before
    returned)`, which returns the coordinator's seconds for it, with the driver's start and end
    around it and what each of `actors` (name -> handle with `call`) recorded meanwhile."""
    import ray

    ray.get([a.call.remote(install) for a in actors.values()])
    out = []
    for _ in range(repeat):
        given = before()
        ray.get([a.call.remote(take) for a in actors.values()])
        start = time.time()
        seconds = call(given)
        end = time.time()
        recorded = dict(zip(actors, ray.get([a.call.remote(take) for a in actors.values()])))
        out.append({"start": start, "end": end, "coordinator_s": seconds, "recorded": recorded})
    return out


def profiled_rounds(sync, actors: dict, repeat: int) -> list[dict]:
    """`repeat` pushes, each with its driver start and end and what each actor recorded."""
    return timed_calls(actors, repeat, lambda _: sync.push().seconds, lambda: None)


def _parts(recorded: list[tuple[str, float, float, int]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, start, end, _ in recorded:
        out[label] = out.get(label, 0.0) + end - start
    return out


def report(rounds: list[dict], title: str, what: str = "round", nested: int = 0) -> None:
    """Print the parts of every actor and the timeline of the median call (by driver time);
    `what` the calls are (the coordinator's seconds name it); `nested`: how deep the timeline
    lists the parts inside the outermost ones (0: none)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    actors = list(rounds[0]["recorded"])
    table = Table(title=f"{title}: parts inside the actors, ms (median of {len(rounds)} calls)")
    table.add_column("part")
    for name in actors:
        table.add_column(name, justify="right")
    labels = list(dict.fromkeys(label for label, *_ in PARTS))
    for label in labels:
        cells = [statistics.median(_parts(r["recorded"][a]).get(label, 0.0) for r in rounds) * 1e3 for a in actors]
        if any(cells):
            table.add_row(label, *(f"{c:.2f}" for c in cells))
    console.print(table)
    mid = sorted(rounds, key=lambda r: r["end"] - r["start"])[len(rounds) // 2]
    console.print(_timeline(mid, what, nested))


def _timeline(round_: dict, what: str, nested: int):
    from rich.table import Table

    t0 = round_["start"]
    shown = sorted(
        (start, depth, end, actor, label)
        for actor, recorded in round_["recorded"].items()
        for label, start, end, depth in recorded
        if depth <= nested
    )
    table = Table(
        title="Timeline of the median call (outermost parts, what runs inside them indented; the gaps are "
        "Ray calls, coordinator, driver)"
    )
    for column in ("from ms", "ms", "where", "what"):
        table.add_column(column, justify="right" if column != "what" else "left")
    cursor, inside = t0, 0.0
    for start, depth, end, actor, label in shown:
        if depth:
            table.add_row(f"{(start - t0) * 1e3:.2f}", f"{(end - start) * 1e3:.2f}", actor, "  " * depth + label)
            continue
        if start - cursor > 5e-6:  # (shown to the hundredth of a millisecond)
            table.add_row(f"{(cursor - t0) * 1e3:.2f}", f"{(start - cursor) * 1e3:.2f}", "-", "gap")
        table.add_row(f"{(start - t0) * 1e3:.2f}", f"{(end - start) * 1e3:.2f}", actor, label)
        inside += end - max(start, cursor) if end > cursor else 0.0
        cursor = max(cursor, end)
    table.add_row(f"{(cursor - t0) * 1e3:.2f}", f"{(round_['end'] - cursor) * 1e3:.2f}", "-", "gap (to the driver)")
    total = round_["end"] - t0
    table.add_row(
        "",
        f"{total * 1e3:.2f}",
        "driver",
        f"the call; {inside * 1e3:.2f} ms inside the actors, {(total - inside) * 1e3:.2f} ms outside "
        f"(coordinator's {what} {round_['coordinator_s'] * 1e3:.2f} ms)",
    )
    return table


def main() -> None:
    """A Gloo round on this host's CPU, one trainer and one worker actor, `--tensors` tensors."""
    import os
    import sys
    from pathlib import Path

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback only (tests/conftest.py)
    import ray
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_common import specs_small, start_ray

    from actors import WeightSync
    from actors.ready import InferenceWorker, TrainerActor
    from actors.synthetic_actors import trainer_build, worker_build
    from rl_sync.config.sync import SyncConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=30000)
    parser.add_argument("--bytes", type=int, default=64 << 20, help="total bytes of the tensors")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    start_ray()
    specs = specs_small(args.bytes, args.tensors)
    trainer = ray.remote(TrainerActor).options(num_cpus=0).remote(0, 1, trainer_build(specs, "cpu"))
    worker = ray.remote(InferenceWorker).options(num_cpus=0).remote(0, 1, worker_build(specs, 1, "cpu"))
    config = SyncConfig(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", round_timeout_s=600, colocate="off")
    sync = WeightSync.create([trainer], [worker], config)
    sync.push()
    rounds = profiled_rounds(sync, {"trainer": trainer, "worker": worker}, args.repeat)
    report(rounds, f"Gloo on CPU, {len(specs):,} tensors")
    print(f"torch {torch.__version__}")
    sync.close()


if __name__ == "__main__":
    main()
