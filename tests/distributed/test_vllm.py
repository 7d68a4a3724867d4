"""FSDP2 trainers into real vLLM engines (the CPU build), checked against vLLM itself.

Each engine rank is a Ray actor holding an `LLM` (external launcher). After
every AdamW step and push, the synced engine must generate exactly what a
fresh engine generates from the trainers' full checkpoint on disk (greedy
token ids and their log-probabilities, with prefix caching on, so a prefix
cached before the update would show); every worker receives exactly the
bytes of what it keeps."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import ray
import torch

from actors import SyncError, WeightSync
from actors.cluster import free_init_url
from actors.models import HFTrainer
from actors.service import VllmService
from actors.vllm import RANK_GROUPS, VllmEngine, VllmRankActor
from rl_sync.rank.steps import CONTROL_GROUP

from .arch_sweep import generating_config
from .conftest import loopback_config
from .harness import POOL
from .vllm_oracle import (
    ENV,
    LLM_KWARGS,
    PROMPTS,
    SAMPLING,
    References,
    generate_http,
    hf_config,
    launch,
    launch_service,
    served,
    write_checkpoint,
)


class ExtraSourcesTrainer(HFTrainer):
    """A trainer whose sources can be altered from the test (`self.alter(sources)`)."""

    alter = None

    def rl_sync_sources(self):
        sources = super().rl_sync_sources()
        return sources if self.alter is None else self.alter(sources)


class ProbeRank(VllmRankActor):
    """A vLLM rank a test can make disagree (rank 1 reports another layout for one tensor than
    rank 0 resolved) or die (its process exits when a round starts)."""

    disagree = die = False

    def rl_sync_destinations(self, checkpoint):
        from dataclasses import replace

        from rl_sync.planning.layout import Layout, Mesh

        out = dict(super().rl_sync_destinations(checkpoint))
        if self.disagree and self.tp_rank == 1:
            name = "model.norm.weight"
            out[name] = replace(out[name], layout=Layout.replicated(Mesh((2,))))
        return out

    def _rl_sync_before_round(self, round_info):
        if self.die:
            os._exit(1)
        super()._rl_sync_before_round(round_info)


class ReusedEngine:
    """One TP2 engine's rank actors, shared by the tests of this module: each test builds a
    fresh `LLM` in them from its own checkpoint (vLLM is imported there once)."""

    def __init__(self):
        Rank = ray.remote(num_cpus=0.1, max_restarts=0, concurrency_groups=RANK_GROUPS)(ProbeRank)
        ranks = [Rank.remote(r, 2, None, ENV, control_group=CONTROL_GROUP) for r in range(2)]
        self.engine, self.started = VllmEngine(ranks), False

    def load(self, path: str) -> VllmEngine:
        (self.engine.restart if self.started else self.engine.start)(path, LLM_KWARGS)
        self.started = True
        return self.engine

    def set(self, rank: int, **flags) -> None:
        ray.get(self.engine.ranks[rank].call.remote(lambda self: self.__dict__.update(flags)))


Trainer = ray.remote(num_cpus=0.1)(ExtraSourcesTrainer)
TOKENS = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def tp2(ray_session):
    reused = ReusedEngine()
    yield reused
    reused.engine.shutdown()


@pytest.fixture(scope="module")
def references(ray_session):
    refs = References()
    yield refs
    refs.shutdown()


def _trainers(config: dict) -> list:
    url = free_init_url("127.0.0.1")
    return POOL.take(Trainer, [(i, 2, config, url) for i in range(2)])


def _state(trainers) -> dict[str, torch.Tensor]:
    return ray.get([t.full_state.remote() for t in trainers])[0]


def _prefix_roots(ranks) -> list[bytes]:
    """Each rank's root of vLLM's prefix hashes (`rl_sync.vllm.prefix`: a round replaces it)."""

    def root(_rank) -> bytes:
        from vllm.v1.core import kv_cache_utils

        return kv_cache_utils.NONE_HASH

    return ray.get([rank.call.remote(root) for rank in ranks])


def _unrelated_checkpoint(path, config: dict, trainers) -> str:
    """A checkpoint of the right shapes holding other values than the trainers'."""
    gen = torch.Generator().manual_seed(7)
    state = {k: torch.randn(v.shape, generator=gen) for k, v in _state(trainers).items()}
    return write_checkpoint(str(path), config, state)


