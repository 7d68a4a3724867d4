"""Layouts and views read off an engine's loader: `infer_layout`, `merge_pieces`, parts of fused tensors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.bind.infer import Geometry, Piece, find_cuts, infer_layout, merge_pieces
from rl_sync.engine.endpoint import Endpoint
from rl_sync.engine.session import part_endpoint
from rl_sync.planning.layout import Box, Layout, Mesh, Replicate, Shard
from rl_sync.planning.parts import check_parts, parse_part, part_layout, part_name, part_shape, uncuttable_dims
from rl_sync.vllm.entries import NO_LAYOUT, NO_PARTS, plan_entries
from rl_sync.vllm.probe import Probe

from .strategies import layouts, shapes


@st.composite
def engine_layouts(draw):
    """What an inference engine of `n` ranks does to one tensor: replicate it, shard one dim
    (torch.chunk or blocked sizes), shard it over groups of ranks holding the same box (KV
    heads), or keep it on a subset of ranks only (experts)."""
    shape = draw(shapes(min_dims=1, max_dims=3))
    n = draw(st.integers(1, 8))
    holders = (
        sorted(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n))) if draw(st.booleans()) else list(range(n))
    )
    dim = draw(st.integers(0, len(shape) - 1))
    kind = draw(st.sampled_from(["replicate", "shard", "block", "groups"]))
    if kind == "replicate":
        return shape, n, Layout(Mesh.from_ranks(holders), (Replicate(),))
    if kind == "groups" and len(holders) % 2 == 0 and len(holders) > 2:
        mesh = Mesh.from_ranks([holders[i : i + 2] for i in range(0, len(holders), 2)])
        return shape, n, Layout(mesh, (Shard(dim), Replicate()))
    block = max(1, -(-shape[dim] // len(holders)) + draw(st.integers(0, 2))) if kind == "block" else 0
    return shape, n, Layout(Mesh.from_ranks(holders), (Shard(dim, block),))


def _boxes(layout: Layout, shape, n):
    return [layout.local_box(shape, r) for r in range(n)]


def _same(a, b) -> bool:
    empty = lambda x: x is None or x.is_empty()  # noqa: E731
    return all((empty(x) and empty(y)) or x == y for x, y in zip(a, b))


@settings(max_examples=400, deadline=None)
@given(engine_layouts())
def test_inferred_layout_gives_every_rank_its_box(case):
    shape, n, layout = case
    boxes = _boxes(layout, shape, n)
    inferred = infer_layout(shape, boxes)
    if all(b is None or b.is_empty() for b in boxes):
        assert inferred is None
        return
    assert inferred is not None, f"{layout} over {n} ranks: no layout inferred for {boxes}"
    assert _same(_boxes(inferred, shape, n), boxes)


def test_boxes_no_layout_gives_are_refused():
    shape = (8, 4)
    assert infer_layout(shape, [Box((0, 0), (5, 4)), Box((3, 0), (5, 4))]) is None, "overlapping shards"
    assert infer_layout(shape, [Box((0, 0), (4, 2)), Box((4, 2), (4, 2))]) is None, "two dims at once"
    assert infer_layout(shape, [Box((0, 0), (2, 4)), Box((2, 0), (6, 4))]) is None, "sizes no rule gives"
    assert infer_layout(shape, [None, None]) is None


def test_kv_heads_replicated_over_rank_groups():
    shape = (4, 8)  # 2 KV heads of 2 rows, TP 4: ranks {0, 1} hold head 0, {2, 3} head 1
    boxes = [Box((0, 0), (2, 8)), Box((0, 0), (2, 8)), Box((2, 0), (2, 8)), Box((2, 0), (2, 8))]
    layout = infer_layout(shape, boxes)
    assert layout == Layout(Mesh.from_ranks([[0, 1], [2, 3]]), (Shard(0), Replicate()))


def _piece(param: str, src: Box, dst_param: torch.Tensor, view: torch.Tensor) -> Piece:
    return Piece(param, src, Geometry(int(view.storage_offset()), tuple(view.shape), tuple(view.stride())))


def test_gate_and_up_of_whole_experts_merge_into_one_view():
    I, H, local = 3, 5, (2, 3)  # expert parallelism over 4 experts: this rank holds experts 2 and 3
    w13 = torch.arange(len(local) * 2 * I * H).view(len(local), 2 * I, H)
    pieces = []
    for slot, e in enumerate(local):
        for half in (0, 1):
            view = w13[slot, half * I : (half + 1) * I].unsqueeze(0)
            pieces.append(_piece("w13", Box((e, half * I, 0), (1, I, H)), w13, view))
    merged = merge_pieces(pieces)
    assert merged is not None and merged.box == Box((2, 0, 0), (2, 2 * I, H))
    got = w13.as_strided(merged.dst.sizes, merged.dst.strides, merged.dst.offset)
    assert torch.equal(got, w13)


def test_tensor_parallel_gate_and_up_bands_do_not_merge():
    E, I, H = 2, 4, 3  # TP rank 1 of 2 inside each expert: rows [2, 4) of gate and of up
    w13 = torch.zeros(E, I, H)
    pieces = [
        _piece("w13", Box((e, half * I + 2, 0), (1, 2, H)), w13, w13[e, half * 2 : half * 2 + 2].unsqueeze(0))
        for e in range(E)
        for half in (0, 1)
    ]
    assert merge_pieces(pieces) is None
    assert merge_pieces([pieces[0], Piece("other", pieces[1].src, pieces[1].dst)]) is None, "two parameters"
    gate_rows = [p for p in pieces if p.src.offsets[1] < I]
    merged = merge_pieces(gate_rows)
    assert merged is not None and merged.box == Box((0, 2, 0), (E, 2, H))
    view = w13.as_strided(merged.dst.sizes, merged.dst.strides, merged.dst.offset)
    assert view.data_ptr() == w13[:, 0:2].data_ptr() and view.stride() == w13[:, 0:2].stride()


def _gate_up_boxes(E: int, I: int, H: int, tp: int) -> list[list[Box]]:
    """What each TP rank of a fused (E, 2I, H) gate|up tensor keeps: its rows of each half."""
    rows = I // tp
    return [[Box((e, half * I + r * rows, 0), (1, rows, H)) for e in range(E) for half in (0, 1)] for r in range(tp)]


def test_fused_gate_up_is_cut_between_its_halves():
    for tp in (2, 4):
        assert find_cuts((4, 16, 3), _gate_up_boxes(4, 8, 3, tp)) == (1, [8])
    assert find_cuts((4, 16, 3), _gate_up_boxes(4, 8, 3, 2), forbidden={1}) is None, "the trainers shard dim 1"
    assert find_cuts((4, 16, 3), [[Box((0, 0, 0), (4, 16, 3))]]) is None, "one box needs no cut"
    straddling = [[Box((0, 0, 0), (4, 6, 3)), Box((0, 10, 0), (4, 6, 3))], [Box((0, 5, 0), (4, 6, 3))]]
    assert find_cuts((4, 16, 3), straddling) is None, "rank 1's box spans the only gap of rank 0"


def test_boxes_that_touch_are_cut_apart_only_where_no_dim_has_gaps():
    """Bloom at TP2: each rank keeps whole heads of a (heads x [q, k, v] x 2, 3) tensor, as one
    piece per head and slot (adjacent in the checkpoint, apart in the parameter): cut at every
    piece boundary inside a rank. Experts keep their gap cut along dim 1, not one cut per expert."""
    heads = [[Box((r * 12 + i * 2, 0), (2, 3)) for i in range(6)] for r in range(2)]
    assert find_cuts((24, 3), heads) == (0, [2, 4, 6, 8, 10, 14, 16, 18, 20, 22])
    assert find_cuts((4, 16, 3), _gate_up_boxes(4, 8, 3, 2)) == (1, [8])


def test_parts_must_tile_a_dim_the_trainers_layout_can_be_cut_along():
    fsdp = Layout(Mesh((2,)), (Shard(0),))
    check_parts("w", (4, 16), fsdp, [(1, 0, 8), (1, 8, 16)])
    check_parts("w", (4, 16), fsdp, [(0, 0, 3), (0, 3, 4)])  # q|k|v rows of a fused qkv_proj: FSDP's dim
    two_axes = Layout(Mesh((2, 2)), (Shard(0), Shard(0)))
    assert uncuttable_dims(two_axes) == {0} and uncuttable_dims(fsdp) == set()
    with pytest.raises(
        ValueError, match=r"tensor 'w': workers cut it along dim 0, which the trainers shard over several mesh axes"
    ):
        check_parts("w", (4, 16), two_axes, [(0, 0, 2), (0, 2, 4)])
    with pytest.raises(ValueError, match=r"shards dim 0 in a way no part can be cut from"):
        part_layout(two_axes, (4, 16), 0, 0, 2)
    with pytest.raises(
        ValueError, match=r"tensor 'w': parts \[\(0, 8\), \(9, 16\)\] along dim 1 do not tile \[0, 16\)"
    ):
        check_parts("w", (4, 16), fsdp, [(1, 0, 8), (1, 9, 16)])
    with pytest.raises(ValueError, match=r"tensor 'w': parts along dim 1 end at 12, the tensor at 16"):
        check_parts("w", (4, 16), fsdp, [(1, 0, 8), (1, 8, 12)])
    assert parse_part(part_name("model.experts.gate_up_proj", 1, 0, 8)) == ("model.experts.gate_up_proj", 1, 0, 8)
    assert parse_part("model.experts.gate_up_proj") is None


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_part_of_any_cuttable_layout_is_sent_from_exactly_its_elements(data):
    """Each rank's box of a part (`part_layout`) is its box of the whole inside the part, and the
    view `part_endpoint` cuts from its shard of the whole holds exactly those elements."""
    shape = data.draw(shapes())
    layout = data.draw(layouts(shape, blocks=data.draw(st.booleans())))
    dims = [d for d in range(len(shape)) if shape[d] and d not in uncuttable_dims(layout)]
    if not dims:
        return
    dim = data.draw(st.sampled_from(dims))
    start = data.draw(st.integers(0, shape[dim] - 1))
    stop = data.draw(st.integers(start + 1, shape[dim]))
    whole = torch.arange(max(1, torch.Size(shape).numel())).narrow(0, 0, torch.Size(shape).numel()).view(shape)
    part, sub_shape = part_layout(layout, shape, dim, start, stop), part_shape(shape, dim, start, stop)
    window = Box(tuple(start if d == dim else 0 for d in range(len(shape))), sub_shape)
    for rank in layout.mesh.ranks:
        held, box = layout.local_box(shape, rank), part.local_box(sub_shape, rank)
        inside = held.intersect(window) if not held.is_empty() else None
        assert box.is_empty() == (inside is None), (rank, held, box)
        if inside is None:
            continue
        assert box.sizes == inside.sizes
        assert box.offsets == tuple(o - start if d == dim else o for d, o in enumerate(inside.offsets))
        shard = Endpoint(whole[tuple(slice(o, o + s) for o, s in zip(held.offsets, held.sizes))], held.offsets)
        sent = part_endpoint({"w": shard}, part_name("w", dim, start, stop))
        assert sent is not None and sent.origin == box.offsets
        assert torch.equal(sent.tensor, whole.narrow(dim, start, stop - start)[_slices(box)])


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def test_a_part_is_sent_from_a_view_of_the_whole_shard():
    whole = torch.arange(2 * 16 * 3).view(2, 16, 3)  # trainer rank 1 of FSDP over 4 experts: experts 2 and 3
    endpoints = {"w": Endpoint(whole, (2, 0, 0))}
    part = part_endpoint(endpoints, part_name("w", 1, 8, 16))
    assert part.origin == (2, 0, 0) and torch.equal(part.tensor, whole[:, 8:16])
    assert part_endpoint(endpoints, "v") is None and part_endpoint(endpoints, part_name("v", 1, 0, 8)) is None
    rows = torch.arange(6 * 3).view(6, 3)  # FSDP rank 1 of a fused (12, 3) q|k|v tensor: rows 6..12
    fused = {"qkv": Endpoint(rows, (6, 0))}
    assert part_endpoint(fused, part_name("qkv", 0, 0, 4)) is None, "holds no q row"
    k = part_endpoint(fused, part_name("qkv", 0, 4, 8))
    assert k is not None and k.origin == (2, 0) and torch.equal(k.tensor, rows[0:2])
    v = part_endpoint(fused, part_name("qkv", 0, 8, 12))
    assert v is not None and v.origin == (0, 0) and torch.equal(v.tensor, rows[2:6])


def test_each_fallback_says_why():
    """`plan_entries` names the reason of every name it falls back: the probe's, no layout for the
    boxes the ranks keep, pieces no cut makes one box per rank and part."""
    checkpoint = dict.fromkeys(("derived", "scattered", "interleaved", "kept"), ("bfloat16", (8, 4)))
    whole = Box((0, 0), (8, 4))
    rank0 = {
        "derived": ("unresolved", ["p"], Probe.DERIVED, []),
        "scattered": ("ok", ["p"], [((0, 0), (3, 4))], [((0, 0), (3, 4))]),
        "interleaved": ("pieces", ["p"], [], [((0, 0), (4, 2)), ((4, 2), (4, 2))]),
        "kept": ("ok", ["p"], [(whole.offsets, whole.sizes)], [(whole.offsets, whole.sizes)]),
    }
    rank1 = dict(rank0, scattered=("ok", ["p"], [((2, 0), (6, 4))], [((2, 0), (6, 4))]))
    pieces = {"kept": [Piece("p", whole, Geometry(0, (8, 4), (4, 1)))]}
    entries, fallback, unmerged = plan_entries(checkpoint, [rank0, rank1], pieces, {}, rank=0)
    assert fallback == {"derived": Probe.DERIVED, "scattered": NO_LAYOUT, "interleaved": NO_PARTS}
    assert [e.name for e in entries] == ["kept"] and unmerged == set()
