"""What differs between vLLM 0.26 (the CUDA build on the GPU machines) and 0.32 (the CPU build
here): the compatibility module answers for both, and the probe sees the copies of loaders that
vLLM's online processing wraps (online FP8 keeps those wrappers after loading)."""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("vllm")

from rl_sync.vllm import compat
from rl_sync.vllm.probe import probe_loads


@pytest.fixture
def fresh_compat():
    """`compat` reads vLLM once per process: forget what it read, before and after the test."""
    for cached in (compat.loaded_never_on_meta, compat._deferred_attention_test):
        cached.cache_clear()
    yield
    for cached in (compat.loaded_never_on_meta, compat._deferred_attention_test):
        cached.cache_clear()


def test_a_linear_bias_is_loaded_but_never_on_meta_in_0_32_and_nothing_is_in_0_26(fresh_compat, monkeypatch):
    from vllm.model_executor.model_loader.reload import meta

    assert compat.loaded_never_on_meta() == {"bias"}
    compat.loaded_never_on_meta.cache_clear()
    monkeypatch.setattr(meta, "SKIP_TENSORS", set(meta.SKIP_LOAD_TENSORS))
    monkeypatch.delattr(meta, "SKIP_LOAD_TENSORS")  # 0.26's module: one set, which moves `bias` too
    assert compat.loaded_never_on_meta() == frozenset()


def test_deferred_attention_layers_are_found_in_either_release(fresh_compat, monkeypatch):
    from vllm.model_executor.layers import attention

    layer, other = attention.Attention.__new__(attention.Attention), torch.nn.Linear(2, 2)
    assert compat.deferred_attention(layer) and not compat.deferred_attention(other)
    compat._deferred_attention_test.cache_clear()
    monkeypatch.delattr(attention, "is_deferred_attention_layer")  # 0.26: Attention and MLAAttention
    assert compat.deferred_attention(layer) and not compat.deferred_attention(other)


def test_the_backend_refuses_vllm_0_26s_trainer_side_call_naming_what_to_use():
    from rl_sync.vllm.backend import RlSyncTransferEngine

    with pytest.raises(TypeError, match=r"trainers send through rl-sync's own group \(actors.WeightSync"):
        RlSyncTransferEngine.trainer_send_weights(iter([]), {})


def _done_processing(loader):
    """What vLLM's online-processing wrapper does once its layer was processed: ignore loads (it
    keeps its own name: vLLM wraps with `assigned=("__doc__", "__annotations__")`)."""

    @functools.wraps(loader, assigned=("__doc__", "__annotations__"))
    def online_process_loader(*args, **kwargs):
        return None

    return online_process_loader


class _OnlineModel(torch.nn.Module):
    """One layer whose weight's loader is wrapped as online FP8 leaves it after loading."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 6, bias=False).to(torch.bfloat16)
        self.proj.weight.requires_grad_(False)

        def copy(param, loaded):
            param.data.copy_(loaded)

        self.proj.weight.weight_loader = _done_processing(copy)

    def load_weights(self, weights):
        for _, tensor in weights:
            self.proj.weight.weight_loader(self.proj.weight, tensor)


def test_the_probe_sees_loads_that_an_online_processing_wrapper_would_ignore():
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    model = _OnlineModel()
    record_metadata_for_reloading(model)
    probe = probe_loads(model, {"proj.weight": (torch.bfloat16, (6, 4))}, torch.bfloat16)
    assert [(p.param, p.src.sizes) for p in probe.pieces["proj.weight"]] == [("proj.weight", (6, 4))]
    assert model.proj.weight.weight_loader.__name__ == "online_process_loader", "the wrapper is put back"


def test_the_trainer_factory_is_found_in_0_32_and_absent_from_0_26(monkeypatch):
    from vllm.distributed.weight_transfer import factory

    assert compat.trainer_factory() is factory.WeightTransferTrainerFactory
    monkeypatch.delattr(factory, "WeightTransferTrainerFactory")  # 0.26: the trainer side is a static call
    assert compat.trainer_factory() is None


def test_lora_names_are_mapped_with_the_renames_alone_in_either_release(monkeypatch):
    """vLLM's LoRA loader maps an adapter's module names with the model's renames, its stacked
    maps dropped: `get_rename_mapper` in 0.32, `get_unstacked_mapper` in 0.26."""
    from dataclasses import replace

    from vllm.model_executor.models.utils import WeightsMapper

    mapper = WeightsMapper(
        orig_to_new_prefix={"model.": "language_model.model."}, orig_to_new_stacked={"q_proj": ("qkv_proj", "q")}
    )
    name = "model.layers.0.self_attn.q_proj"
    assert compat.lora_name_mapper(mapper)._map_name(name) == "language_model.model.layers.0.self_attn.q_proj"
    monkeypatch.delattr(WeightsMapper, "get_rename_mapper")
    monkeypatch.setattr(
        WeightsMapper, "get_unstacked_mapper", lambda self: replace(self, orig_to_new_stacked={}), raising=False
    )
    assert compat.lora_name_mapper(mapper)._map_name(name) == "language_model.model.layers.0.self_attn.q_proj"
