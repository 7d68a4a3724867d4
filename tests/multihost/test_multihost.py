"""rl-sync across Ray nodes in separate network namespaces: real interfaces, a real bridge.

A two-node cluster (`netns.NetnsCluster`) serves the module, a three-node one
the tests that need it; each test runs a driver scenario (`scenarios.py`)
inside node 0's namespace. Skipped where network namespaces cannot be made.
CI runs the two-node sync; the faults and the three-node cases are `slow`
(about 40 to 75 s each here; `python -m pytest -m slow tests/multihost`).
"""

from __future__ import annotations

import re

import pytest

from .netns import NetnsCluster

WHY_NOT = NetnsCluster.usable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=WHY_NOT or "")


@pytest.fixture(scope="module")
def cluster():
    with NetnsCluster(nodes=2) as running:
        yield running


@pytest.fixture(scope="module")
def cluster3():
    with NetnsCluster(nodes=3, subnet=1) as running:
        yield running


def test_two_nodes_sync_bit_exact_over_the_node_addresses(cluster):
    seen = cluster.run_driver(["tests.multihost.scenarios", "two_node"], timeout_s=300)
    assert seen["exact"] == [True, True, True, True] and seen["transport"] == "gloo"  # the 4th by interface name
    assert (
        seen["unknown_interface"] is not None
        and "SyncConfig.interface 'nope0' has no IPv4 address" in seen["unknown_interface"]
        and "eth0" in seen["unknown_interface"]
    ), seen["unknown_interface"]
    assert seen["store_host"] == seen["coordinator_node"] != "127.0.0.1", (
        "the store binds the coordinator's node address"
    )
    trainers, workers = seen["gloo_addresses"][:2], seen["gloo_addresses"][2:]
    assert trainers == [[cluster.ip(0)]] * 2 and workers == [[cluster.ip(1)]] * 2, seen["gloo_addresses"]


@pytest.mark.slow
def test_engine_replicas_on_two_other_nodes_sync_bit_exact(cluster3):
    seen = cluster3.run_driver(["tests.multihost.scenarios", "replicas"], timeout_s=300)
    assert seen["exact"] == [True, True]
    assert seen["worker_nodes"] == [cluster3.ip(1)] * 2 + [cluster3.ip(2)] * 2


@pytest.mark.slow
def test_a_link_down_mid_round_fails_in_time_and_the_next_push_repairs(cluster):
    seen = cluster.run_driver(["tests.multihost.scenarios", "link_down"], timeout_s=600)
    assert seen["coordinator_node"] == cluster.ip(0), "the coordinator runs beside the driver"
    assert seen["error"] is not None and "round 2 (m2n) failed on" in seen["error"], seen
    assert seen["seconds"] < 4.0 + 20, f"the round failed {seen['seconds']:.1f} s after it started: {seen}"
    named = {
        int(r)
        for group in re.findall(r"trainer \d \(rank \d\): .*?transfers with rank\(s\) \[([\d, ]+)\]", seen["error"])
        for r in group.split(",")
    }
    assert named and named <= {2, 3}, f"the trainers name the workers behind the link: {seen['error']}"
    assert seen["repaired_version"] == 3 and seen["exact_after"] and seen["versions"] == [3, 3], seen


@pytest.mark.slow
def test_stopped_nodes_fail_the_round_clearly_and_replacements_catch_up(cluster3):
    seen = cluster3.run_driver(["tests.multihost.scenarios", "nodes_stopped"], timeout_s=600)
    worker_side, trainer_side = seen["worker_node_error"], seen["trainer_node_error"]
    assert worker_side["error"] and "round 2" in worker_side["error"], seen
    assert seen["replaced_version"] == 3 and seen["replaced_exact"], seen
    assert trainer_side["error"] and "round 4" in trainer_side["error"], seen
    assert seen["kept_exact"], "a round whose trainers died wrote nothing into the live weights"
    assert seen["versions"][-2:] != [4, 4], seen