@pytest.mark.parametrize(
    "family, tp, engines, modes",
    [
        pytest.param("qwen2", 1, 2, ["m2n"] * 3, marks=pytest.mark.slow),  # 2 to 2.5 min: CI's 25 minutes
        ("qwen2", 2, 1, ["sparse", "sparse", "auto"]),
        ("qwen3_moe", 2, 1, ["m2n"] * 3),
        ("phi3", 2, 1, ["m2n"]),  # q|k|v and gate|up fused along the dim FSDP shards: parts, no fallback
        ("gpt2", 2, 1, ["sparse", "sparse"]),  # transposed Conv1D weights, fused c_attn along the other dim
    ],
)
def test_synced_engines_generate_what_a_fresh_engine_on_the_checkpoint_does(
    references, tp2, tmp_path, family, tp, engines, modes
):
    """Two replicas at TP1 share the trainers' sends; sparse and auto rounds (after the first,
    dense one) go into the same destinations, in place and into vLLM's loader-form buffers."""
    config = hf_config(family)
    trainers = _trainers(config)
    init = _unrelated_checkpoint(tmp_path / "init", config, trainers)
    replicas = [tp2.load(init)] if (tp, engines) == (2, 1) else [launch(init, tp) for _ in range(engines)]
    ranks = [rank for engine in replicas for rank in engine.ranks]
    try:
        sync = WeightSync.create(trainers, ranks, loopback_config(bucket_bytes=1 << 18))
        assert sync.summary.fallbacks == () and sync.summary.fallback_reasons == {}, "every tensor binds"
        assert set(sync.summary.modes.values()) <= {"direct", "reload"}
        kept = list(sync.summary.kept_bytes)
        for step, mode in enumerate(modes, start=1):
            ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
            roots = _prefix_roots(ranks)
            stats = sync.push(mode=mode)
            assert all(a != b for a, b in zip(roots, _prefix_roots(ranks))), "each rank took the O(1) path"
            assert stats.mode == (mode if step > 1 else "m2n"), "the first round is dense, the next ones as asked"
            received = [next(r.received_bytes for r in stats.ranks if r.rank == 2 + j) for j in range(len(ranks))]
            if stats.mode == "m2n":
                assert received == kept, f"step {step}: bytes into each rank {received}, its shards hold {kept}"
            path = write_checkpoint(str(tmp_path / f"step{step}"), config, _state(trainers))
            want = references.outputs(path, tp)
            for e, engine in enumerate(replicas):
                assert engine.generate(PROMPTS, **SAMPLING) == want, f"step {step}: engine {e} differs from a fresh one"
            assert sync.versions() == [step] * len(ranks)
        sync.close()
    finally:
        for engine in replicas:
            if engine is not tp2.engine:
                engine.shutdown()
        POOL.give_back(Trainer, trainers)


UNTRAINABLE = {
    "DeepseekV3ForCausalLM": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at "
    "non-singleton dimension 1",
    "MiniCPM3ForCausalLM": "RuntimeError: The size of tensor a (4) must match the size of tensor b (8) at "
    "non-singleton dimension 1",
    "Qwen3NextForCausalLM": "ValueError: `get_seq_length` can only be called on Attention layers, and the "
    "current Cache seem to only contain LinearAttention layers.",
}
"""Architectures whose generating config's transformers model fails its own training step (the
MLA ones with a head size of 32; Qwen3-Next with two layers, both linear attention): checked
parameter by parameter by the sweep only."""


def _sent_as_named() -> list:
    """The architectures the recorded sweep found supported from FSDP2's own names."""
    recorded = json.loads((Path(__file__).resolve().parents[2] / "docs" / "architectures.json").read_text())
    return [
        pytest.param(a, marks=pytest.mark.skip(reason=f"transformers' training step: {UNTRAINABLE[a]}"))
        if a in UNTRAINABLE
        else a
        for a, o in recorded.items()
        if o["status"] == "supported" and o["names"] == "parameters"
    ]


