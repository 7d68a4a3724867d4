"""Relay among engine replicas: trainers send a replicated box to one replica only, and the
workers holding it pass it down a chain of the other replicas.

Without relay, every trainer rank sends one copy of its shard per engine replica,
so with E replicas the trainers' links carry E times the model while the
workers' outgoing links stay idle. With relay, a tensor whose destination
layout replicates it over E engine replicas (mesh dim 0 `Replicate`, as the
binders lay out engines) is planned into replica 0 only (its *entry* replica),
and worker `chain[k]` forwards what it received to worker `chain[k + 1]`, the
rank at the same mesh position in the next replica. Every trainer then sends
about 1/E of what it sent, and each worker sends at most what it receives.

Pipelining: a message the entry worker receives in bucket j is forwarded by
replica k - 1 to replica k in bucket j + k, as the very same message (same
segments, same byte layout; a sparse payload travels as it arrived). A round
takes E - 1 buckets more; every bucket's relay overlaps the next bucket's
direct transfers.

Which ranks form a chain is read from the destination layouts: position i of
replica k on a tensor's mesh is chained after position i of replica k - 1.
Every relayed tensor must agree on that map (it does when the replicas are
engines of one parallel config); a tensor that does not, or that has a
different replica count, is sent directly. Colocated plans never relay.

Ordering contract (see `schedule.py`): a forwarding rank completes bucket j
before it posts bucket j + 1, so it forwards only what it already holds; for a
pair of workers the forwarded messages are listed in the same order on both
sides (the entry worker's order of reception).

Typical use (what `Schedule(plan, ..., relay=True)` does)::

    relay = find_relay(plan)
    routed = plan_model(entry_specs(plan, relay))   # relayed tensors into their entry replica only
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .layout import Layout, Mesh, Replicate
from .plan import ModelPlan, TensorSpec

RelayKey = tuple[int, int]
"""(direct bucket index, ordinal among the entry worker's relayed receives in that bucket):
names one forwarded message on every worker of its chain."""


@dataclass(frozen=True)
class Relay:
    """The chains of a plan and the tensors that use them."""

    chains: dict[int, tuple[int, ...]]
    """Entry worker rank -> the ranks of its chain, entry first (one per replica)."""
    where: dict[int, tuple[int, int]]
    """Worker rank -> (its chain's entry rank, its place k in the chain)."""
    tensors: frozenset[int]
    """Indices of the relayed tensors."""

    @property
    def replicas(self) -> int:
        return len(next(iter(self.chains.values())))


def _replicas(layout: Layout) -> np.ndarray | None:
    """The layout's ranks as (replicas, positions), or None when mesh dim 0 is not a replica dim."""
    mesh = layout.mesh
    if mesh.ndim < 2 or mesh.shape[0] < 2 or not isinstance(layout.placements[0], Replicate):
        return None
    return np.asarray(mesh.ranks, dtype=np.int64).reshape(mesh.shape[0], -1)


def _claims(table: np.ndarray) -> dict[int, tuple[int, int]]:
    return {int(rank): (int(table[0, i]), k) for k in range(table.shape[0]) for i, rank in enumerate(table[k])}


def find_relay(plan: ModelPlan) -> Relay | None:
    """The relay chains of `plan` (see the module docstring), or None when nothing can relay."""
    if plan.colocated:
        return None
    where: dict[int, tuple[int, int]] = {}
    tensors, replicas, decided = [], None, {}
    for i, spec in enumerate(plan.specs):
        if spec.dst not in decided:
            decided[spec.dst] = _admit(spec.dst, where, replicas)
            if decided[spec.dst] and replicas is None:
                replicas = spec.dst.mesh.shape[0]
        if decided[spec.dst]:
            tensors.append(i)
    if not tensors:
        return None
    chains: dict[int, list[int]] = {}
    for rank, (entry, _) in sorted(where.items(), key=lambda item: item[1][1]):
        chains.setdefault(entry, []).append(rank)
    return Relay({e: tuple(c) for e, c in chains.items()}, where, frozenset(tensors))


def _admit(layout: Layout, where: dict[int, tuple[int, int]], replicas: int | None) -> bool:
    """Whether tensors laid out as `layout` relay; records its chains in `where` when they do."""
    table = _replicas(layout)
    if table is None or (replicas is not None and table.shape[0] != replicas):
        return False
    claims = _claims(table)
    holders = {claim: rank for rank, claim in where.items()}
    if any(where.get(rank, claim) != claim or holders.get(claim, rank) != rank for rank, claim in claims.items()):
        return False  # a rank in another place, or a place held by another rank: not the same chains
    where.update(claims)
    return True


def entry_layout(layout: Layout) -> Layout:
    """`layout` restricted to its replica 0 (mesh dim 0 kept, of size 1)."""
    mesh = layout.mesh
    first = mesh.ranks[: len(mesh.ranks) // mesh.shape[0]]
    return Layout(Mesh((1,) + mesh.shape[1:], ranks=first), layout.placements)


def entry_specs(plan: ModelPlan, relay: Relay) -> list[TensorSpec]:
    """The plan's specs with every relayed tensor planned into its entry replica only."""
    entries: dict[Layout, Layout] = {}
    out = []
    for i, spec in enumerate(plan.specs):
        if i in relay.tensors:
            spec = replace(spec, dst=entries.setdefault(spec.dst, entry_layout(spec.dst)))
        out.append(spec)
    return out


def rank_loads(routed: ModelPlan, relay: Relay | None) -> tuple[dict[int, int], dict[int, int]]:
    """(bytes each rank sends, bytes each rank receives) in a round of `routed` (the plan the
    trainers' transfers follow), forwarding included."""
    send, recv = dict(routed.stats.send_bytes), dict(routed.stats.recv_bytes)
    if relay is None:
        return send, recv
    into_entry = ModelPlan([routed.specs[i] for i in sorted(relay.tensors)], routed.colocated).stats.recv_bytes
    for entry, chain in relay.chains.items():
        nbytes = into_entry.get(entry, 0)
        for k, rank in enumerate(chain):
            if k:
                recv[rank] = recv.get(rank, 0) + nbytes
            if k + 1 < len(chain):
                send[rank] = send.get(rank, 0) + nbytes
    return send, recv


def busiest(loads: tuple[dict[int, int], dict[int, int]]) -> tuple[int, int]:
    """(rank, bytes) of the rank whose link carries the most in one direction."""
    send, recv = loads
    return max(
        ((rank, max(send.get(rank, 0), recv.get(rank, 0))) for rank in set(send) | set(recv)),
        key=lambda item: (item[1], -item[0]),
        default=(-1, 0),
    )


RELAY_MARGIN = 0.8
"""`auto` relays only when the busiest link's bytes, grown by the relay's pipeline tail, drop
below this fraction of the direct round's: what the byte model leaves out (a forwarding
worker's wait for each bucket, per-message latency) must not eat the gain."""


def relay_pays(plan: ModelPlan, relayed: ModelPlan, relay: Relay, buckets: int) -> tuple[bool, str]:
    """Whether relaying shortens the round, and the figures it compared, by the byte model: every rank's link has
    one rate each way (full duplex), so a round takes as long as its busiest link's bytes; the
    relay adds `relay.replicas - 1` buckets to the `buckets` of the round. `rl-sync plan
    --links` predicts both with real link rates instead."""
    rank, direct = busiest(rank_loads(plan, None))
    via, relayed_bytes = busiest(rank_loads(relayed, relay))
    tail = relayed_bytes * (1 + (relay.replicas - 1) / max(1, buckets))
    why = (
        f"busiest link {_size(direct)} (rank {rank}) sent directly, {_size(relayed_bytes)} (rank {via}) relayed over "
        f"{relay.replicas} replicas plus a {relay.replicas - 1}-bucket tail"
    )
    return tail < RELAY_MARGIN * direct, why


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"
