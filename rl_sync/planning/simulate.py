"""Predict a round's seconds from a schedule and a link model, and name its bottleneck.

Usage::

    links = LinkModel(gpus_per_node=8, nvlink_gbs=450, nic_gbs=50, latency_us=10)
    prediction = predict(build_schedule(plan, bucket_bytes), links, trainer_ranks=256)
    prediction.seconds, prediction.bottleneck

`rl-sync plan CONFIG --links LINKS.yaml` prints it beside the plan report.

The model (every figure in bytes per second, one direction):
- Ranks map onto nodes: trainer ranks `[0, S)` fill nodes of `gpus_per_node`
  in order; worker ranks start on the next node (`placement: separate`),
  share trainer rank `r - S`'s node (`placement: colocated`), or every rank
  is on one node (`placement: one_node`: one CPU host, Gloo over loopback).
- A transfer between two ranks of one node uses NVLink, otherwise both ranks'
  NICs. Each rank has its own NVLink and NIC rate in each direction.
- Buckets run one after another (the schedule's ordering contract). A rank's
  time in a bucket is its busiest link direction's bytes over that link's rate,
  plus `latency_us` per message it posts (one per peer and direction). A node's
  ranks may also share one `host_gbs` for every byte they receive (a CPU host
  moving Gloo traffic through loopback is bound by it, not by per-rank links),
  and one `node_nic_gbs` each way for every byte leaving or entering the node
  (one NIC per node instead of one per GPU).
  A bucket takes its slowest rank or node; a round, the sum of its buckets.
- The bottleneck is the (rank or node, link) that set the most bucket time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import numpy as np

from ..config.sync import check_int, check_number, either
from .layout import MAX_MESH_RANKS
from .relay import Relay
from .schedule import Schedule

LINKS = ("NVLink out", "NVLink in", "NIC out", "NIC in")

Placement = Literal["separate", "colocated", "one_node"]


@dataclass(frozen=True, kw_only=True)
class LinkModel:
    """A cluster's links, as `rl-sync plan --links` reads them from YAML."""

    gpus_per_node: int
    """Ranks (GPUs) per node."""
    nvlink_gbs: float
    """GB/s (1e9 bytes) per rank and direction inside a node."""
    nic_gbs: float
    """GB/s per rank and direction between nodes."""
    latency_us: float = 0.0
    """Microseconds per message a rank posts in a bucket."""
    host_gbs: float = 0.0
    """GB/s a whole node's ranks receive together (0: no such limit)."""
    node_nic_gbs: float = 0.0
    """GB/s each way through one NIC a node's ranks share (0: no such limit)."""
    placement: Placement = "separate"
    """Workers on nodes after the trainers', on their trainer rank's node, or every rank on one."""

    def __post_init__(self) -> None:
        check_int("LinkModel.gpus_per_node", self.gpus_per_node, 1, MAX_MESH_RANKS)
        for name in ("nvlink_gbs", "nic_gbs", "latency_us", "host_gbs", "node_nic_gbs"):
            check_number(f"LinkModel.{name}", getattr(self, name), positive=name in ("nvlink_gbs", "nic_gbs"))
        if self.placement not in get_args(Placement):
            raise ValueError(f"LinkModel.placement must be {either(get_args(Placement))}, got {self.placement!r}")

    def nodes(self, ranks: np.ndarray, trainer_ranks: int) -> np.ndarray:
        """The node of each global rank."""
        g = self.gpus_per_node
        workers = ranks >= trainer_ranks
        if self.placement == "one_node":
            return np.zeros_like(ranks)
        if self.placement == "colocated":
            return np.where(workers, ranks - trainer_ranks, ranks) // g
        return np.where(workers, -(-trainer_ranks // g) + (ranks - trainer_ranks) // g, ranks // g)


@dataclass(frozen=True)
class Prediction:
    """A round's predicted seconds, per bucket, and what bound it."""

    seconds: float
    bucket_seconds: tuple[float, ...]
    bottleneck: str
    """E.g. "rank 3 NIC out (2.10 s of 2.15 s)"."""


class TransferTable(NamedTuple):
    """One int64 column each: (bucket, source rank, destination rank, bytes) of every transfer."""

    bucket: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray


def transfer_table(schedule: Schedule) -> TransferTable:
    """Every transfer in the schedule, the relay's forwards included (`rl_sync.planning.relay`:
    what entry rank e receives in bucket j crosses from chain[k - 1] to chain[k] in bucket j + k)."""
    plan, relayed = schedule.routed, []
    out: tuple[list[np.ndarray], ...] = ([], [], [], [])
    for _, tensors in plan.groups():
        src_table, dst_table = plan.rank_table(tensors, "src"), plan.rank_table(tensors, "dst")
        for b, band in enumerate(schedule.bands[int(tensors[0])]):
            buckets = np.searchsorted(schedule.cuts, schedule.slab_start[tensors] + b, side="right") - 1
            for part, value in zip(
                out,
                (
                    np.repeat(buckets, len(band.src)),
                    src_table[:, band.src].ravel(),
                    dst_table[:, band.dst].ravel(),
                    np.outer(plan.itemsizes[tensors], band.numel).ravel(),
                ),
            ):
                part.append(value)
            relayed.append(np.repeat(schedule.relayed[tensors], len(band.src)))
    if not out[0]:
        return TransferTable._make(np.zeros(0, dtype=np.int64) for _ in range(4))
    table = TransferTable._make(np.concatenate(part).astype(np.int64) for part in out)
    return table if schedule.relay is None else _with_forwards(table, np.concatenate(relayed), schedule.relay)


def _with_forwards(table: TransferTable, relayed: np.ndarray, relay: Relay) -> TransferTable:
    bucket, _, dst, nbytes = (part[relayed] for part in table)
    size = int(max(max(relay.where), dst.max(initial=0))) + 1
    chains = np.full((relay.replicas, size), -1, dtype=np.int64)
    for entry, chain in relay.chains.items():
        chains[:, entry] = chain
    parts = [[part] for part in table]
    for k in range(1, relay.replicas):
        for part, value in zip(parts, (bucket + k, chains[k - 1][dst], chains[k][dst], nbytes)):
            part.append(value)
    return TransferTable._make(np.concatenate(part) for part in parts)


def predict(schedule: Schedule, links: LinkModel, trainer_ranks: int) -> Prediction:
    """The round's seconds under `links` (see the module docstring)."""
    bucket, src, dst, nbytes = transfer_table(schedule)
    keep = src != dst  # a rank's copy to itself moves nothing over a link
    bucket, src, dst, nbytes = bucket[keep], src[keep], dst[keep], nbytes[keep]
    buckets, ranks = schedule.num_buckets, int(max(src.max(initial=-1), dst.max(initial=-1)) + 1)
    if not len(nbytes):
        return Prediction(0.0, (0.0,) * buckets, "nothing crosses a link")
    node_of = links.nodes(np.arange(ranks), trainer_ranks)
    remote = node_of[src] != node_of[dst]
    load: np.ndarray = np.zeros(buckets * ranks * len(LINKS))
    for ranks_of, direction in ((src, 0), (dst, 1)):
        load += _sum_at((bucket * ranks + ranks_of) * len(LINKS) + direction + 2 * remote, nbytes, load.size)
    load = load.reshape(buckets, ranks, len(LINKS))
    rate = np.array([links.nvlink_gbs, links.nvlink_gbs, links.nic_gbs, links.nic_gbs]) * 1e9
    pairs = np.unique((bucket * ranks + src) * ranks + dst)  # one message per peer, bucket and direction
    messages = _sum_at(pairs // ranks, 1, buckets * ranks) + _sum_at(
        pairs // (ranks * ranks) * ranks + pairs % ranks, 1, buckets * ranks
    )
    messages = messages.reshape(buckets, ranks)
    link_time = load / rate
    rank_time = link_time.max(axis=2) + messages * links.latency_us * 1e-6
    candidates = [(rank_time, link_time.argmax(axis=2), "rank")]
    nodes = int(node_of.max()) + 1
    if links.host_gbs:
        host = _sum_at(bucket * nodes + node_of[dst], nbytes, buckets * nodes).reshape(buckets, nodes)
        candidates.append((host / (links.host_gbs * 1e9), np.full(host.shape, -1), "node"))
    if links.node_nic_gbs:
        out, into = (
            (
                _sum_at(bucket[remote] * nodes + node_of[side[remote]], nbytes[remote], buckets * nodes).reshape(
                    buckets, nodes
                )
            )
            for side in (src, dst)
        )
        nic = np.stack([out, into], axis=2)
        candidates.append((nic.max(axis=2) / (links.node_nic_gbs * 1e9), nic.argmax(axis=2) + 2, "node"))
    return _combine(candidates)


def _sum_at(index: np.ndarray, weights, size: int) -> np.ndarray:
    """`weights` summed by flat `index` into `size` slots (float)."""
    weights = np.broadcast_to(np.asarray(weights, dtype=np.float64), index.shape)
    return np.bincount(index, weights=weights, minlength=size).astype(np.float64)


def _combine(candidates) -> Prediction:
    """Per bucket the slowest rank or node; the bottleneck is the one bounding the most time."""
    best = np.stack([c[0].max(axis=1) for c in candidates])
    kind = best.argmax(axis=0)
    bucket_seconds = best.max(axis=0)
    blame: dict[str, float] = {}
    for b, k in enumerate(kind.tolist()):
        times, links, name = candidates[k]
        who = int(times[b].argmax())
        link = "host receive" if links[b, who] < 0 else LINKS[int(links[b, who])]
        key = f"{name} {who} {link}"
        blame[key] = blame.get(key, 0.0) + float(bucket_seconds[b])
    total = float(bucket_seconds.sum())
    worst = max(blame, key=blame.__getitem__)
    return Prediction(total, tuple(bucket_seconds.tolist()), f"{worst} ({blame[worst]:.3g} s of {total:.3g} s)")
