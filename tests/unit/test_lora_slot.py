"""A vLLM rank's LoRA slot driven through `actors.vllm.VllmWorkerMixin` without an engine: a LoRA
manager holding a real vLLM `RowParallelLinearWithLoRA` (its slots only), with the semantics
`rl_sync.vllm.lora` relies on (remove, add, pin: the slot reset, then the adapter copied in,
`lora_b` scaled)."""

from __future__ import annotations

import types

import pytest
import torch

from rl_sync.config.lora import LoraSpec
from rl_sync.rank.side import DescribeOptions
from rl_sync.vllm.binding import EngineRank

IN, OUT, R = 16, 12, 4
MODULE = "model.layers.0.mlp.down_proj"
A, B = f"base_model.model.{MODULE}.lora_A.weight", f"base_model.model.{MODULE}.lora_B.weight"
SPEC = LoraSpec(name="policy", lora_id=1, rank=R, alpha=3 * R)
"""Scaling 3: `lora_B` is received into a buffer and scaled into the slot."""


class Manager:
    """What `LoraSlots` touches of vLLM's LoRA model manager: two slots of one layer."""

    lora_config = types.SimpleNamespace(max_lora_rank=R, lora_dtype=torch.bfloat16)

    def __init__(self, layer):
        self.modules, self.lora_index_to_id, self.adapters = {MODULE: layer}, [None, None], {}
        self.packed_modules, self.packed_modules_mapping, self.supported_lora_modules = {}, {}, ["down_proj"]

    def remove_adapter(self, lora_id: int) -> bool:
        if lora_id in self.lora_index_to_id:
            self.lora_index_to_id[self.lora_index_to_id.index(lora_id)] = None
        return self.adapters.pop(lora_id, None) is not None

    def add_adapter(self, adapter) -> None:
        self.adapters[adapter.id] = adapter

    def pin_adapter(self, lora_id: int) -> None:
        slot = self.lora_index_to_id.index(None)
        self.lora_index_to_id[slot] = lora_id
        weights, layer = self.adapters[lora_id].loras[MODULE], self.modules[MODULE]
        layer.lora_a_stacked[0][slot].zero_()
        layer.lora_b_stacked[0][slot].zero_()
        layer.lora_a_stacked[0][slot, 0, :R].copy_(weights.lora_a)
        layer.lora_b_stacked[0][slot, 0, :, :R].copy_(weights.lora_b * weights.scaling)

    def list_adapters(self) -> dict:
        return dict(self.adapters)


@pytest.fixture
def rank(monkeypatch):
    """A TP1 vLLM rank (`VllmWorkerMixin`) bound to a LoRA group, and its layer."""
    pytest.importorskip("vllm")
    from vllm.lora.layers import RowParallelLinearWithLoRA

    import actors.vllm as vllm_actors

    layer = object.__new__(RowParallelLinearWithLoRA)
    layer.__dict__.update(
        tp_size=1,
        tp_rank=0,
        n_slices=1,
        input_size=IN,
        lora_a_stacked=(torch.zeros(2, 1, R, IN, dtype=torch.bfloat16),),
        lora_b_stacked=(torch.zeros(2, 1, OUT, R, dtype=torch.bfloat16),),
    )
    model = types.SimpleNamespace(lora_manager=Manager(layer))
    engine = types.SimpleNamespace(model=model, vllm_config=None)
    monkeypatch.setattr(vllm_actors.VllmDestinations, "of_llm", classmethod(lambda cls, llm: engine))
    monkeypatch.setattr(vllm_actors, "engine_rank_of", lambda config, rank, size: EngineRank(0, 1, lambda o: [o]))
    monkeypatch.setattr(vllm_actors, "forget_cached_prefixes", lambda llm, ahead=None: None)

    class Rank(vllm_actors.VllmWorkerMixin):
        def rl_sync_llm(self):
            return None

    worker = Rank()
    worker._rl_sync_describe("worker", 0, 1, OPTIONS)
    return worker, layer


OPTIONS = DescribeOptions(checkpoint={A: ("bfloat16", (R, IN)), B: ("bfloat16", (OUT, R))}, lora=SPEC)


