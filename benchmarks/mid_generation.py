"""A staged round staged and committed while a TP1 vLLM engine generates: its commit lands between
two of the engine's steps (`rl_sync.rank.steps`). Shared by `staged_bench.py` and
`vllm_gpu_bench.py`.

    figures = commit_mid_generation(sync, engine.ranks[0], (prompts, sampling, None))
    figures["stall_s"]      # what the engine stopped for (RoundStats.stall_seconds)
"""

from __future__ import annotations

import time

import ray

from actors import WeightSync
from rl_sync.rank.steps import CONTROL_GROUP

DECODING_S = 0.2
"""How long the generation runs before the round is staged (its prefill done by then)."""


def _state(rank_self) -> tuple[bool, int]:
    """Whether the engine has requests, and its commits made between two steps."""
    return rank_self.llm.llm_engine.has_unfinished_requests(), rank_self._rl_sync_steps().between_steps


def generation_seconds(rank, generation: tuple) -> float:
    """Seconds of `generation` (`generate`'s arguments) on an engine's only rank."""
    start = time.perf_counter()
    ray.get(rank.generate.remote(*generation), timeout=600)
    return time.perf_counter() - start


def commit_mid_generation(sync: WeightSync, rank, generation: tuple) -> dict:
    """Start `generation` on the engine's only `rank`, stage and commit a round once it decodes:
    the commit step, the engine's stall, whether the commit landed between two steps (the
    generation still running when it returned), and the generation's seconds."""
    control = rank.call.options(concurrency_group=CONTROL_GROUP)
    before = ray.get(control.remote(_state), timeout=60)[1]
    start = time.perf_counter()
    running = rank.generate.remote(*generation)
    deadline = time.monotonic() + 60
    while not ray.get(control.remote(_state), timeout=60)[0]:
        if time.monotonic() > deadline:
            raise TimeoutError("the generation did not start within 60 s")
        time.sleep(0.001)
    time.sleep(DECODING_S)
    stats = sync.stage().commit()
    still = not ray.wait([running], timeout=0)[0]
    ray.get(running, timeout=600)
    took = time.perf_counter() - start
    after = ray.get(control.remote(_state), timeout=60)[1]
    return {
        "step_s": stats.commit_seconds,
        "stall_s": stats.stall_seconds,
        "between_steps": int(still) * (after - before),
        "generation_s": took,
    }
