"""Drivers run inside node 0's namespace of a `NetnsCluster` (`python -m tests.multihost.scenarios NAME`).

Each scenario places trainer and worker actors on chosen nodes (custom
resources `node<i>`), syncs with rl-sync across the namespaces over Gloo,
checks every worker bit-exact against the recipes, and prints one JSON line
of what it saw for the test to assert on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from typing import get_args

import ray
import torch

from actors import SyncError, WeightSync
from actors.bench import perturb
from actors.ready import InferenceWorker, TrainerActor
from rl_sync.config.sync import Mode, SyncConfig
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard
from tests.distributed.recipes import (
    Recipe,
    as_bytes,
    expected,
    read_all,
    set_version,
    trainer_build,
    worker_build,
)
from tests.distributed.stranger import listening_sockets

FSDP2 = Layout(Mesh((2,)), (Shard(0),))
RECIPES = [
    Recipe("w", torch.bfloat16, (64, 48), FSDP2, Layout(Mesh((2,)), (Shard(1),))),
    Recipe("b", torch.float32, (48,), FSDP2, Layout(Mesh((2,)), (Replicate(),))),
]
REPLICAS = [
    Recipe("w", torch.bfloat16, (64, 48), FSDP2, Layout(Mesh((2, 2)), (Replicate(), Shard(1)))),
    Recipe("b", torch.float32, (48,), FSDP2, Layout(Mesh((2, 2)), (Replicate(), Replicate()))),
]
BIG = [Recipe("w", torch.float32, (1024, 2048), FSDP2, Layout(Mesh((2,)), (Shard(1),)))]
"""8 MiB: long enough on a rate-limited link to take the link down in the middle of a round."""


def place(recipes, trainer_node: int, worker_nodes: list[int], workers_per_node: int):
    Trainer, Worker = ray.remote(TrainerActor), ray.remote(InferenceWorker)
    trainers = [
        Trainer.options(num_cpus=0.1, resources={f"node{trainer_node}": 1}).remote(i, 2, trainer_build(recipes))
        for i in range(2)
    ]
    size = len(worker_nodes) * workers_per_node
    workers = [
        Worker.options(num_cpus=0.1, resources={f"node{worker_nodes[k // workers_per_node]}": 1}).remote(
            k, size, worker_build(recipes)
        )
        for k in range(size)
    ]
    return trainers, workers


def step(trainers, recipes, version: int) -> None:
    ray.get([t.call.remote(set_version, recipes, version) for t in trainers])


def exact(workers, recipes, version: int) -> bool:
    got = ray.get([w.call.remote(read_all) for w in workers])
    return all(
        torch.equal(tensors[n], as_bytes(v))
        for j, tensors in enumerate(got)
        for n, v in expected(recipes, j, version).items()
    )


def config(**overrides) -> SyncConfig:
    """Addresses left to Ray (the node addresses), as on a real cluster."""
    return SyncConfig(**{"init_timeout_s": 60.0, "round_timeout_s": 30.0, **overrides})


def two_node(args) -> dict:
    """Trainers on node 0, a TP2 engine on node 1: three rounds, and where everything listened."""
    trainers, workers = place(RECIPES, 0, [1], 2)
    before = ray.get([a.call.remote(listening_sockets) for a in trainers + workers])
    sync = WeightSync.create(trainers, workers, config())
    after = ray.get([a.call.remote(listening_sockets) for a in trainers + workers])
    store = ray.get(sync.coordinator.__ray_call__.remote(lambda c: (c._store.host, ray.util.get_node_ip_address())))
    rounds = []
    for version in (1, 2, 3):
        step(trainers, RECIPES, version)
        sync.push()
        rounds.append(exact(workers, RECIPES, version))
    sync.close()
    opened = [sorted({a for a, _ in set(new) - set(old)}) for old, new in zip(before, after)]
    by_name = WeightSync.create(trainers, workers, config(interface="eth0"))  # each namespace's one NIC
    step(trainers, RECIPES, 4)
    by_name.push()
    rounds.append(exact(workers, RECIPES, 4))
    by_name.close()
    try:
        WeightSync.create(trainers, workers, config(interface="nope0"))
        unknown = None
    except ValueError as exc:
        unknown = str(exc)
    return {
        "exact": rounds,
        "store_host": store[0],
        "coordinator_node": store[1],
        "gloo_addresses": opened,
        "transport": sync.summary.transport,
        "unknown_interface": unknown,
    }


def replicas(args) -> dict:
    """Trainers on node 0, one TP2 engine replica on node 1 and one on node 2."""
    trainers, workers = place(REPLICAS, 0, [1, 2], 2)
    sync = WeightSync.create(trainers, workers, config())
    rounds = []
    for version in (1, 2):
        step(trainers, REPLICAS, version)
        sync.push()
        rounds.append(exact(workers, REPLICAS, version))
    nodes = ray.get([w.call.remote(lambda self: ray.util.get_node_ip_address()) for w in workers])
    sync.close()
    return {"exact": rounds, "worker_nodes": nodes}


def _bridge(args, node: int, up: bool) -> None:
    subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            f"{args.prefix}br",
            "ip",
            "link",
            "set",
            f"{args.prefix}p{node}",
            "up" if up else "down",
        ],
        check=True,
        timeout=30,
    )


def _shape(args, node: int, rate: str | None) -> None:
    """Rate-limit what flows into `node` (on its bridge port), or lift the limit."""
    port = f"{args.prefix}p{node}"
    tc = (
        ["tc", "qdisc", "replace", "dev", port, "root", "tbf", "rate", rate, "burst", "64kb", "latency", "500ms"]
        if rate
        else ["tc", "qdisc", "del", "dev", port, "root"]
    )
    subprocess.run(["ip", "netns", "exec", f"{args.prefix}br", *tc], check=True, timeout=30)


def link_down(args) -> dict:
    """Node 1's link goes down in the middle of a round (slowed to 20 Mbit/s so the round lasts)
    for `DOWN_S` seconds, longer than the round timeout and shorter than Ray takes to declare a
    node dead; the round fails, and the next push repairs."""
    trainers, workers = place(BIG, 0, [1], 2)
    sync = WeightSync.create(trainers, workers, config(round_timeout_s=4.0, init_timeout_s=30.0))
    coordinator_node = ray.get(sync.coordinator.__ray_call__.remote(lambda c: ray.util.get_node_ip_address()))
    step(trainers, BIG, 1)
    sync.push()
    _shape(args, 1, "20mbit")
    step(trainers, BIG, 2)
    start = time.monotonic()
    outcome: dict[str, str | float | None] = {}
    outage = threading.Timer(1.0, _outage, args=(args, 1))
    outage.start()
    try:
        sync.push()
        outcome["error"] = None
    except SyncError as exc:
        outcome["error"] = str(exc)
    outcome["seconds"] = time.monotonic() - start
    outage.join()
    _shape(args, 1, None)
    step(trainers, BIG, 3)
    repaired = sync.push(version=3)
    result = {
        **outcome,
        "repaired_version": repaired.version,
        "exact_after": exact(workers, BIG, 3),
        "versions": sync.versions(),
        "coordinator_node": coordinator_node,
    }
    sync.close()
    return result


DOWN_S = 6.0


def _outage(args, node: int) -> None:
    _bridge(args, node, up=False)
    time.sleep(DOWN_S)
    _bridge(args, node, up=True)


def nodes_stopped(args) -> dict:
    """Trainers on node 1, a TP2 engine on node 2. Node 2 stops dead: the round fails; Ray starts
    again there, new workers replace the dead ones and catch up. Then node 1 stops: the round
    fails and the workers keep the last version, untouched."""
    from tests.multihost.netns import NetnsCluster

    cluster = NetnsCluster(args.nodes, prefix=args.prefix, temp=args.temp, subnet=args.subnet)
    trainers, workers = place(RECIPES, 1, [2], 2)
    sync = WeightSync.create(trainers, workers, config(round_timeout_s=10.0, init_timeout_s=30.0))
    step(trainers, RECIPES, 1)
    sync.push()
    out: dict = {}
    cluster.kill_node(2)
    out["worker_node_error"] = _failure(sync, trainers, 2)
    _until_dead(cluster.ip(2))  # else Ray may still place the replacements on the dead node
    cluster.start_node(2)
    fresh = _workers_on(RECIPES, 2)
    for index, worker in enumerate(fresh):
        sync.replace_worker(index, worker)
    step(trainers, RECIPES, 3)
    out["replaced_version"] = sync.push(version=3).version
    out["replaced_exact"] = exact(fresh, RECIPES, 3)
    cluster.kill_node(1)
    out["trainer_node_error"] = _failure(sync, None, 4)
    out["kept_exact"] = exact(fresh, RECIPES, 3)
    out["versions"] = sync.versions()
    sync.close()
    return out


def _until_dead(ip: str, timeout_s: float = 120.0) -> None:
    """Wait until Ray has marked every node at `ip` dead (its heartbeats missed), bounded."""
    deadline = time.monotonic() + timeout_s
    while any(n["Alive"] and n["NodeManagerAddress"] == ip for n in ray.nodes()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray did not mark the node at {ip} dead within {timeout_s:.0f} s")
        time.sleep(0.5)


def _workers_on(recipes, node: int) -> list:
    Worker = ray.remote(InferenceWorker)
    return [
        Worker.options(num_cpus=0.1, resources={f"node{node}": 1}).remote(k, 2, worker_build(recipes)) for k in range(2)
    ]


def _failure(sync, trainers, version: int) -> dict:
    """Push `version` (trainers step first where they live); what failed, and how long it took."""
    if trainers is not None:
        step(trainers, RECIPES, version)
    start = time.monotonic()
    try:
        sync.push(version=version)
        return {"error": None, "seconds": time.monotonic() - start}
    except SyncError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}


LINK_MODEL = [
    Recipe(f"layers.{i}.w", torch.bfloat16, (2048, 4096), FSDP2, Layout(Mesh((2,)), (Shard(1),))) for i in range(4)
]
"""64 MiB of bf16 in four tensors, FSDP2 -> TP2."""


def links(args) -> dict:
    """Seconds and bytes per round in each mode, trainers on node 0 and a TP2 engine on node 0
    (loopback), on node 1 (a veth through the bridge), and on node 1 behind a 1 Gbit/s limit."""
    trainers, _ = place(LINK_MODEL, 0, [], 2)
    out = {}
    for label, node, rate in (("loopback", 0, None), ("veth", 1, None), ("1 Gbit/s", 1, "1gbit")):
        workers = _workers_on(LINK_MODEL, node)
        sync = WeightSync.create(trainers, workers, config(bucket_bytes=16 << 20, round_timeout_s=120.0))
        sync.push()
        if rate:
            _shape(args, node, rate)
        rows = {}
        for mode in get_args(Mode):
            rounds = []
            for seed in range(3):
                if mode in ("sparse", "auto"):
                    ray.get([t.call.remote(perturb, 0.01, seed) for t in trainers])
                rounds.append(sync.push(mode=mode))
            mid = sorted(rounds, key=lambda r: r.seconds)[1]
            rows[mode] = {
                "seconds": mid.seconds,
                "worker_bytes": mid.worker_received_bytes,
                "ran": mid.mode,
                "reason": mid.reason,
                "encodings": {k: v for r in mid.ranks for k, v in r.encodings.items() if v},
            }
        if rate:
            _shape(args, node, None)
        sync.close()
        for w in workers:
            ray.kill(w)
        out[label] = rows
    return out


RELAY_MODEL = [
    Recipe(f"layers.{i}.w", torch.bfloat16, (1024, 4096), FSDP2, Layout(Mesh((4, 1)), (Replicate(), Shard(1))))
    for i in range(4)
]
"""32 MiB of bf16 in four tensors, FSDP2 -> four TP1 engine replicas."""


def relay(args) -> dict:
    """Trainers on node 0, four TP1 replicas on node 1 behind a 1 Gbit/s limit: M2N and sparse
    rounds (1% changed) sent directly (four copies cross the link) and relayed (one copy
    crosses, the replicas forward it inside node 1); medians of 3, every round checked."""
    trainers, workers = place(RELAY_MODEL, 0, [1], 4)
    _shape(args, 1, "1gbit")
    out, version = {}, 0
    try:
        for choice in ("off", "on"):
            sync = WeightSync.create(
                trainers, workers, config(relay=choice, bucket_bytes=8 << 20, round_timeout_s=120.0)
            )
            rows: dict[str, object] = {}
            for mode in ("m2n", "sparse"):
                rounds, exacts = [], []
                if mode == "sparse":
                    version += 1
                    sync.push(version=version, mode=mode)  # dense: fills the baselines, not measured
                for seed in range(3):
                    version += 1
                    if mode == "m2n":
                        step(trainers, RELAY_MODEL, version)
                    else:
                        ray.get([t.call.remote(perturb, 0.01, seed) for t in trainers])
                    rounds.append(sync.push(version=version, mode=mode))
                    exacts.append(_hold_the_trainers_values(trainers, workers))
                mid = sorted(rounds, key=lambda r: r.seconds)[1]
                rows[mode] = {
                    "seconds": mid.seconds,
                    "ran": mid.mode,
                    "exact": all(exacts),
                    "trainer_bytes": max(r.sent_bytes for r in mid.ranks if r.role == "trainer"),
                    "worker_bytes": max(r.sent_bytes for r in mid.ranks if r.role == "worker"),
                }
            rows["summary"] = sync.summary.relay
            sync.close()
            out[choice] = rows
    finally:
        _shape(args, 1, None)
    return out


def _hold_the_trainers_values(trainers, workers) -> bool:
    """Every worker (a whole replica) holds exactly the trainers' row shards, joined."""
    shards = ray.get([t.call.remote(lambda self: {n: s.local.clone() for n, s in self.held.items()}) for t in trainers])
    whole = {name: as_bytes(torch.cat([s[name] for s in shards])) for name in shards[0]}
    return all(
        torch.equal(got[name], value)
        for got in ray.get([w.call.remote(read_all) for w in workers])
        for name, value in whole.items()
    )


SCENARIOS = {
    "links": links,
    "relay": relay,
    "two_node": two_node,
    "replicas": replicas,
    "link_down": link_down,
    "nodes_stopped": nodes_stopped,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--address", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--nodes", type=int, required=True)
    parser.add_argument("--temp", required=True)
    parser.add_argument("--subnet", type=int, required=True)
    args = parser.parse_args()
    ray.init(
        address=args.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}}
    )
    try:
        print(json.dumps(SCENARIOS[args.scenario](args)))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
