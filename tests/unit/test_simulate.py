"""The link-model simulator on small cases whose seconds are worked out by hand."""

from __future__ import annotations

import pytest

from rl_sync.layout import Layout, Mesh, Replicate, Shard
from rl_sync.plan import TensorSpec, plan_model
from rl_sync.schedule import build_schedule
from rl_sync.simulate import LinkModel, predict

SLOW = 1e-7
"""100 bytes per second, in GB/s: seconds read as bytes / 100."""


def _schedule(tensors: int = 1, bucket_bytes: int = 1 << 20):
    """Two trainers (ranks 0, 1) hold rows 0-3 / 4-7 of an (8, 4) fp32 tensor (128 bytes); two
    workers (ranks 2, 3) each keep it whole: 0 and 1 each send 64 bytes to 2 and to 3."""
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = Layout(Mesh((2,), start_rank=2), (Replicate(),))
    return build_schedule(plan_model([TensorSpec(f"w{i}", "float32", (8, 4), src, dst) for i in range(tensors)]),
                          bucket_bytes)


def test_every_rank_on_its_own_node_is_bound_by_its_nic():
    links = LinkModel(gpus_per_node=1, nvlink_gbs=1.0, nic_gbs=SLOW)
    p = predict(_schedule(), links, trainer_ranks=2)
    assert p.seconds == pytest.approx(128 / 100)  # rank 0 sends 128 bytes
    assert p.bottleneck == "rank 0 NIC out (1.28 s of 1.28 s)"


def test_latency_is_paid_per_message_a_rank_posts():
    links = LinkModel(gpus_per_node=1, nvlink_gbs=1.0, nic_gbs=SLOW, latency_us=10_000)
    assert predict(_schedule(), links, trainer_ranks=2).seconds == pytest.approx(1.28 + 2 * 0.01)


def test_one_node_uses_nvlink_and_may_be_bound_by_its_host():
    """Colocated on one 4-GPU node: every transfer stays inside it."""
    links = LinkModel(gpus_per_node=4, nvlink_gbs=2 * SLOW, nic_gbs=1.0, placement="colocated")
    assert predict(_schedule(), links, trainer_ranks=2).seconds == pytest.approx(128 / 200)
    separate = LinkModel(gpus_per_node=4, nvlink_gbs=2 * SLOW, nic_gbs=SLOW)  # workers on node 1
    assert predict(_schedule(), separate, trainer_ranks=2).seconds == pytest.approx(128 / 100)
    hosted = LinkModel(gpus_per_node=4, nvlink_gbs=2 * SLOW, nic_gbs=1.0, host_gbs=SLOW, placement="colocated")
    p = predict(_schedule(), hosted, trainer_ranks=2)
    assert p.seconds == pytest.approx(256 / 100)  # the node receives 2 x 128 bytes
    assert p.bottleneck == "node 0 host receive (2.56 s of 2.56 s)"


def test_colocated_workers_split_their_traffic_between_nvlink_and_nic():
    """Worker 2 shares node 0 with trainer 0, worker 3 node 1 with trainer 1: each trainer sends
    64 bytes over NVLink and 64 over its NIC."""
    links = LinkModel(gpus_per_node=1, nvlink_gbs=2 * SLOW, nic_gbs=SLOW, placement="colocated")
    p = predict(_schedule(), links, trainer_ranks=2)
    assert p.seconds == pytest.approx(64 / 100)
    assert p.bottleneck.startswith("rank 0 NIC out")


def test_a_nic_shared_by_a_node_carries_all_its_ranks_traffic():
    """Two 2-GPU nodes, trainers on node 0, workers on node 1, one NIC each: node 0 sends 256 bytes."""
    links = LinkModel(gpus_per_node=2, nvlink_gbs=1.0, nic_gbs=1.0, node_nic_gbs=SLOW)
    p = predict(_schedule(), links, trainer_ranks=2)
    assert p.seconds == pytest.approx(256 / 100)
    assert p.bottleneck == "node 0 NIC out (2.56 s of 2.56 s)"


def test_buckets_add_up():
    schedule = _schedule(tensors=2, bucket_bytes=200)
    assert schedule.num_buckets == 2
    p = predict(schedule, LinkModel(gpus_per_node=1, nvlink_gbs=1.0, nic_gbs=SLOW), trainer_ranks=2)
    assert p.bucket_seconds == pytest.approx((1.28, 1.28))
    assert p.seconds == pytest.approx(2.56)


def test_bad_links_are_refused_with_their_values():
    with pytest.raises(ValueError, match=r"nic_gbs > 0, got 8, 450 and 0"):
        LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=0)
    with pytest.raises(ValueError, match=r"placement must be 'separate', 'colocated' or 'one_node', got 'mixed'"):
        LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=50, placement="mixed")
