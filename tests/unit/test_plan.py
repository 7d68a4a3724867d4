"""The planner: exact-once delivery, sources hold what they send, balance, errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.planning import plan as plan_module
from rl_sync.planning import template
from rl_sync.planning.layout import Box, Layout, Mesh, Replicate, Shard
from rl_sync.planning.plan import SideSpec, TensorSpec, join_specs, plan_model, plan_reshard

from .strategies import layouts, shapes


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def _contains(outer: Box | None, inner: Box) -> bool:
    return outer is not None and all(
        o <= i and i + s <= o + z for o, z, i, s in zip(outer.offsets, outer.sizes, inner.offsets, inner.sizes)
    )


def check_exact_once(shape, src: Layout, dst: Layout, plan) -> None:
    delivered = {r: torch.zeros(shape, dtype=torch.int32) for r in dst.mesh.ranks}
    for t in plan.transfers:
        assert t.src_rank != t.dst_rank
        assert _contains(src.local_box(shape, t.src_rank), t.box), f"{t} not held by its source"
        assert _contains(dst.local_box(shape, t.dst_rank), t.box), f"{t} not kept by its destination"
        held = src.local_box(shape, t.dst_rank)
        assert held is None or held.intersect(t.box) is None, f"{t} resends what the destination holds"
        delivered[t.dst_rank][_slices(t.box)] += 1
    for t in plan.local_copies:
        assert t.src_rank == t.dst_rank
        assert _contains(src.local_box(shape, t.src_rank), t.box)
        delivered[t.dst_rank][_slices(t.box)] += 1
    for rank, box in zip(dst.mesh.ranks, dst.all_boxes(shape)):
        want = torch.zeros(shape, dtype=torch.int32)
        want[_slices(box)] = 1
        assert torch.equal(delivered[rank], want), f"rank {rank}: not every element delivered exactly once"


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_every_element_delivered_exactly_once(data):
    shape = data.draw(shapes())
    src = data.draw(layouts(shape))
    dst = data.draw(layouts(shape, start=src.mesh.size))
    check_exact_once(shape, src, dst, plan_reshard(shape, src, dst))


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_colocated_ranks_copy_locally_what_they_hold(data):
    shape = data.draw(shapes())
    src = data.draw(layouts(shape))
    dst = data.draw(layouts(shape, start=data.draw(st.integers(0, src.mesh.size))))
    check_exact_once(shape, src, dst, plan_reshard(shape, src, dst, colocated=True))


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_plans_are_deterministic(data):
    shape = data.draw(shapes())
    src = data.draw(layouts(shape))
    dst = data.draw(layouts(shape, start=src.mesh.size))
    first = plan_reshard(shape, src, dst)
    template.build_template.cache_clear()
    plan_module._plan_reshard.cache_clear()
    assert plan_reshard(shape, src, dst) == first


def test_fsdp_to_tensor_parallel_columns():
    src = Layout(Mesh((4,)), (Shard(0),))
    dst = Layout(Mesh((2, 2), start_rank=4), (Replicate(), Shard(1)))
    plan = plan_reshard((8, 6), src, dst)
    to_rank_4 = sorted((t.src_rank, t.offsets, t.sizes) for t in plan.transfers if t.dst_rank == 4)
    assert to_rank_4 == [(0, (0, 0), (2, 3)), (1, (2, 0), (2, 3)), (2, (4, 0), (2, 3)), (3, (6, 0), (2, 3))]


def test_replicated_sources_share_the_load():
    src = Layout(Mesh((2, 2)), (Replicate(), Shard(0)))
    dst = Layout(Mesh((2, 2), start_rank=4), (Replicate(), Shard(1)))
    plan = plan_model([TensorSpec("w", "bfloat16", (1024, 1024), src, dst)])
    stats = plan.stats
    assert set(stats.send_bytes) == {0, 1, 2, 3}
    assert stats.busiest_source_bytes == stats.busiest_source_lower_bound == 1024 * 1024 * 2 * 2 // 4


def test_small_replicated_pieces_rotate_over_replicas():
    src = Layout(Mesh((4,)), (Replicate(),))
    dst = Layout(Mesh((8,), start_rank=4), (Replicate(),))
    plan = plan_reshard((16,), src, dst)
    senders = [t.src_rank for t in sorted(plan.transfers, key=lambda t: t.dst_rank)]
    assert sorted(senders) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_model_stats_match_the_transfers():
    src = Layout(Mesh((4,)), (Shard(0),))
    dst = Layout(Mesh((2, 2), start_rank=4), (Replicate(), Shard(0)))
    specs = [
        TensorSpec("a", "float32", (13, 7), src, dst),
        TensorSpec("b", "bfloat16", (5,), src, Layout.replicated(Mesh((4,), start_rank=4))),
        TensorSpec("c", "int64", (9, 2), Layout(Mesh((2,), start_rank=1), (Shard(1),)), dst),
    ]
    model = plan_model(specs)
    send, recv, count = {}, {}, 0
    for i, spec in enumerate(specs):
        size = {"float32": 4, "bfloat16": 2, "int64": 8}[spec.dtype]
        for t in model.tensor_plan(i).transfers:
            send[t.src_rank] = send.get(t.src_rank, 0) + t.numel * size
            recv[t.dst_rank] = recv.get(t.dst_rank, 0) + t.numel * size
            count += 1
    stats = model.stats
    assert stats.send_bytes == send and stats.recv_bytes == recv
    assert stats.num_transfers == count and stats.total_bytes == sum(send.values())
    model_bytes = 13 * 7 * 4 + 5 * 2 + 9 * 2 * 8
    assert stats.broadcast_recv_bytes == model_bytes
    assert stats.broadcast_bytes == model_bytes * 4


def _spec(name="w", dtype="float32", shape=(4, 4), src=None, dst=None):
    src = src or Layout(Mesh((2,)), (Shard(0),))
    dst = dst or Layout(Mesh((2,), start_rank=2), (Shard(1),))
    return TensorSpec(name, dtype, shape, src, dst)


@pytest.mark.parametrize(
    "specs, message",
    [
        (
            [_spec(src=Layout(Mesh((2,)), (Shard(2),)))],
            r"tensor 'w' source layout: Shard\(2\) on mesh axis 0 is past the tensor's rank 2",
        ),
        ([_spec(dtype="bfloat17")], r"tensor 'w': unknown dtype name 'bfloat17'"),
        ([_spec(), _spec()], r"tensor 'w': duplicate tensor name \(also at position 0\)"),
        (
            [_spec(dst=Layout(Mesh((2,), start_rank=1), (Shard(1),)))],
            r"tensor 'w': source mesh .* and destination mesh .* overlap at ranks \[1\]",
        ),
        ([_spec(shape=(4, -1))], r"tensor 'w': shape must be a sequence of non-negative ints"),
    ],
)
def test_bad_model_input_fails_at_planning_time(specs, message):
    with pytest.raises(ValueError, match=message):
        plan_model(specs)


def test_join_specs_names_disagreements():
    layout = Layout(Mesh((2,)), (Shard(0),))
    other = Layout(Mesh((2,), start_rank=2), (Shard(0),))
    with pytest.raises(ValueError, match=r"tensor 'w': source shape \(4, 4\) and destination shape \(4, 5\) disagree"):
        join_specs([SideSpec("w", "float32", (4, 4), layout)], [SideSpec("w", "float32", (4, 5), other)])
    with pytest.raises(ValueError, match=r"tensor 'w': source dtype 'int32' and destination dtype 'float32' disagree"):
        join_specs([SideSpec("w", "int32", (4, 4), layout)], [SideSpec("w", "float32", (4, 4), other)])
    cast = join_specs([SideSpec("w", "float32", (4, 4), layout)], [SideSpec("w", "bfloat16", (4, 4), other)])
    assert cast == [TensorSpec("w", "bfloat16", (4, 4), layout, other)], "the wire carries the destination's dtype"
    with pytest.raises(ValueError, match=r"tensor 'v': the source declares it but no destination binds it"):
        join_specs([SideSpec("v", "float32", (4,), layout)], [])
    with pytest.raises(ValueError, match=r"tensors \['u'\]: bound by the destination but the source does not declare"):
        join_specs([], [SideSpec("u", "float32", (4,), other)])
    joined = join_specs([SideSpec("w", "float32", (4, 4), layout)], [SideSpec("w", "float32", [4, 4], other)])
    assert joined == [TensorSpec("w", "float32", (4, 4), layout, other)]


def test_a_synthetic_fp8_engine_plans_fp8_projections_and_their_scales():
    """`ModelConfig.fp8_block`: every projection and expert weight travels as FP8 with its fp32
    scale grid (TP-sharded like the values), norms, routers and embeddings as bf16; each worker
    receives exactly those bytes."""
    from rl_sync.models.config import ModelConfig, Parallel
    from rl_sync.models.synthetic import TrainerParallel, model_specs

    model = ModelConfig(
        family="qwen3_moe",
        layers=2,
        first_dense_layers=1,
        hidden=256,
        intermediate=512,
        vocab=1000,
        heads=4,
        kv_heads=2,
        head_dim=128,
        experts=4,
        moe_intermediate=256,
        fp8_block=(128, 128),
    )
    specs = model_specs(model, TrainerParallel(ranks=3), Parallel(tp=2, ep=True))
    by_name = {s.name: s for s in specs}
    q = by_name["model.layers.0.self_attn.q_proj.weight"]
    assert (q.dtype, q.block) == ("float8_e4m3fn", (128, 128))
    assert by_name["model.layers.0.self_attn.q_proj.weight::scale_inv"].shape == (4, 2)
    assert by_name["model.layers.1.mlp.experts.3.down_proj.weight"].dtype == "float8_e4m3fn"
    assert {
        by_name[n].dtype
        for n in (
            "model.embed_tokens.weight",
            "model.layers.1.mlp.gate.weight",
            "model.layers.0.input_layernorm.weight",
        )
    } == {"bfloat16"}
    stats = plan_model(specs).stats
    size = {"float8_e4m3fn": 1, "float32": 4, "bfloat16": 2}
    for worker in (3, 4):  # trainers are ranks 0-2: a worker receives every byte it keeps
        boxes = [(s.dst.local_box(s.shape, worker), size[s.dtype]) for s in specs]
        assert stats.recv_bytes[worker] == sum(box.numel * item for box, item in boxes if box is not None)
