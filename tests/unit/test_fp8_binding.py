"""FP8 engines: the binder puts each checkpoint tensor's FP8 values and block scales where vLLM's
block-quantized layers keep them (fused slots' scale rows by vLLM's own rule), and refuses
fused slots that do not hold whole blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_sync.bind.binder import Binder
from rl_sync.models.config import ModelConfig, Parallel, _fp8_block
from rl_sync.models.tp_model import TPModel
from rl_sync.planning.quant import scale_name

LLAMA = ModelConfig(
    family="llama",
    vocab=128,
    hidden=256,
    layers=1,
    heads=8,
    kv_heads=2,
    head_dim=32,
    intermediate=512,
    fp8_block=(32, 64),
)
L0 = "model.layers.0"


def _checkpoint(cfg: ModelConfig) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    h, d, kv = cfg.hidden, cfg.head_dim, cfg.kv_heads * cfg.head_dim
    shapes = {
        "self_attn.q_proj.weight": (cfg.heads * d, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, cfg.heads * d),
        "mlp.gate_proj.weight": (cfg.intermediate, h),
        "mlp.up_proj.weight": (cfg.intermediate, h),
        "mlp.down_proj.weight": (h, cfg.intermediate),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    out = {f"{L0}.{n}": (torch.bfloat16, s) for n, s in shapes.items()}
    out.update(
        {
            "model.embed_tokens.weight": (torch.bfloat16, (cfg.vocab, h)),
            "lm_head.weight": (torch.bfloat16, (cfg.vocab, h)),
            "model.norm.weight": (torch.bfloat16, (h,)),
        }
    )
    return out


def _row(view: torch.Tensor, param: torch.Tensor) -> int:
    """The first row of `param` that `view` starts at."""
    return (view.data_ptr() - param.data_ptr()) // (param.stride(0) * param.element_size())


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_slots_and_their_scales_sit_where_vllm_puts_them(tp):
    linear = pytest.importorskip("vllm.model_executor.layers.linear")
    cfg, par = dataclasses.replace(LLAMA, kv_heads=4), Parallel(tp=tp)
    for rank in range(tp):
        model = TPModel(cfg, par, rank, torch.bfloat16)
        dests = Binder(cfg, par).bind(_checkpoint(cfg), model.params, rank).destinations
        for fused, slots in (("self_attn.qkv_proj", "qkv"), ("mlp.gate_up_proj", ("gate", "up"))):
            values, scales = model.params[f"{L0}.{fused}.weight"], model.params[f"{L0}.{fused}.weight_scale_inv"]
            assert values.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
            for slot in slots:
                name = f"{L0}.{'self_attn' if slots == 'qkv' else 'mlp'}.{slot}_proj.weight"
                value, scale = dests[name], dests[scale_name(name)]
                assert value.dtype == torch.float8_e4m3fn and value.block == cfg.fp8_block
                offset, size = _row(value.local, values), value.local.shape[0]
                want_size, want_offset = linear.adjust_block_scale_shard(cfg.fp8_block, size, offset)
                assert (scale.local.shape[0], _row(scale.local, scales)) == (want_size, want_offset), name
                assert scale.local.shape[1] == scales.shape[1] and scale.dtype == torch.float32
    assert "model.embed_tokens.weight" in dests and dests["model.embed_tokens.weight"].block == ()


def test_an_fp8_model_dequantizes_its_blocks():
    model = TPModel(LLAMA, Parallel(tp=1), 0, torch.float32)
    name = f"{L0}.mlp.down_proj.weight"
    model.params[name].copy_(torch.full((256, 512), 2.0).to(torch.float8_e4m3fn))
    model.params[name + "_scale_inv"][1, 3] = 0.5
    weight = model.weight(name)
    assert weight[32:64, 192:256].eq(1.0).all() and weight[:32].eq(2.0).all() and weight.dtype == torch.float32


def test_a_fused_slot_that_does_not_start_on_a_block_is_refused():
    cfg = dataclasses.replace(LLAMA, fp8_block=(48, 64))  # q holds 256 rows: k starts mid-block
    with pytest.raises(
        ValueError,
        match=r"worker rank 0: 'model.layers.0.self_attn.k_proj.weight': its slot starts at "
        r"row 256 of 'model.layers.0.self_attn.qkv_proj.weight', not on a 48-row "
        "block boundary; every fused slot must hold whole blocks",
    ):
        Binder(cfg, Parallel(tp=1)).bind(_checkpoint(cfg), TPModel(cfg, Parallel(tp=1), 0).params, 0)


def test_hugging_face_quantization_configs():
    assert _fp8_block({"quant_method": "fp8", "weight_block_size": [128, 128]}) == (128, 128)
    assert _fp8_block(None) is None
    with pytest.raises(
        ValueError,
        match=r"quantization_config .* is not supported; expected quant_method 'fp8' with a weight_block_size",
    ):
        _fp8_block({"quant_method": "awq", "bits": 4})
