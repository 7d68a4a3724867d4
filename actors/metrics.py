"""Per-round statistics as Ray metrics (Prometheus / the Ray dashboard) and log lines.

Recorded by the coordinator after every round: `rl_sync_round_seconds`
(histogram), `rl_sync_round_bytes` (counter of bytes received by workers),
`rl_sync_wire_bytes` (counter of bytes sent), `rl_sync_version` (gauge), all
tagged with the sync group's name and the round's mode. Without Ray's metrics
agent (`ray[default]`) they cost nothing.
"""

from __future__ import annotations

import logging

from ray.util import metrics

from rl_sync.wire.stats import RoundStats

log = logging.getLogger("rl_sync")


class RoundMetrics:
    """Ray metrics for one sync group."""

    def __init__(self, group: str):
        tags = ("group", "mode")
        self.group = group
        self.seconds = metrics.Histogram(
            "rl_sync_round_seconds",
            "Seconds per weight-sync round",
            boundaries=[0.01, 0.05, 0.1, 0.5, 1, 5, 30],
            tag_keys=tags,
        )
        self.received = metrics.Counter("rl_sync_round_bytes", "Bytes received by inference workers", tag_keys=tags)
        self.sent = metrics.Counter("rl_sync_wire_bytes", "Bytes sent on the wire", tag_keys=tags)
        self.version = metrics.Gauge("rl_sync_version", "Last weight version applied everywhere", tag_keys=("group",))

    def record(self, stats: RoundStats) -> None:
        tags = {"group": self.group, "mode": stats.mode}
        self.seconds.observe(stats.seconds, tags=tags)
        received = sum(r.received_bytes for r in stats.ranks if r.role != "trainer")
        if received > 0:  # Ray counters refuse increments of 0 (a colocated round sends nothing)
            self.received.inc(received, tags=tags)
        if stats.sent_bytes > 0:
            self.sent.inc(stats.sent_bytes, tags=tags)
        self.version.set(stats.version, tags={"group": self.group})
        log.info(stats.log_line())
