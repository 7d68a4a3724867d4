"""Rounds across Ray nodes in network namespaces: loopback, an unshaped veth, a 1 Gbit/s link.

Needs root (network namespaces). Starts a two-node `NetnsCluster`, runs the
`links` scenario of `tests/multihost/scenarios.py` in node 0's namespace
(2 FSDP trainers on node 0, a TP2 engine on node 0, then on node 1, then on
node 1 behind a `tc tbf` limit of 1 Gbit/s; 64 MiB of bf16; M2N, broadcast,
sparse and auto after 1% of every tensor changed; medians of 3) and prints a
table, with the M2N round `rl_sync.planning.simulate` predicts for each link: one node,
or two nodes of two ranks, under `configs/links_cpu_loopback.yaml`'s host rate
(the veth is unshaped) and, for the limited link, a 1 Gbit/s NIC per node.

Then the `relay` scenario: 2 FSDP trainers on node 0, four TP1 engine replicas on node
1 behind 1 Gbit/s, M2N and sparse rounds sent directly and relayed among the replicas
(`SyncConfig.relay`), with the simulator's prediction of each M2N round
(`--relay-only` stops after it).

    sudo python benchmarks/multihost_bench.py [--relay-only]
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TypedDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from rl_sync.config.load import load_config
from rl_sync.config.sync import Relay
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import build_schedule
from rl_sync.planning.simulate import LinkModel, Placement, predict
from tests.multihost.netns import NetnsCluster
from tests.multihost.scenarios import LINK_MODEL, RELAY_MODEL


class _Link(TypedDict, total=False):
    """`LinkModel` fields a scenario's link changes."""

    placement: Placement
    gpus_per_node: int
    node_nic_gbs: float


LINKS: dict[str, _Link] = {
    "loopback": dict(placement="one_node"),
    "veth": dict(placement="separate", gpus_per_node=2),
    "1 Gbit/s": dict(placement="separate", gpus_per_node=2, node_nic_gbs=0.125),
}
"""How each scenario's link changes the CPU host's link model."""


def predicted(link: str) -> str:
    """The M2N round `rl_sync.planning.simulate` predicts for the scenario's model on `link`."""
    host = load_config(Path(__file__).resolve().parents[1] / "configs" / "links_cpu_loopback.yaml", LinkModel, ())
    specs = [TensorSpec(r.name, "bfloat16", r.shape, r.src, r.dst.remapped([2, 3])) for r in LINK_MODEL]
    links = replace(host, **LINKS[link])
    return f"{predict(build_schedule(plan_model(specs), 16 << 20), links, trainer_ranks=2).seconds:.3f}"


def predicted_relay(relay: Relay) -> str:
    """The M2N round of the relay scenario (trainers on node 0, four replicas on node 1 behind
    one 1 Gbit/s NIC) as `rl_sync.planning.simulate` predicts it, sent directly or relayed."""
    host = load_config(Path(__file__).resolve().parents[1] / "configs" / "links_cpu_loopback.yaml", LinkModel, ())
    specs = [TensorSpec(r.name, "bfloat16", r.shape, r.src, r.dst.remapped([2, 3, 4, 5])) for r in RELAY_MODEL]
    links = LinkModel(**{**host.__dict__, "placement": "separate", "gpus_per_node": 4, "node_nic_gbs": 0.125})
    schedule = build_schedule(plan_model(specs), 8 << 20, 1 << 20, relay)
    return f"{predict(schedule, links, trainer_ranks=2).seconds:.3f}"


def relay_table(result: dict) -> Table:
    table = Table(
        title="32 MiB bf16, 2 FSDP trainers on node 0 -> 4 TP1 replicas on node 1 behind 1 Gbit/s, "
        "medians of 3 (sparse: 1% changed)"
    )
    for column in (
        "relay",
        "mode",
        "ran",
        "seconds",
        "predicted",
        "MB from the busiest trainer",
        "MB from the busiest worker",
        "bit-exact",
    ):
        table.add_column(column, justify="right")
    for relay, rows in result.items():
        for mode in ("m2n", "sparse"):
            row = rows[mode]
            table.add_row(
                relay,
                mode,
                row["ran"],
                f"{row['seconds']:.3f}",
                predicted_relay(relay) if mode == "m2n" else "",
                f"{row['trainer_bytes'] / 1e6:.2f}",
                f"{row['worker_bytes'] / 1e6:.2f}",
                str(row["exact"]),
            )
    table.caption = "\n".join(f"relay={relay}: {rows['summary']}" for relay, rows in result.items())
    return table


def main() -> int:
    why_not = NetnsCluster.usable()
    if why_not:
        print(f"cannot run: {why_not}")
        return 1
    with NetnsCluster(nodes=2) as cluster:
        relayed = cluster.run_driver(["tests.multihost.scenarios", "relay"], timeout_s=1200)
        Console(width=160).print(relay_table(relayed))
        if "--relay-only" in sys.argv:
            return 0
        result = cluster.run_driver(["tests.multihost.scenarios", "links"], timeout_s=1200)
    table = Table(title="64 MiB bf16, 2 FSDP trainers -> TP2 engine, medians of 3 (sparse/auto: 1% changed)")
    for column in (
        "link",
        "mode",
        "ran",
        "seconds",
        "predicted",
        "MB into the busiest worker",
        "transfers by encoding",
    ):
        table.add_column(column, justify="right")
    reasons = []
    for link, rows in result.items():
        for mode, row in rows.items():
            table.add_row(
                link,
                mode,
                row["ran"],
                f"{row['seconds']:.3f}",
                predicted(link) if mode == "m2n" else "",
                f"{row['worker_bytes'] / 1e6:.2f}",
                ", ".join(f"{k} {v}" for k, v in row["encodings"].items()),
            )
            if mode == "auto":
                reasons.append(f"{link}: {row['reason']}")
    table.caption = "\n".join(reasons)
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
