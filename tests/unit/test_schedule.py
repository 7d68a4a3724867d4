"""The schedule: buckets bounded per rank, matching message order on both sides."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import ALIGN, build_schedule, cut_buckets

from .strategies import layouts, shapes


def _all_slices(schedule):
    ranks = sorted({r for s in schedule.plan.specs for r in s.src.mesh.ranks + s.dst.mesh.ranks})
    return {r: schedule.rank_slice(r) for r in ranks}


def _pair_messages(slices, side):
    out = {}
    for rank, mine in slices.items():
        for bucket in mine.buckets:
            for m in getattr(bucket, side):
                pair = (rank, m.peer) if side == "sends" else (m.peer, rank)
                out.setdefault((bucket.index, pair), []).append((m.nbytes, m.segments))
    return out


def check_schedule(schedule) -> None:
    slices = _all_slices(schedule)
    sends, recvs = _pair_messages(slices, "sends"), _pair_messages(slices, "recvs")
    assert sends == recvs, "a sender's messages and its peer's receives differ"
    delivered: dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for messages in sends.values():
        for nbytes, segments in messages:
            cursor = 0
            for seg in segments:
                assert seg.start >= cursor and seg.start % ALIGN == 0
                cursor = seg.start + seg.nbytes
                delivered.setdefault(seg.tensor, []).append((seg.offsets, seg.sizes))
            assert nbytes == cursor
    for i in range(len(schedule.plan)):
        plan = schedule.plan.tensor_plan(i)
        want = sum(t.numel for t in plan.transfers)
        got = sum(int(np.prod(z)) for _, z in delivered.get(i, []))
        assert got == want, f"tensor {i}: scheduled {got} elements, planned {want}"


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_random_models_schedule_every_transfer_in_matching_order(data):
    specs = []
    for i in range(data.draw(st.integers(1, 5))):
        shape = data.draw(shapes())
        src = data.draw(layouts(shape))
        dst = data.draw(layouts(shape, start=64))
        specs.append(TensorSpec(f"t{i}", data.draw(st.sampled_from(["float32", "bfloat16", "int8"])), shape, src, dst))
    schedule = build_schedule(
        plan_model(specs), bucket_bytes=data.draw(st.integers(1, 2048)), coalesce_bytes=data.draw(st.integers(0, 512))
    )
    check_schedule(schedule)


def test_buckets_respect_the_per_rank_bound():
    src = Layout(Mesh((4,)), (Shard(0),))
    dst = Layout(Mesh((2, 2), start_rank=4), (Replicate(), Shard(1)))
    specs = [TensorSpec(f"w{i}", "float32", (64, 32), src, dst) for i in range(20)]
    schedule = build_schedule(plan_model(specs), bucket_bytes=10_000, coalesce_bytes=0)
    check_schedule(schedule)
    for mine in _all_slices(schedule).values():
        for bucket in mine.buckets:
            assert sum(m.nbytes for m in bucket.sends + bucket.recvs) <= 10_000
    assert schedule.num_buckets > 1


def test_many_small_tensors_between_one_pair_coalesce():
    src = Layout(Mesh((1,)), (Replicate(),))
    dst = Layout(Mesh((1,), start_rank=1), (Replicate(),))
    specs = [TensorSpec(f"b{i}", "float32", (10,), src, dst) for i in range(1000)]
    schedule = build_schedule(plan_model(specs), bucket_bytes=1 << 20, coalesce_bytes=1 << 10)
    (bucket,) = schedule.rank_slice(0).buckets
    (message,) = bucket.sends
    assert len(message.segments) == 1000 and message.nbytes == 999 * 48 + 40


def test_large_segments_travel_alone():
    src = Layout(Mesh((1,)), (Replicate(),))
    dst = Layout(Mesh((1,), start_rank=1), (Replicate(),))
    specs = [TensorSpec("big", "float32", (1024,), src, dst), TensorSpec("small", "float32", (4,), src, dst)]
    (bucket,) = build_schedule(plan_model(specs), coalesce_bytes=1024).rank_slice(1).buckets
    assert [[s.tensor for s in m.segments] for m in bucket.recvs] == [[1], [0]]


def test_a_round_on_a_subset_moves_only_those_tensors():
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = Layout(Mesh((2,), start_rank=2), (Shard(1),))
    specs = [TensorSpec(f"w{i}", "float32", (8, 8), src, dst) for i in range(4)]
    schedule = build_schedule(plan_model(specs))
    mine = schedule.rank_slice(0, tensors=[1, 3])
    assert {s.tensor for b in mine.buckets for m in b.sends for s in m.segments} == {1, 3}


def _naive_cuts(loads, num_slabs, bound):
    slab, rank, load = loads
    per_slab = {}
    for p, r, b in zip(slab.tolist(), rank.tolist(), load.tolist()):
        per_slab.setdefault(p, {}).setdefault(r, 0)
        per_slab[p][r] += b
    cuts, acc, used = [0], {}, False
    for p in range(num_slabs):
        add = per_slab.get(p, {})
        if used and any(acc.get(r, 0) + b > bound for r, b in add.items()):
            cuts.append(p)
            acc = {}
        for r, b in add.items():
            acc[r] = acc.get(r, 0) + b
        used = True
    if num_slabs > cuts[-1]:
        cuts.append(num_slabs)
    return tuple(cuts)


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 6), st.integers(1, 50)), max_size=80),
    extra=st.integers(0, 5),
    bound=st.integers(1, 120),
)
def test_vectorised_cuts_equal_the_sequential_greedy(entries, extra, bound):
    num_slabs = (max((e[0] for e in entries), default=-1) + 1) + extra
    loads = tuple(np.array([e[i] for e in entries], dtype=np.int64) for i in range(3))
    assert cut_buckets(loads, num_slabs, bound) == _naive_cuts(loads, num_slabs, bound)


def test_colocated_schedules_local_copies():
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = Layout(Mesh((2,)), (Shard(1),))
    schedule = build_schedule(plan_model([TensorSpec("w", "float32", (4, 4), src, dst)], colocated=True))
    check_schedule(schedule)
    (bucket,) = schedule.rank_slice(0).buckets
    assert [(s.offsets, s.sizes) for s in bucket.local] == [((0, 0), (2, 2))]
