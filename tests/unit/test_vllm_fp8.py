"""vLLM's block-FP8 linear layers as destinations (`rl_sync.vllm.fp8`), on stand-in layers made
the way vLLM's `Fp8LinearMethod.create_weights` makes them."""

from __future__ import annotations

import pytest
import torch

from rl_sync.bind.infer import Geometry
from rl_sync.planning.layout import Box
from rl_sync.vllm.fp8 import FP8, block_of, scale_elements, scale_param, scale_view
from rl_sync.vllm.probe import ParamForm


class _Fp8Method:
    """Stands in for vLLM's `Fp8LinearMethod` (only its name is read)."""


class _Layer(torch.nn.Module):
    """A fused qkv layer of 384 rows (q 256, k 64, v 64) over 256 columns, block-FP8 or not."""

    def __init__(self, block: list[int] | None, scales: bool = True):
        super().__init__()
        self.quant_method = _Fp8Method()
        self.weight_block_size = block
        self.weight = torch.nn.Parameter(torch.zeros(384, 256, dtype=FP8), requires_grad=False)
        if scales:
            self.weight_scale_inv = torch.nn.Parameter(torch.zeros(3, 2), requires_grad=False)


FORM = ParamForm((384, 256), (256, 1), FP8)


def test_a_block_fp8_weight_has_its_layers_block_and_scales():
    layer = _Layer([128, 128])
    assert block_of([layer], layer.weight, FORM) == (128, 128)
    assert scale_param([layer]) is layer.weight_scale_inv
    assert block_of([layer], layer.weight, ParamForm((384, 256), (256, 1), torch.bfloat16)) is None


@pytest.mark.parametrize("layer", [_Layer(None), _Layer([128, 128], scales=False)])
def test_an_fp8_weight_of_another_scheme_is_refused_naming_what_is_supported(layer):
    with pytest.raises(ValueError, match=r"a parameter of _Fp8Method is loaded as float8_e4m3fn without a block size"):
        block_of([layer], layer.weight, FORM)


def test_a_slot_on_a_block_boundary_takes_the_scales_of_its_blocks():
    scales = torch.arange(6, dtype=torch.float32).view(3, 2)
    k_slot = Geometry(offset=256 * 256, sizes=(128, 256), strides=(256, 1))  # rows 256..383
    view = scale_view(k_slot, FORM, scales, Box((0, 0), (1, 2)), (128, 128), "k")
    assert torch.equal(view, torch.tensor([[4.0, 5.0]]))
    view.fill_(-1)
    assert torch.equal(scales[2], torch.tensor([-1.0, -1.0])), "the view writes the live scales"


def test_a_slot_that_cuts_a_block_is_refused_naming_where_it_starts():
    cut = Geometry(offset=64 * 256, sizes=(64, 256), strides=(256, 1))
    with pytest.raises(
        ValueError, match=r"k: its slot starts at row 64, column 0 of the layer's weight, not on a 128x128"
    ):
        scale_view(cut, FORM, torch.zeros(3, 2), Box((0, 0), (1, 2)), (128, 128), "k")


def test_a_box_starts_one_scale_per_block_the_last_ones_cut():
    assert scale_elements(Box((0, 0), (300, 256)), (128, 128)) == 3 * 2
    assert scale_elements(Box((0, 0, 0), (4, 256, 129)), (128, 128)) == 4 * 2 * 2
