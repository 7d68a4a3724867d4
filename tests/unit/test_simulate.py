"""The link-model simulator on small cases whose seconds are worked out by hand."""

from __future__ import annotations

import pytest

from rl_sync.config.sync import Relay
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import build_schedule
from rl_sync.planning.simulate import LinkModel, predict

SLOW = 1e-7
"""100 bytes per second, in GB/s: seconds read as bytes / 100."""


def _schedule(tensors: int = 1, bucket_bytes: int = 1 << 20):
    """Two trainers (ranks 0, 1) hold rows 0-3 / 4-7 of an (8, 4) fp32 tensor (128 bytes); two
    workers (ranks 2, 3) each keep it whole: 0 and 1 each send 64 bytes to 2 and to 3."""
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = Layout(Mesh((2,), start_rank=2), (Replicate(),))
    return build_schedule(
        plan_model([TensorSpec(f"w{i}", "float32", (8, 4), src, dst) for i in range(tensors)]), bucket_bytes
    )


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
    with pytest.raises(ValueError, match=r"^LinkModel.nic_gbs must be finite and > 0, got 0$"):
        LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=0)
    with pytest.raises(ValueError, match=r"^LinkModel.host_gbs must be finite and >= 0, got nan$"):
        LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=50, host_gbs=float("nan"))
    with pytest.raises(ValueError, match=r"^LinkModel.latency_us must be finite and >= 0, got inf$"):
        LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=50, latency_us=float("inf"))
    with pytest.raises(ValueError, match=rf"^LinkModel.gpus_per_node must be in \[1, {2**20}\], got {2**70}$"):
        LinkModel(gpus_per_node=2**70, nvlink_gbs=450, nic_gbs=50)
    with pytest.raises(ValueError, match=r"placement must be 'separate', 'colocated' or 'one_node', got 'mixed'"):
        LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=50, placement="mixed")


def _replicas(replicas: int, tensors: int, bucket_bytes: int, relay: Relay):
    """Two trainers hold halves of `tensors` (8, 4) fp32 tensors (128 bytes each); `replicas`
    TP1 engines (ranks 2, 3, ...) each keep every tensor."""
    src = Layout(Mesh((2,)), (Shard(0),))
    dst = Layout(Mesh((replicas, 1), start_rank=2), (Replicate(), Replicate()))
    specs = [TensorSpec(f"w{i}", "float32", (8, 4), src, dst) for i in range(tensors)]
    return build_schedule(plan_model(specs), bucket_bytes, 0, relay)


def test_relay_trades_the_trainers_copies_for_a_pipeline_tail():
    """Four replicas, eight tensors, every rank on its own 100 B/s NIC. Directly each trainer
    sends 4 x 64 bytes per tensor: 8 x 2.56 s. Relayed, a bucket holds one tensor (the entry
    worker's 128 bytes count twice: it forwards as much), the entry worker receives 128 bytes
    while forwarding the previous tensor's 128: 1.28 s per bucket over 8 + 3 buckets."""
    links = LinkModel(gpus_per_node=1, nvlink_gbs=1.0, nic_gbs=SLOW)
    direct = predict(_replicas(4, 8, 256, "off"), links, trainer_ranks=2)
    assert direct.seconds == pytest.approx(8 * 2.56)
    relayed = _replicas(4, 8, 256, "on")
    assert relayed.num_buckets == 8 + 3
    p = predict(relayed, links, trainer_ranks=2)
    assert p.bucket_seconds == pytest.approx((1.28,) * 11)
    assert p.bottleneck == "rank 2 NIC out (10.2 s of 14.1 s)"  # buckets 1 to 8: it forwards


def test_auto_relays_when_the_byte_model_says_it_pays():
    four = _replicas(4, 8, 256, "auto")
    assert four.relay is not None
    assert four.relay_choice == (
        "relay: busiest link 2.0 kB (rank 0) sent directly, 1.0 kB (rank 2) relayed over 4 "
        "replicas plus a 3-bucket tail"
    )
    two = _replicas(2, 8, 256, "auto")
    assert two.relay is None and two.relay_choice.startswith("direct: busiest link")
    with pytest.raises(ValueError, match=r"^relay='on' needs destination tensors replicated over two or more engine"):
        build_schedule(
            plan_model(
                [
                    TensorSpec(
                        "w",
                        "float32",
                        (8, 4),
                        Layout(Mesh((2,)), (Shard(0),)),
                        Layout(Mesh((1, 2), start_rank=2), (Replicate(), Shard(0))),
                    )
                ]
            ),
            256,
            0,
            "on",
        )
