"""Layout algebra: DTensor semantics, meshes, boxes and clear errors."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Partial, _StridedShard

from rl_sync.planning.layout import Box, Layout, Mesh, Replicate, Shard

from .strategies import layouts, shapes


def _torch_placements(layout: Layout):
    return [TorchShard(p.dim) if isinstance(p, Shard) else TorchReplicate() for p in layout.placements]


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_local_box_matches_dtensor(data):
    shape = data.draw(shapes())
    layout = data.draw(layouts(shape, start=data.draw(st.integers(0, 5)), blocks=False))
    for rank in layout.mesh.ranks:
        coord = list(layout.mesh.coordinate(rank))
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, layout.mesh.shape, coord, _torch_placements(layout)
        )
        box = layout.local_box(shape, rank)
        assert box.sizes == tuple(sizes)
        assert box.offsets == tuple(offsets) or box.is_empty()


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_distinct_boxes_partition_the_tensor(data):
    shape = data.draw(shapes())
    layout = data.draw(layouts(shape))
    count = torch.zeros(shape, dtype=torch.int32)
    for box in {b for b in layout.all_boxes(shape) if not b.is_empty()}:
        count[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))] += 1
    assert bool((count == 1).all())


def test_uneven_sizes_follow_torch_chunk():
    layout = Layout(Mesh((4,)), (Shard(0),))
    sizes = [layout.local_box((5,), r).sizes[0] for r in range(4)]
    assert sizes == [t.numel() for t in torch.arange(5).chunk(4)] + [0] * (4 - len(torch.arange(5).chunk(4)))
    assert sizes == [2, 2, 1, 0]


def test_two_axes_sharding_one_dim_split_left_to_right():
    layout = Layout(Mesh((2, 2)), (Shard(0), Shard(0)))
    assert [layout.local_box((8, 3), r).offsets[0] for r in range(4)] == [0, 2, 4, 6]


def test_block_sharding_is_a_padded_vocab_split():
    layout = Layout(Mesh((4,)), (Shard(0, block=256),))
    assert [layout.local_box((1000, 8), r).sizes[0] for r in range(4)] == [256, 256, 256, 232]
    assert layout.local_box((1000, 8), 3).offsets == (768, 0)


def test_a_shifted_block_shard_is_a_window_of_the_blocks():
    layout = Layout(Mesh((4,)), (Shard(0, block=3, shift=4),))  # rows [4, 9) of a dim cut in blocks of 3
    assert [layout.local_box((5,), r) for r in range(4)] == [
        Box((5,), (0,)),
        Box((0,), (2,)),
        Box((2,), (3,)),
        Box((5,), (0,)),
    ]
    assert str(layout.placements[0]) == "S(0, block=3, shift=4)"
    with pytest.raises(ValueError, match=r"cover its 9 rows \(block x axis size - shift >= size\)"):
        layout.local_box((9,), 0)


def test_rank_outside_mesh_has_no_box():
    assert Layout(Mesh((2,), start_rank=4), (Shard(0),)).local_box((4,), 0) is None


def test_mesh_from_ranks_is_row_major():
    mesh = Mesh.from_ranks([[0, 2], [1, 3]])
    assert mesh.shape == (2, 2) and mesh.ranks == (0, 2, 1, 3)
    assert mesh.coordinate(1) == (1, 0)
    assert Mesh.from_ranks(torch.tensor([[4, 5], [6, 7]])) == Mesh((2, 2), start_rank=4)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: Mesh(()), "mesh shape must be non-empty positive ints"),
        (lambda: Mesh((2, 0)), "mesh shape must be non-empty positive ints, got (2, 0)"),
        (lambda: Mesh((2, -1)), "mesh shape must be non-empty positive ints, got (2, -1)"),
        (lambda: Mesh((2,), ranks=[1, 1]), "mesh ranks must be distinct"),
        (lambda: Mesh((3,), ranks=[0, 1]), "mesh shape (3,) needs 3 ranks, got 2"),
        (lambda: Mesh((2,), start_rank=-1), "mesh start_rank must be a non-negative int"),
        (lambda: Shard(-1), "Shard dim must be a non-negative int, got -1"),
        (
            lambda: Shard(0, shift=2),
            "Shard shift must be a non-negative int, and needs a block size and no grid, got shift=2 with block=0",
        ),
        (lambda: Shard(0, 4, shift=-1), "Shard shift must be a non-negative int"),
        (lambda: Layout(Mesh((2, 2)), (Shard(0),)), "layout needs one placement per mesh axis"),
    ],
)
def test_bad_meshes_and_layouts_are_refused(make, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_shard_past_tensor_rank_is_named():
    layout = Layout(Mesh((2,)), (Shard(2),))
    with pytest.raises(ValueError, match=r"Shard\(2\) on mesh axis 0 is past the tensor's rank 2"):
        layout.local_box((4, 4), 0)


def _fake_dtensor(placements, mesh_ranks, ndim=2):
    spec = SimpleNamespace(mesh=SimpleNamespace(mesh=torch.tensor(mesh_ranks)), placements=tuple(placements))
    return SimpleNamespace(_spec=spec, ndim=ndim)


def test_from_dtensor_reads_mesh_and_placements():
    t = _fake_dtensor([TorchReplicate(), TorchShard(1)], [[0, 1], [2, 3]])
    layout = Layout.from_dtensor(t, start_rank=8)
    assert layout == Layout(Mesh((2, 2), start_rank=8), (Replicate(), Shard(1)))


@pytest.mark.parametrize("placement", [Partial(), _StridedShard(0, split_factor=2)])
def test_from_dtensor_refuses_partial_and_strided(placement):
    with pytest.raises(ValueError, match="cannot express DTensor placement"):
        Layout.from_dtensor(_fake_dtensor([placement], [0, 1]))


def test_from_dtensor_refuses_plain_tensors():
    with pytest.raises(TypeError, match="expected a DTensor, got Tensor"):
        Layout.from_dtensor(torch.zeros(2))


@given(a=shapes(2, 2), b=shapes(2, 2))
def test_box_minus_and_intersect_cover_exactly(a, b):
    outer = Box((0, 0), a)
    inner = Box((1, 1), b)
    pieces = outer.minus(inner)
    cells = set(itertools.product(*(range(o, o + s) for o, s in zip(outer.offsets, outer.sizes))))
    covered = [c for p in pieces for c in itertools.product(*(range(o, o + s) for o, s in zip(p.offsets, p.sizes)))]
    common = outer.intersect(inner)
    inside = (
        set(itertools.product(*(range(o, o + s) for o, s in zip(common.offsets, common.sizes)))) if common else set()
    )
    assert len(covered) == len(set(covered))
    assert set(covered) == cells - inside