@pytest.mark.slow  # about a minute an architecture: every one the sweep supports is CI's 25 minutes twice
@pytest.mark.parametrize("architecture", _sent_as_named())
def test_one_push_into_any_supported_architecture_generates_what_a_fresh_engine_does(
    references, tp2, tmp_path, architecture
):
    """FSDP2 trainers of a tiny model of each architecture `arch_sweep` supports push once into
    the shared TP2 engine: no fallback, each rank receives exactly what it keeps, and the engine
    generates what a fresh one loading the trainers' checkpoint does."""
    config = generating_config(architecture)
    trainers = _trainers(config)
    try:
        engine = tp2.load(_unrelated_checkpoint(tmp_path / "init", config, trainers))
        sync = WeightSync.create(trainers, engine.ranks, loopback_config(bucket_bytes=1 << 18))
        assert sync.summary.fallback_reasons == {}, f"{architecture}: {sync.summary.fallback_reasons}"
        ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
        stats = sync.push()
        assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == list(sync.summary.kept_bytes)
        path = write_checkpoint(str(tmp_path / "pushed"), config, _state(trainers))
        assert engine.generate(PROMPTS, **SAMPLING) == references.outputs(path, 2), f"{architecture} differs"
        sync.close()
    finally:
        POOL.give_back(Trainer, trainers)


def _set(alter):
    def apply(trainer):
        trainer.alter = alter

    return apply


@pytest.fixture(scope="module")
def qwen2_tp2(tp2, tmp_path_factory):
    """One TP2 engine and its trainers, shared by the bad-input tests (none may write into it)."""
    config = hf_config("qwen2")
    trainers = _trainers(config)
    engine = tp2.load(_unrelated_checkpoint(tmp_path_factory.mktemp("bad") / "init", config, trainers))
    yield config, trainers, engine
    POOL.give_back(Trainer, trainers)


@pytest.mark.parametrize(
    "alter, message",
    [
        (
            lambda s: {**s, "model.layers.0.mlp.bogus.weight": torch.zeros(4, 4)},
            r"vLLM rank \d: checkpoint tensor 'model.layers.0.mlp.bogus.weight' is refused by vLLM's loader",
        ),
        (
            lambda s: {**s, "model.norm.weight": torch.zeros(64)},
            r"vLLM rank \d: checkpoint tensor 'model.norm.weight' is refused by vLLM's loader \(AssertionError: .*64",
        ),
        (
            lambda s: {**s, "model.norm.weight": torch.zeros(128, dtype=torch.int32)},
            r"tensor 'model.norm.weight': source dtype 'int32' and destination dtype 'bfloat16' disagree",
        ),
    ],
)
def test_bad_checkpoints_fail_init_naming_the_tensor_and_write_nothing(qwen2_tp2, alter, message):
    _, trainers, engine = qwen2_tp2
    before = engine.generate(PROMPTS, **SAMPLING)
    ray.get([t.call.remote(_set(alter)) for t in trainers])
    try:
        with pytest.raises(ValueError, match=message):
            WeightSync.create(trainers, engine.ranks, loopback_config())
    finally:
        ray.get([t.call.remote(_set(None)) for t in trainers])
    assert engine.generate(PROMPTS, **SAMPLING) == before, "a failed init changed the engine's weights"


def test_ranks_that_disagree_fail_init_naming_the_tensor_and_rank(qwen2_tp2, tp2):
    _, trainers, engine = qwen2_tp2
    tp2.set(1, disagree=True)
    try:
        with pytest.raises(
            ValueError, match=r"inference workers disagree on tensor 'model.norm.weight': worker rank 3 "
        ):
            WeightSync.create(trainers, engine.ranks, loopback_config())
    finally:
        tp2.set(1, disagree=False)


def _norm_address(rank) -> int:
    model = rank.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
    return dict(model.named_parameters())["model.norm.weight"].data_ptr()


