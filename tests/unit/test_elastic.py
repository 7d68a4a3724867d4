"""Layouts of a group whose engines join and leave: grown, one replica's part, shrunk."""

from __future__ import annotations

import pytest

from rl_sync.planning.elastic import check_grown, engine_layout, shrunk
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

SHAPE = (12, 10)


def replicas(engines: int, tp: int = 2) -> Layout:
    """`engines` replicas of a TP `tp` column split, as a vLLM binding lays them out."""
    return Layout(Mesh((engines, tp)), (Replicate(), Shard(1)))


@pytest.mark.parametrize("engines", [1, 2, 3])
def test_a_replica_joining_leaves_every_existing_worker_its_boxes(engines):
    check_grown("w", SHAPE, replicas(engines), replicas(engines + 1), old_size=2 * engines)
    whole = Layout.replicated(Mesh((2 * engines,)))
    check_grown("n", (10,), whole, Layout.replicated(Mesh((2 * engines + 2,))), old_size=2 * engines)


def test_a_layout_that_moves_an_existing_workers_box_is_refused_naming_it():
    with pytest.raises(
        ValueError,
        match=r"^tensor 'w': the joining engine lays it out as Mesh\(\(4,\), start_rank=0\)\[S\(1\)\], which gives "
        r"worker rank 0 the box .* where it keeps .*; an engine joins a live group only when the others keep "
        r"their boxes",
    ):
        check_grown("w", SHAPE, replicas(1), Layout(Mesh((4,)), (Shard(1),)), old_size=2)


def test_one_replicas_part_of_a_layout_is_its_row_in_position_order():
    grown = replicas(3).remapped({r: 2 + r for r in range(6)})
    assert engine_layout(grown, [2, 3]) == Layout(Mesh((2,), start_rank=2), (Shard(1),))
    assert engine_layout(grown, [7, 6]) == Layout(Mesh((2,), start_rank=6), (Shard(1),))
    assert engine_layout(grown, [3, 4]) is None, "not a replica"
    assert engine_layout(Layout(Mesh((4,)), (Shard(1),)), [0, 1]) is None, "replicas not on mesh axis 0"
    whole = Layout.replicated(Mesh((6,)))
    assert engine_layout(whole, [4, 5]) == Layout.replicated(Mesh((2,), start_rank=4))
    assert engine_layout(whole, [5, 9]) is None


@pytest.mark.parametrize("removed", [{0, 1}, {2, 3}, {4, 5}])
def test_a_replica_leaving_renumbers_the_others_and_each_keeps_its_boxes(removed):
    left = shrunk(replicas(3), removed, 6)
    assert left == replicas(2)
    kept = [r for r in range(6) if r not in removed]
    for new, old in enumerate(kept):
        assert left.local_box(SHAPE, new) == replicas(3).local_box(SHAPE, old)
    assert shrunk(Layout.replicated(Mesh((6,))), removed, 6) == Layout.replicated(Mesh((4,)))


def test_what_is_not_a_whole_replica_cannot_leave():
    assert shrunk(replicas(3), {1, 2}, 6) is None, "half of two replicas"
    assert shrunk(replicas(1), {0, 1}, 2) is None, "no replica would stay"
    assert shrunk(Layout(Mesh((4,)), (Shard(1),)), {2, 3}, 4) is None, "replicas not on mesh axis 0"
