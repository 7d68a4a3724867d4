"""LoRA rounds without an engine: PEFT's saved names, the adapter spec, and which box of an
adapter tensor each TP rank keeps, read off vLLM's own LoRA layer classes (their slicing code,
on instances given only the sizes it reads)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rl_sync.bind.infer import infer_layout
from rl_sync.config.lora import LoraSpec
from rl_sync.lora import AdapterTensor, adapter_sources, parse_adapter_name, saved_name
from rl_sync.planning.layout import Box, Layout, Mesh, Replicate, Shard

Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def test_saved_names_parse_to_the_module_and_matrix_they_adapt():
    assert parse_adapter_name(Q_A) == AdapterTensor("model.layers.0.self_attn.q_proj", "A")
    down_b = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert parse_adapter_name(down_b) == AdapterTensor("model.layers.1.mlp.down_proj", "B")


@pytest.mark.parametrize(
    "name",
    [
        "model.norm.weight",
        "base_model.model.model.embed_tokens.lora_embedding_A",
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
    ],
)
def test_anything_but_a_saved_adapter_name_is_refused_naming_it(name):
    with pytest.raises(ValueError, match=rf"^tensor '{name}' is no LoRA adapter tensor: a LoRA group carries PEFT's"):
        parse_adapter_name(name)


def test_model_parameter_names_map_to_saved_names_for_their_adapter_only():
    param = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert saved_name(param, "default") == Q_A
    assert saved_name(param, "other") is None
    assert saved_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "default") is None
    assert saved_name("model.layers.0.mlp.up_proj.lora_B.default.weight", "default") == (
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    )


def _peft_model(targets: tuple[str, ...] = ("q_proj", "down_proj")):
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets))
    return peft.get_peft_model(AutoModelForCausalLM.from_config(config), lora)


def test_adapter_sources_are_the_adapters_matrices_by_the_names_peft_saves(tmp_path):
    from safetensors.torch import load_file

    model = _peft_model()
    sources = adapter_sources(model)
    model.save_pretrained(str(tmp_path))
    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert sorted(sources) == sorted(saved)
    assert all(torch.equal(sources[n].detach(), saved[n]) for n in saved)
    assert all(s.requires_grad for s in sources.values()), "the adapter's own parameters, not copies"


def test_adapter_sources_of_a_model_with_checkpointed_layers_keep_the_names_peft_saves():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    model = _peft_model()
    names = sorted(adapter_sources(model))
    layer = type(model.base_model.model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, layer))
    assert any("_checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    assert sorted(adapter_sources(model)) == names


def test_a_spec_is_checked_against_the_adapter_the_trainers_train():
    model = _peft_model()  # r=4, lora_alpha=8
    config = adapter_sources(model).config
    assert config is model.peft_config["default"]
    LoraSpec.of_peft(config, name="policy", lora_id=1).check_matches(config, "trainer rank 0")
    with pytest.raises(
        ValueError,
        match=r"^trainer rank 1: the adapter's PEFT config has r=4, lora_alpha=8, use_rslora=False, but LoraSpec "
        r"'policy' has rank=4, alpha=16, use_rslora=False; build the spec with LoraSpec\.of_peft\(peft_config, "
        r"\.\.\.\)$",
    ):
        LoraSpec(name="policy", lora_id=1, rank=4, alpha=16).check_matches(config, "trainer rank 1")


def test_an_adapter_of_an_embedding_is_refused_naming_it():
    with pytest.raises(
        ValueError,
        match=r"^adapter 'default' adapts an embedding "
        r"\('base_model\.model\.model\.embed_tokens\.lora_embedding_A\.default'\): LoRA groups carry linear "
        r"layers' lora_A / lora_B only; leave embeddings out of the adapter's target_modules$",
    ):
        adapter_sources(_peft_model(("q_proj", "embed_tokens")))


def test_an_adapter_the_model_lacks_is_refused_naming_the_ones_it_has():
    with pytest.raises(ValueError, match=r"^unknown adapter 'policy': the PEFT model has \['default'\]$"):
        adapter_sources(_peft_model(), "policy")


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(name=""), TypeError, r"^LoraSpec\.name must be a non-empty str, got ''$"),
        (dict(lora_id=0), ValueError, r"^LoraSpec\.lora_id must be an int >= 1, got 0$"),
        (dict(rank=True), ValueError, r"^LoraSpec\.rank must be an int >= 1, got True$"),
        (dict(alpha=0.0), ValueError, r"^LoraSpec\.alpha must be a number > 0, got 0\.0$"),
        (dict(use_rslora=1), TypeError, r"^LoraSpec\.use_rslora must be True or False, got 1$"),
    ],
)
def test_a_bad_spec_is_refused_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        LoraSpec(**{**dict(name="policy", lora_id=1, rank=8, alpha=16.0), **fields})


def test_a_spec_is_read_off_peft_config_and_refuses_what_it_cannot_carry():
    peft = pytest.importorskip("peft")
    spec = LoraSpec.of_peft(peft.LoraConfig(r=8, lora_alpha=24, use_rslora=True), name="policy", lora_id=3)
    assert spec == LoraSpec(name="policy", lora_id=3, rank=8, alpha=24, use_rslora=True)
    assert spec.request().lora_int_id == 3 and spec.request().lora_name == "policy"
    with pytest.raises(ValueError, match=r"^LoraSpec\.of_peft: adapter 'policy' sets \['rank_pattern'\]; LoRA"):
        LoraSpec.of_peft(peft.LoraConfig(r=8, rank_pattern={"q_proj": 4}), name="policy", lora_id=3)
    with pytest.raises(
        ValueError,
        match=r"^LoraSpec\.of_peft: adapter 'policy' sets \[\"bias='all'\", \"init_lora_weights='pissa'\"\]; LoRA "
        r"rounds take plain LoRA \(.*, and an initialisation that leaves the base weights as the engine holds them\)$",
    ):
        LoraSpec.of_peft(peft.LoraConfig(r=8, bias="all", init_lora_weights="pissa"), name="policy", lora_id=3)


@given(st.data())
def test_box_of_finds_the_box_any_slice_was_cut_from(data):
    from rl_sync.vllm.lora_boxes import box_of

    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=2, max_size=2)))
    offsets = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    sizes = tuple(data.draw(st.integers(1, n - o)) for n, o in zip(shape, offsets))
    whole = torch.arange(shape[0] * shape[1], dtype=torch.float64).reshape(shape)
    kept = whole[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
    assert box_of(kept, shape) == Box(offsets, sizes)


def test_box_of_refuses_pieces_that_are_no_box_and_takes_nothing_as_none():
    from rl_sync.vllm.lora_boxes import box_of

    whole = torch.arange(24, dtype=torch.float64).reshape(6, 4)
    with pytest.raises(ValueError, match=r"^no box of a \(6, 4\) tensor$"):
        box_of(torch.cat([whole[0:1], whole[4:5]]), (6, 4))
    assert box_of(whole[2:2], (6, 4)) is None


def _layer(cls, tp: int, rank: int, **sizes):
    """A vLLM LoRA layer of `cls` at TP rank `rank` of `tp`, holding only what its slicing reads."""
    layer = object.__new__(cls)
    layer.__dict__.update(tp_size=tp, tp_rank=rank, **sizes)
    return layer


def _layouts(make, part: int, matrix: str, shape: tuple[int, ...], tp: int) -> Layout | None:
    from rl_sync.vllm.lora_boxes import kept_box

    return infer_layout(shape, [kept_box(make(r), part, matrix, shape) for r in range(tp)])


def test_row_parallel_layers_shard_lora_a_columns_and_keep_lora_b_whole():
    pytest.importorskip("vllm")
    from vllm.lora.layers import RowParallelLinearWithLoRA

    def make(r):
        return _layer(RowParallelLinearWithLoRA, 2, r, n_slices=1, input_size=128)

    assert _layouts(make, 0, "A", (8, 256), 2) == Layout(Mesh((2,)), (Shard(1),))
    assert _layouts(make, 0, "B", (128, 8), 2) == Layout(Mesh((2,)), (Replicate(),))


def test_merged_column_layers_shard_each_slices_lora_b_rows_and_keep_lora_a_whole():
    pytest.importorskip("vllm")
    from vllm.lora.layers import MergedColumnParallelLinearWithLoRA

    def make(r):
        return _layer(MergedColumnParallelLinearWithLoRA, 2, r, n_slices=2, output_slices=(128, 128), output_ids=(r, r))

    for part in (0, 1):
        assert _layouts(make, part, "B", (256, 8), 2) == Layout(Mesh((2,)), (Shard(0),))
        assert _layouts(make, part, "A", (8, 128), 2) == Layout(Mesh((2,)), (Replicate(),))


def test_qkv_slices_follow_kv_head_replicas():
    """At TP4 with 2 KV heads, ranks 0-1 keep KV head 0 and ranks 2-3 head 1: k and v shard over
    two groups of two replicas, q over all four ranks."""
    pytest.importorskip("vllm")
    from vllm.lora.layers import MergedQKVParallelLinearWithLoRA

    def make(r):
        ids = (r, r // 2, r // 2)
        return _layer(MergedQKVParallelLinearWithLoRA, 4, r, n_slices=3, output_slices=(32, 32, 32), output_ids=ids)

    assert _layouts(make, 0, "B", (128, 8), 4) == Layout(Mesh((4,)), (Shard(0),))
    k = _layouts(make, 1, "B", (64, 8), 4)
    assert k is not None
    assert k.all_boxes((64, 8)) == [Box((0, 0), (32, 8))] * 2 + [Box((32, 0), (32, 8))] * 2


def test_a_fused_qkv_lora_b_a_rank_keeps_in_three_pieces_is_refused():
    pytest.importorskip("vllm")
    from vllm.lora.layers import QKVParallelLinearWithLoRA

    from rl_sync.vllm.lora_boxes import kept_box

    base = type("Base", (), {"num_kv_head_replicas": 1})()
    layer = _layer(
        QKVParallelLinearWithLoRA, 2, 1, n_slices=1, base_layer=base, q_proj_shard_size=64, q_proj_total_size=128,
        kv_proj_shard_size=32, kv_proj_total_size=64,
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"^no box of a \(256, 8\) tensor$"):
        kept_box(layer, 0, "B", (256, 8))


SPEC = LoraSpec(name="policy", lora_id=1, rank=8, alpha=16)


def test_a_lora_group_refuses_engine_services_and_a_spec_of_another_type():
    from actors.service import VllmService
    from actors.weight_sync import _check_lora

    services = r"^WeightSync\.create: workers \[1\] are vLLM engine services, which take no LoRA rounds yet; pass"
    with pytest.raises(ValueError, match=services):
        _check_lora(SPEC, {0: object(), 1: VllmService(None, 2)}, "WeightSync.create")
    with pytest.raises(TypeError, match=r"^replace_worker: lora must be a LoraSpec or None, got dict$"):
        _check_lora({"name": "policy"}, {}, "replace_worker")


def test_a_worker_that_takes_no_lora_rounds_refuses_a_lora_group():
    from rl_sync.rank.side import DescribeOptions
    from rl_sync.rank.worker import WorkerRank

    class Plain(WorkerRank):
        def rl_sync_destinations(self, checkpoint):
            return {}

    with pytest.raises(ValueError, match=r"^worker rank 3: Plain takes no LoRA rounds \(a LoRA group writes"):
        Plain()._rl_sync_worker_entries(3, 4, DescribeOptions(lora=SPEC))


def test_a_fully_sharded_slot_that_leaves_a_rank_none_of_the_adapter_is_refused_saying_why():
    pytest.importorskip("vllm")
    from vllm.lora.layers import ColumnParallelLinearWithShardedLoRA

    from rl_sync.vllm.lora_boxes import Target, check_fits, kept_box

    name = "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    for rank in range(2):  # max_lora_rank 16 split over 2 ranks; an adapter of rank 8 fills rank 0's half
        layer = _layer(
            ColumnParallelLinearWithShardedLoRA, 2, rank, n_slices=1, is_merged_col_linear=False, output_size=16,
            lora_a_stacked=(torch.zeros(1, 1, 8, 16),), lora_b_stacked=(torch.zeros(1, 1, 16, 16),),
        )  # fmt: skip
        target = Target("model.layers.0.mlp.up_proj", layer, 0, "A", kept_box(layer, 0, "A", (8, 16)))
        if rank == 0:
            check_fits(target, name, rank)
            continue
        with pytest.raises(
            ValueError,
            match=r"^vLLM rank 1: adapter tensor '.*up_proj\.lora_A\.weight': vLLM's slot of 'model\.layers\.0\.mlp\."
            r"up_proj' on this rank keeps none of it\. A fully sharded LoRA layer .* start the engine with "
            r"max_lora_rank equal to the adapter's rank, or without fully_sharded_loras$",
        ):
            check_fits(target, name, rank)