@pytest.mark.parametrize(
    "family, modes",
    [
        ("qwen2", ["m2n", "sparse", "sparse"]),
        pytest.param("qwen3_moe", ["m2n", "m2n"], marks=pytest.mark.slow),  # 30 s: CI's 25 minutes
    ],
)
def test_staged_rounds_arrive_while_the_engine_generates_then_match_a_fresh_engine(
    references, tp2, tmp_path, family, modes
):
    """Each round lands in the ranks' shadows on threads of their own while the engine generates
    with the version it holds, and vLLM's processing of what it changed runs there too, on twins
    of the modules; the commit between generations swaps the loader-form buffers and (the engine
    running eagerly) the live parameters, and installs the twins' packed kernels."""
    config = hf_config(family)
    trainers = _trainers(config)
    engine = tp2.load(_unrelated_checkpoint(tmp_path / "init", config, trainers))
    try:
        sync = WeightSync.create(trainers, engine.ranks, loopback_config(bucket_bytes=1 << 18, double_buffer=True))
        served = engine.generate(PROMPTS, **SAMPLING)
        for step, mode in enumerate(modes, start=1):
            ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
            address = ray.get(engine.ranks[0].call.remote(_norm_address))
            staged = sync.stage(mode=mode)
            assert engine.generate(PROMPTS, **SAMPLING) == served, f"step {step}: the engine served a torn version"
            stats = staged.commit()
            assert (stats.mode, stats.version) == (("m2n" if step < 3 else "sparse"), step)
            assert sync.versions() == [step, step]
            assert ray.get(engine.ranks[0].call.remote(_norm_address)) != address, "a swap, not a copy"
            path = write_checkpoint(str(tmp_path / f"step{step}"), config, _state(trainers))
            served = engine.generate(PROMPTS, **SAMPLING)
            assert served == references.outputs(path, 2), f"step {step}: synced engine differs from a fresh one"
        sync.close()
    finally:
        POOL.give_back(Trainer, trainers)


def _gate(rank) -> tuple[bool, int, int | None]:
    """Whether the rank's engine has requests, its commits made between two steps and the step
    before which the last was (read on the rank's control thread: its main one may be generating)."""
    gate = rank._rl_sync_steps()
    return rank.llm.llm_engine.has_unfinished_requests(), gate.between_steps, gate.last_at_step


def _in_control(rank, fn, *args):
    return rank.call.options(concurrency_group=CONTROL_GROUP).remote(fn, *args)


def _generating(engine: VllmEngine, prompts) -> list:
    """A long greedy generation started on every rank (its references), once it runs."""
    refs = [
        r.generate.remote(prompts, dict(max_tokens=80, temperature=0.0, ignore_eos=True), None) for r in engine.ranks
    ]
    deadline = time.monotonic() + 60
    while not all(g for g, _, _ in ray.get([_in_control(r, _gate) for r in engine.ranks], timeout=30)):
        assert time.monotonic() < deadline, "the generation never started"
        time.sleep(0.01)
    return refs


@pytest.mark.parametrize("tp", [1, 2])
def test_a_commit_asked_for_mid_generation_lands_between_two_steps_then_the_engine_matches_a_fresh_one(
    references, tp2, tmp_path, tp
):
    """A staged round's commit reaches a generating engine on its ranks' control threads, is made
    between two steps and the generation goes on (its requests keep their KV); the ranks of a TP2
    engine, armed first, all make it before the same step. No prefix cached before it is served
    after it (the long prompt fills a cache block)."""
    config = hf_config("qwen2")
    trainers = _trainers(config)
    init = _unrelated_checkpoint(tmp_path / "init", config, trainers)
    engine = references.lend(init, 1) if tp == 1 else tp2.load(init)
    try:
        sync = WeightSync.create(trainers, engine.ranks, loopback_config(double_buffer=True))
        sync.push()
        ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
        staged = sync.stage()
        running = _generating(engine, PROMPTS * 8)
        stats = staged.commit()
        unfinished = len(ray.wait(running, num_returns=len(running), timeout=0)[1])
        outputs = ray.get(running, timeout=120)[0]
        assert [len(o["tokens"]) for o in outputs] == [80] * len(outputs)
        gates = ray.get([_in_control(r, _gate) for r in engine.ranks])
        assert unfinished == tp and [n for _, n, _ in gates] == [1] * tp, "made between two steps, generation went on"
        assert len({at for _, _, at in gates}) == 1, f"every rank switched before the same step: {gates}"
        assert stats.stall_seconds > 0 and sync.versions() == [2] * tp
        path = write_checkpoint(str(tmp_path / "step"), config, _state(trainers))
        served = engine.generate(PROMPTS, **SAMPLING)
        sync.close()
        assert served == references.outputs(path, tp), "synced engine differs from a fresh one"
    finally:
        POOL.give_back(Trainer, trainers)


