"""A staged round staged and committed while a vLLM engine generates: its commit lands between
two of the engine's steps, the same one on every rank (`rl_sync.rank.steps`). Shared by
`staged_bench.py` and `vllm_gpu_bench.py`.

    figures = commit_mid_generation(sync, engine.ranks, (prompts, sampling, None))
    figures["stall_s"]      # what the engine stopped for (RoundStats.stall_seconds)
    ray.get(rank.call.remote(time_steps))   # then each generation's steps: ray.get(rank.call.remote(step_summary))
"""

from __future__ import annotations

import time

import ray

from actors import WeightSync
from rl_sync.rank.steps import CONTROL_GROUP

DECODING_S = 0.2
"""How long the generation runs before the round is staged (its prefill done by then)."""


def _state(rank_self) -> tuple[bool, int, int | None]:
    """Whether the engine has requests, its commits made between two steps, and the step before
    which the last was."""
    gate = rank_self._rl_sync_steps()
    return rank_self.llm.llm_engine.has_unfinished_requests(), gate.between_steps, gate.last_at_step


def time_steps(rank_self) -> None:
    """Time each of the engine's steps from now on (around rl-sync's own wrapper, installed by
    the generations before), for `step_summary`."""
    engine = rank_self.llm.llm_engine
    if hasattr(engine, "bench_steps"):
        return
    inner, engine.bench_steps = engine.step, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            engine.bench_steps.append((start, time.perf_counter() - start))

    engine.step = timed


def step_summary(rank_self) -> dict:
    """The steps timed since the last call (`time_steps`): how many, their seconds in all, the
    seconds from the first's start to the last's end (the gaps between steps included), the
    median, the five longest and every step in order (ms)."""
    timed, rank_self.llm.llm_engine.bench_steps = rank_self.llm.llm_engine.bench_steps, []
    steps = [took for _, took in timed]
    ordered = sorted(steps)
    return {
        "steps": len(steps),
        "total_s": round(sum(steps), 3),
        "span_s": round(timed[-1][0] + timed[-1][1] - timed[0][0], 3) if timed else 0.0,
        "median_ms": round(1e3 * ordered[len(ordered) // 2], 2) if steps else 0.0,
        "longest_ms": [round(1e3 * t, 1) for t in ordered[-5:][::-1]],
        "each_ms": [round(1e3 * t, 2) for t in steps],
    }


def generation_seconds(rank, generation: tuple) -> float:
    """Seconds of `generation` (`generate`'s arguments) on an engine's only rank."""
    start = time.perf_counter()
    ray.get(rank.generate.remote(*generation), timeout=600)
    return time.perf_counter() - start


def _states(ranks: list) -> list[tuple[bool, int, int | None]]:
    return ray.get([r.call.options(concurrency_group=CONTROL_GROUP).remote(_state) for r in ranks], timeout=60)


def commit_mid_generation(sync: WeightSync, ranks: list, generation: tuple) -> dict:
    """Start `generation` on every rank of one engine, stage and commit a round once it decodes:
    the commit step, the engine's stall, whether the commit landed between two steps (the
    generation still running when it returned; on every rank, before the same step), and the
    generation's seconds."""
    before = sum(n for _, n, _ in _states(ranks))
    start = time.perf_counter()
    running = [r.generate.remote(*generation) for r in ranks]
    deadline = time.monotonic() + 60
    while not all(generating for generating, _, _ in _states(ranks)):
        if time.monotonic() > deadline:
            raise TimeoutError("the generation did not start within 60 s")
        time.sleep(0.001)
    time.sleep(DECODING_S)
    stats = sync.stage().commit()
    still = len(ray.wait(running, num_returns=len(running), timeout=0)[1]) == len(running)
    ray.get(running, timeout=600)
    took = time.perf_counter() - start
    after = _states(ranks)
    same_step = len({at for _, _, at in after}) == 1
    made = sum(n for _, n, _ in after) - before == len(ranks)
    return {
        "step_s": stats.commit_seconds,
        "stall_s": stats.stall_seconds,
        "between_steps": int(still and same_step and made),
        "generation_s": took,
    }
