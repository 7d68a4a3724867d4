"""Relay plans are exact: every worker ends with exactly its boxes, each forwarded box comes from
a worker that already holds it, the chains have no cycles and a fan-out of one, and the
trainers send each replicated element once instead of once per replica."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import Schedule
from rl_sync.wire.codec import decode, encode
from rl_sync.wire.plan_info import PlanInfo

from .strategies import layouts, shapes

WORKERS = 64


def engines(sub: Layout, replicas: int, ranks: list[int]) -> Layout:
    """`sub` (one replica's layout over mesh ranks 0..n-1) over `replicas` engines: replica k's
    position i is rank `ranks[k * n + i]`."""
    n = sub.mesh.size
    mesh = Mesh(
        (replicas,) + sub.mesh.shape,
        ranks=[ranks[k * n + sub.mesh.ranks[i]] for k in range(replicas) for i in range(n)],
    )
    return Layout(mesh, (Replicate(),) + sub.placements)


def _box(layout: Layout, shape, rank):
    box = layout.local_box(shape, rank)
    return None if box is None else tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def run(schedule: Schedule) -> dict:
    """Execute every rank's buckets in index order on element ids; returns what each worker holds
    and the relay edges, asserting each step's preconditions."""
    plan = schedule.plan
    ranks = sorted({r for s in plan.specs for r in s.src.mesh.ranks + s.dst.mesh.ranks})
    slices = {r: schedule.rank_slice(r) for r in ranks}
    held = {(r, i): np.full(s.shape, -1, dtype=np.int64) for i, s in enumerate(plan.specs) for r in s.dst.mesh.ranks}
    truth = [np.arange(int(np.prod(s.shape)), dtype=np.int64).reshape(s.shape) for s in plan.specs]
    by_index: dict[int, list] = {}
    for r, mine in slices.items():
        for bucket in mine.buckets:
            by_index.setdefault(bucket.index, []).append((r, bucket))
    edges, sent = set(), dict.fromkeys(ranks, 0)
    for index in sorted(by_index):
        arriving, expected = [], []
        for r, bucket in by_index[index]:
            for m in bucket.sends:
                for seg in m.segments:
                    box = tuple(slice(o, o + s) for o, s in zip(seg.offsets, seg.sizes))
                    if m.relay is None:
                        assert _box(plan.specs[seg.tensor].src, plan.specs[seg.tensor].shape, r) is not None
                        values = truth[seg.tensor][box]
                    else:
                        values = held[(r, seg.tensor)][box].copy()
                        assert (values >= 0).all(), f"rank {r} forwards a box it does not hold yet (bucket {index})"
                        edges.add((r, m.peer))
                    arriving.append((m.peer, seg, values))
                    sent[r] += seg.nbytes
                expected.append((m.peer, r, m.nbytes, m.segments))
        received = [(r, m.peer, m.nbytes, m.segments) for r, bucket in by_index[index] for m in bucket.recvs]
        assert sorted(map(repr, expected)) == sorted(map(repr, received)), f"bucket {index}: sends and receives differ"
        for peer, seg, values in arriving:
            box = tuple(slice(o, o + s) for o, s in zip(seg.offsets, seg.sizes))
            target = held[(peer, seg.tensor)][box]
            assert (target == -1).all(), f"rank {peer} receives an element of tensor {seg.tensor} twice"
            held[(peer, seg.tensor)][box] = values
    for (r, i), got in held.items():
        box = _box(plan.specs[i].dst, plan.specs[i].shape, r)
        want = np.full(plan.specs[i].shape, -1, dtype=np.int64)
        want[box] = truth[i][box]
        assert np.array_equal(got, want), f"rank {r} does not end with exactly its box of tensor {i}"
    return {"edges": edges, "sent": sent, "slices": slices}


@st.composite
def relayed_models(draw):
    replicas, trainers = draw(st.integers(2, 4)), draw(st.integers(1, 4))
    specs = []
    for i in range(draw(st.integers(1, 4))):
        shape = draw(shapes())
        src = Layout(Mesh((trainers,)), (draw(st.sampled_from([Replicate(), *map(Shard, range(len(shape)))])),))
        sub = draw(layouts(shape, max_axes=2, max_axis=3, blocks=False))
        sub = Layout(Mesh(sub.mesh.shape, ranks=range(sub.mesh.size)), sub.placements)
        spare = draw(st.permutations(range(WORKERS, WORKERS + replicas * sub.mesh.size)))
        dst = (
            engines(sub, replicas, spare)
            if draw(st.booleans())
            else engines(sub, replicas, range(WORKERS, WORKERS + 64))
        )
        specs.append(TensorSpec(f"t{i}", draw(st.sampled_from(["float32", "bfloat16"])), shape, src, dst))
    return specs


@settings(max_examples=80, deadline=None)
@given(specs=relayed_models(), bucket_bytes=st.integers(1, 1024), coalesce=st.integers(0, 256))
def test_relay_plans_deliver_every_box_once_from_holders_along_acyclic_chains(specs, bucket_bytes, coalesce):
    plan = plan_model(specs)
    schedule = Schedule(plan, bucket_bytes, coalesce, relay=True)
    out = run(schedule)
    relay = schedule.relay
    if relay is None:
        assert not out["edges"]
        return
    for sender, receiver in out["edges"]:
        (entry, k), (entry2, k2) = relay.where[sender], relay.where[receiver]
        assert entry == entry2 and k2 == k + 1, "a forward goes one step down its own chain (so no cycle)"
    peers = {}
    for sender, receiver in out["edges"]:
        peers.setdefault(sender, set()).add(receiver)
    assert all(len(p) == 1 for p in peers.values()), "each worker forwards to one peer"
    direct = run(Schedule(plan, bucket_bytes, coalesce))
    trainers = {r for s in plan.specs for r in s.src.mesh.ranks}
    into_entry = sum(
        t.numel * int(plan.itemsizes[i]) for i in relay.tensors for t in schedule.routed.tensor_plan(i).transfers
    )
    assert sum(direct["sent"][r] for r in trainers) - sum(out["sent"][r] for r in trainers) == into_entry * (
        relay.replicas - 1
    ), "trainers send relayed boxes to one replica, not to each"


def test_chains_follow_mesh_positions_and_a_disagreeing_tensor_goes_direct():
    src = Layout(Mesh((2,)), (Shard(0),))
    tp2 = Layout(Mesh((2,)), (Shard(0),))
    first = engines(tp2, 3, list(range(2, 8)))
    swapped = engines(tp2, 3, [2, 3, 5, 4, 6, 7])  # replica 1's positions swapped: another chain map
    specs = [
        TensorSpec("a", "float32", (8, 4), src, first),
        TensorSpec("b", "float32", (8, 4), src, swapped),
        TensorSpec("c", "float32", (8,), src, Layout(Mesh((2,), start_rank=2), (Shard(0),))),
    ]
    schedule = Schedule(plan_model(specs), 64, 0, relay=True)
    assert schedule.relay.chains == {2: (2, 4, 6), 3: (3, 5, 7)}
    assert schedule.relay.tensors == frozenset({0}), "b disagrees with a's chains, c has no replicas"
    assert schedule.relay_depth == 2 and schedule.num_buckets == len(schedule.cuts) - 1 + 2
    run(schedule)


def test_colocated_plans_and_single_replicas_do_not_relay():
    src = Layout(Mesh((2,)), (Shard(0),))
    one = engines(Layout(Mesh((2,)), (Shard(0),)), 1, [2, 3])
    assert Schedule(plan_model([TensorSpec("a", "float32", (8,), src, one)]), 64, 0, relay=True).relay is None
    both = engines(Layout(Mesh((1,)), (Replicate(),)), 2, [0, 1])
    colocated = plan_model([TensorSpec("a", "float32", (8,), src, both)], colocated=True)
    assert Schedule(colocated, 64, 0, relay=True).relay is None


def test_the_relay_choice_travels_in_the_plan_message():
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = engines(Layout(Mesh((2,)), (Shard(1),)), 4, list(range(2, 10)))
    schedule = Schedule(plan_model([TensorSpec("w", "bfloat16", (16, 8), src, dst)]), 64, 0, relay=True)
    rebuilt = decode(PlanInfo, encode(PlanInfo.from_schedule(schedule))).to_schedule()
    assert rebuilt.relay == schedule.relay and rebuilt.cuts == schedule.cuts
    for rank in range(10):
        assert rebuilt.rank_slice(rank) == schedule.rank_slice(rank)
    plain = Schedule(plan_model([TensorSpec("w", "bfloat16", (16, 8), src, dst)]), 64, 0)
    assert decode(PlanInfo, encode(PlanInfo.from_schedule(plain))).to_schedule().relay is None


@pytest.mark.parametrize("replicas", [2, 4])
def test_trainers_send_one_copy_and_each_worker_forwards_what_it_received(replicas):
    """FSDP4 into `replicas` TP2 engines: each trainer sends 1/replicas of what it sends directly;
    every worker but the last replica's forwards exactly its bytes."""
    src = Layout(Mesh((4,)), (Shard(0),))
    dst = engines(Layout(Mesh((2,)), (Shard(0),)), replicas, list(range(4, 4 + 2 * replicas)))
    specs = [TensorSpec(f"w{i}", "float32", (64, 16), src, dst) for i in range(6)]
    plan = plan_model(specs)
    relayed, direct = run(Schedule(plan, 4096, 256, relay=True)), run(Schedule(plan, 4096, 256))
    for r in range(4):
        assert relayed["sent"][r] * replicas == direct["sent"][r]
    per_worker = 6 * 64 * 16 * 4 // 2
    for k in range(replicas):
        for r in (4 + 2 * k, 5 + 2 * k):
            assert relayed["sent"][r] == (per_worker if k < replicas - 1 else 0)


def test_a_place_in_a_chain_belongs_to_one_rank():
    """b shares a's replica-0 rank but puts another rank in replica 1: one chain cannot hold both."""
    src = Layout(Mesh((2,)), (Shard(0),))
    a = Layout(Mesh((2, 1), ranks=[2, 4]), (Replicate(), Shard(0)))
    b = Layout(Mesh((2, 1), ranks=[2, 5]), (Replicate(), Shard(0)))
    for first, second in ((a, b), (b, a)):
        specs = [TensorSpec("e0", "float32", (8, 4), src, first), TensorSpec("e1", "float32", (8, 4), src, second)]
        schedule = Schedule(plan_model(specs), 64, 0, relay=True)
        assert len(schedule.relay.chains) == 1 and schedule.relay.replicas == 2 and schedule.relay.tensors == {0}
        run(schedule)


def test_relayed_buckets_hold_no_more_per_rank_than_direct_ones():
    """Relayed bands are cut for twice their receive (they are forwarded as much again), so a
    forwarding worker's bucket (receiving one band, forwarding the previous) holds no more than
    a direct bucket does on its busiest rank."""
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = engines(Layout(Mesh((2,)), (Shard(0),)), 4, list(range(2, 10)))
    plan = plan_model([TensorSpec(f"w{i}", "float32", (1024, 256), src, dst) for i in range(4)])

    def worst(schedule):
        return max(sum(m.nbytes for m in b.sends + b.recvs) for r in range(10) for b in schedule.rank_slice(r).buckets)

    relayed = Schedule(plan, 64 << 10, 0, relay=True)
    assert worst(relayed) <= worst(Schedule(plan, 64 << 10, 0))
    run(relayed)


def test_subset_rounds_relay_exactly_their_tensors():
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = engines(Layout(Mesh((2,)), (Shard(1),)), 3, list(range(2, 8)))
    plan = plan_model([TensorSpec(f"w{i}", "bfloat16", (16, 8), src, dst) for i in range(5)])
    schedule = Schedule(plan, 256, 64, relay=True)
    subset = {1, 3}
    slices = {r: schedule.rank_slice(r, subset) for r in range(8)}
    assert {
        s.tensor for mine in slices.values() for b in mine.buckets for m in b.sends + b.recvs for s in m.segments
    } == subset
    sends = sorted(
        repr((b.index, r, m.peer, m.segments)) for r, mine in slices.items() for b in mine.buckets for m in b.sends
    )
    recvs = sorted(
        repr((b.index, m.peer, r, m.segments)) for r, mine in slices.items() for b in mine.buckets for m in b.recvs
    )
    assert sends == recvs