def test_an_engine_joining_a_live_group_catches_up_from_a_peer_then_generates_like_a_fresh_engine(
    references, tp2, tmp_path
):
    """A second TP2 engine joins while the first holds version 1 and the trainers already stepped
    on: it binds for two replicas, the first sends it what it holds (vLLM's loader-form buffers
    too, processed after) without binding anew, and both then generate what a fresh engine on
    version 1 does; the next push reaches both, and the first leaves, then joins again for the
    next push (`catch_up="next_push"`), which catches it up dense. The joining engine is the
    module's reference engine, lent once this test's references are generated (CI's 25 minutes)."""
    config = hf_config("qwen2")
    trainers = _trainers(config)
    init = _unrelated_checkpoint(tmp_path / "init", config, trainers)
    first = tp2.load(init)
    try:
        sync = WeightSync.create(trainers, first.ranks, loopback_config(bucket_bytes=1 << 18))
        kept = list(sync.summary.kept_bytes)
        ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
        sync.push()
        held = references.outputs(write_checkpoint(str(tmp_path / "step1"), config, _state(trainers)), 2)
        ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
        stepped = references.outputs(write_checkpoint(str(tmp_path / "step2"), config, _state(trainers)), 2)
        second = references.lend(init, 2)
        assert second.generate(PROMPTS, **SAMPLING) != held, "the joining engine starts from other weights"
        address = ray.get(first.ranks[0].call.remote(_norm_address))
        assert list(sync.add_engine(second.ranks).kept_bytes) == kept * 2
        assert sync.versions() == [1] * 4
        assert ray.get(first.ranks[0].call.remote(_norm_address)) == address, "the first engine kept its binding"
        assert second.generate(PROMPTS, **SAMPLING) == held == first.generate(PROMPTS, **SAMPLING)
        stats = sync.push()
        assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == kept * 2
        assert second.generate(PROMPTS, **SAMPLING) == stepped == first.generate(PROMPTS, **SAMPLING)
        sync.remove_engine(first.ranks)
        assert sync.versions() == [2, 2]
        sync.add_engine(first.ranks, catch_up="next_push")  # back, caught up by the next push
        assert sync.versions() == [2, 2, None, None], "its buffers, bound anew, hold nothing until the push"
        ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
        stats = sync.push(mode="sparse")
        assert stats.mode == "m2n" and sync.versions() == [3] * 4
        assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == kept * 2
        third = second.generate(PROMPTS, **SAMPLING)
        assert third != stepped and first.generate(PROMPTS, **SAMPLING) == third
        sync.close()
    finally:
        POOL.give_back(Trainer, trainers)


