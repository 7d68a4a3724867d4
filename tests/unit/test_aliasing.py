"""Destinations that share an element are refused, naming both; disjoint boxes of one storage are not."""

from __future__ import annotations

import pytest
import torch

from rl_sync.engine.aliasing import check_disjoint
from rl_sync.engine.endpoint import as_bytes

BASE = torch.zeros(6, 4, 8)


@pytest.mark.parametrize(
    "views",
    [
        {"q": BASE[0:2], "k": BASE[2:4], "v": BASE[4:6]},  # fused rows
        {"gate": BASE[:, 0:2], "up": BASE[:, 2:4]},  # parts cut along dim 1 (extents interleave)
        {"a": BASE[1:3, :, 0:4], "b": BASE[1:3, :, 4:8], "c": BASE[0]},  # column blocks and a whole slice
        {"x": BASE[0, 0], "y": torch.zeros(8)},  # different storages
        {"t": BASE.transpose(0, 1)[0:2], "u": BASE.transpose(0, 1)[2:4]},
    ],
)
def test_disjoint_views_pass(views):
    check_disjoint(views, rank=0)


@pytest.mark.parametrize(
    "views, pair",
    [
        ({"q": BASE[0:3], "k": BASE[2:4]}, ("q", "k")),
        ({"gate": BASE[:, 0:3], "up": BASE[:, 2:4]}, ("gate", "up")),
        ({"w": BASE[1], "same": BASE[1]}, ("w", "same")),
        ({"flat": BASE.view(-1)[0:40], "rows": BASE[1]}, ("flat", "rows")),  # other strides, overlapping extents
        ({"a": BASE[:, :, 0:5], "b": BASE[:, :, 4:8]}, ("a", "b")),
    ],
)
def test_overlapping_views_are_refused_naming_both(views, pair):
    with pytest.raises(ValueError) as raised:
        check_disjoint(views, rank=3)
    assert str(raised.value) == (
        f"worker rank 3: destinations {pair[0]!r} and {pair[1]!r} share memory (their views "
        "overlap); each element may have one writer"
    )


def test_a_one_element_box_of_any_stride_is_sent_from_its_storage():
    """A single element is contiguous whatever its stride (a column of column-major storage):
    its bytes are viewed in place, not refused."""
    storage = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    element = storage[:, 1][2:3]
    assert element.stride() == (4,)
    raw = as_bytes(element)
    assert raw.data_ptr() == element.data_ptr() and torch.equal(raw.view(torch.float32), torch.tensor([9.0]))
    assert as_bytes(storage[:, 1]) is None