def _slot(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.lora_a_stacked[0][0, 0, :R], layer.lora_b_stacked[0][0, 0, :, :R]


def _round(worker, version: int, a: torch.Tensor, b: torch.Tensor) -> None:
    """What a round does on the rank: the transport writes, the hook runs, the version is recorded."""
    views = worker._rl_sync_kept.entries.endpoints
    views[A].tensor.copy_(a)
    views[B].tensor.copy_(b)
    worker._rl_sync_updated(None)
    worker._rl_sync_written = version
    assert worker._rl_sync_record(version)


def test_a_repair_binds_the_slot_anew_and_reports_no_version_until_a_round_fills_it(rank):
    worker, layer = rank
    a, b = torch.randn(R, IN).bfloat16(), torch.randn(OUT, R).bfloat16()
    _round(worker, 5, a, b)
    assert torch.equal(_slot(layer)[0], a) and torch.equal(_slot(layer)[1], b * 3)
    assert worker._rl_sync_version_of() == 5
    worker._rl_sync_leave(abort=True)
    worker._rl_sync_describe("worker", 0, 1, OPTIONS)  # a repair binds every worker again
    assert worker._rl_sync_version_of() is None, "the slot was registered anew, from zeros"
    assert not _slot(layer)[1].any()
    assert not worker._rl_sync_kept.entries.endpoints[B].tensor.any(), "the scaled matrix's buffer holds zeros"
    _round(worker, 6, a, b)
    assert torch.equal(_slot(layer)[1], b * 3) and worker._rl_sync_version_of() == 6


def test_patches_reach_the_slot_scaled(rank):
    worker, layer = rank
    a, b = torch.randn(R, IN).bfloat16(), torch.randn(OUT, R).bfloat16()
    _round(worker, 1, a, b)
    worker._rl_sync_apply_patches(2, {B: (torch.tensor([0, 5]), torch.tensor([0.5, -1.0]))})
    assert worker._rl_sync_record(2)
    expected = b.clone().flatten()
    expected[[0, 5]] = torch.tensor([0.5, -1.0], dtype=torch.bfloat16)
    assert torch.equal(_slot(layer)[1], expected.reshape(OUT, R) * 3)
    assert torch.equal(_slot(layer)[0], a)


def test_an_adapter_that_lost_its_slot_reports_no_version_and_refuses_what_would_write_it(rank):
    """vLLM's LoRA state reset (the adapter removed): the rank reports no version, and a round, a
    commit or patches refuse before anything is written."""
    worker, _ = rank
    a, b = torch.randn(R, IN).bfloat16(), torch.randn(OUT, R).bfloat16()
    _round(worker, 1, a, b)
    manager = worker._rl_sync_lora.model.lora_manager
    manager.remove_adapter(SPEC.lora_id)
    assert worker._rl_sync_version_of() is None
    refused = r"^vLLM rank 0: adapter 'policy' \(id 1\) no longer holds LoRA slot 0 \(it holds None; the engine's LoRA "
    with pytest.raises(ValueError, match=refused):
        worker._rl_sync_apply_patches(2, {B: (torch.tensor([0]), torch.tensor([0.5]))})
    with pytest.raises(ValueError, match=refused):
        worker._rl_sync_follow(lambda rebound: None)
    assert torch.equal(worker._rl_sync_kept.entries.endpoints[B].tensor, b), "nothing was written"


def test_a_lora_id_the_engine_serves_already_is_refused_before_anything_changes(rank):
    worker, _ = rank
    manager = worker._rl_sync_lora.model.lora_manager
    other = types.SimpleNamespace(id=SPEC.lora_id)
    manager.remove_adapter(SPEC.lora_id)
    manager.add_adapter(other)  # an adapter the engine loaded itself, under the spec's id
    worker._rl_sync_leave(abort=True)
    with pytest.raises(
        ValueError,
        match=r"^vLLM rank 0: lora_id 1 is taken by an adapter the engine loaded itself; give LoraSpec 'policy' a "
        r"lora_id the engine does not serve$",
    ):
        worker._rl_sync_describe("worker", 0, 1, OPTIONS)
    assert manager.list_adapters()[SPEC.lora_id] is other