@pytest.mark.slow  # 2 min; test_vllm_trainer_api.py drives the same backend through vLLM's calls
def test_engine_service_driven_through_vllms_weight_transfer_calls(references, tmp_path):
    """rl-sync as vLLM's `rl_sync` weight-transfer backend: the engine's workers are vLLM's own
    processes, reached only through `init_weight_transfer_engine` / `update_weights` (double
    buffered: the first round lands in shadows, committed by a second `update_weights`; the
    second is staged, received on threads of the workers while the engine generates)."""
    config = hf_config("qwen2")
    trainers = _trainers(config)
    service = launch_service(_unrelated_checkpoint(tmp_path / "init", config, trainers), 2)
    try:
        sync = WeightSync.create(trainers, [service], loopback_config(bucket_bytes=1 << 18, double_buffer=True))
        assert sync.summary.fallbacks == () and sync.summary.world_size == 4
        served = None
        for step in range(1, 3):
            ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
            if step == 1:
                stats = sync.push()
            else:
                staged = sync.stage()
                assert service.generate(PROMPTS, **SAMPLING) == served, "the service served a torn version"
                stats = staged.commit()
            received = [r.received_bytes for r in stats.ranks if r.role == "worker"]
            assert [r.rank for r in stats.ranks if r.role == "worker"] == [2, 3]
            assert received == list(sync.summary.kept_bytes), f"bytes into each rank {received}"
            assert sync.versions() == [step, step]
            served = service.generate(PROMPTS, **SAMPLING)
            path = write_checkpoint(str(tmp_path / f"step{step}"), config, _state(trainers))
            assert served == references.outputs(path, 2), f"step {step}: synced service differs from a fresh engine"
        sync.close()
    finally:
        service.shutdown()
        POOL.give_back(Trainer, trainers)


@pytest.mark.slow  # 95-105 s (a `vllm serve` process and a TP1 reference engine): CI's 25 minutes
def test_vllm_serve_synced_over_http(references, tmp_path):
    """`vllm serve` with rl-sync as its backend, driven over HTTP (vLLM's weight-transfer
    routes, generation paused around each round); read back through its generate route."""
    config = hf_config("qwen2")
    trainers = _trainers(config)
    init = _unrelated_checkpoint(tmp_path / "init", config, trainers)
    try:
        with served(init, 1, str(tmp_path / "serve.log")) as url:
            sync = WeightSync.create(trainers, [VllmService.http(url, ranks=1)], loopback_config(bucket_bytes=1 << 18))
            ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
            stats = sync.push()
            assert [r.received_bytes for r in stats.ranks if r.role == "worker"] == list(sync.summary.kept_bytes)
            assert sync.versions() == [1]
            path = write_checkpoint(str(tmp_path / "step1"), config, _state(trainers))
            assert generate_http(url) == references.outputs(path, 1), "served engine differs from a fresh one"
            sync.close()
    finally:
        POOL.give_back(Trainer, trainers)


@pytest.mark.slow  # 75 s: CI's 25 minutes (rank deaths are covered on rl-sync's workers in the default run)
def test_a_rank_killed_mid_round_fails_in_time_then_a_relaunched_engine_catches_up(references, tp2, tmp_path):
    """Kills the module's shared TP2 engine: the last test here to use it."""
    config = hf_config("qwen2")
    trainers = _trainers(config)
    init = _unrelated_checkpoint(tmp_path / "init", config, trainers)
    engine, fresh = tp2.load(init), None
    try:
        sync = WeightSync.create(trainers, engine.ranks, loopback_config(round_timeout_s=8.0))
        sync.push()
        tp2.set(1, die=True)
        start = time.monotonic()
        with pytest.raises(SyncError, match=r"round 2 \(m2n\) failed"):
            sync.push()
        assert time.monotonic() - start < 8.0 + 10.0, "the round outlived its timeout"
        with pytest.raises(
            SyncError,
            match=r"worker 1 \(rank 3\): ActorDiedError.*\n.*launch the engine again and "
            r"replace every one of its ranks",
        ):
            sync.push()
        fresh = launch(init, 2)
        for j, rank in enumerate(fresh.ranks):
            sync.replace_worker(j, rank)
        ray.get([t.train_step.remote(TOKENS, 1e-2) for t in trainers])
        stats = sync.push()
        assert stats.version == 2 and fresh.versions() == [2, 2]
        path = write_checkpoint(str(tmp_path / "after"), config, _state(trainers))
        assert fresh.generate(PROMPTS, **SAMPLING) == references.outputs(path, 2)
        sync.close()
    finally:
        if fresh is not None:
            fresh.shutdown()
        POOL.give_back(Trainer, trainers)
