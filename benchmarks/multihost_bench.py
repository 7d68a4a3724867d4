"""Rounds across Ray nodes in network namespaces: loopback, an unshaped veth, a 1 Gbit/s link.

Needs root (network namespaces). Starts a two-node `NetnsCluster`, runs the
`links` scenario of `tests/multihost/scenarios.py` in node 0's namespace
(2 FSDP trainers on node 0, a TP2 engine on node 0, then on node 1, then on
node 1 behind a `tc tbf` limit of 1 Gbit/s; 64 MiB of bf16; M2N, broadcast,
sparse and auto after 1% of every tensor changed; medians of 3) and prints a
table.

    sudo python benchmarks/multihost_bench.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tests.multihost.netns import NetnsCluster  # noqa: E402


def main() -> int:
    why_not = NetnsCluster.usable()
    if why_not:
        print(f"cannot run: {why_not}")
        return 1
    with NetnsCluster(nodes=2) as cluster:
        result = cluster.run_driver(["tests.multihost.scenarios", "links"], timeout_s=1200)
    table = Table(title="64 MiB bf16, 2 FSDP trainers -> TP2 engine, medians of 3 (sparse/auto: 1% changed)")
    for column in ("link", "mode", "ran", "seconds", "MB into the busiest worker", "transfers by encoding"):
        table.add_column(column, justify="right")
    reasons = []
    for link, rows in result.items():
        for mode, row in rows.items():
            table.add_row(link, mode, row["ran"], f"{row['seconds']:.3f}", f"{row['worker_bytes'] / 1e6:.2f}",
                          ", ".join(f"{k} {v}" for k, v in row["encodings"].items()))
            if mode == "auto":
                reasons.append(f"{link}: {row['reason']}")
    table.caption = "\n".join(reasons)
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
