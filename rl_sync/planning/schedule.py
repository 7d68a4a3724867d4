"""The schedule: a model plan cut into ordered buckets, each one grouped P2P launch.

A tensor whose transfers would put more than `bucket_bytes` on one rank is
cut into row bands (global dim 0), so every bucket stays near its bound. The
sequence of slabs (one row band of one tensor: the unit the cut works in), in
plan order, is then cut greedily into
buckets so that no rank sends plus receives more than `bucket_bytes` in one
bucket (a single slab larger than that gets a bucket of its own). The cut is
the same on every rank because it is computed once, from the plan, by the
coordinator (or by anyone: it is a pure function).

Inside a bucket each rank talks to each peer with few messages: segments under
`coalesce_bytes` are packed into one message per peer and direction (each at
a 16-byte-aligned offset), larger segments travel as messages of their own, so
an engine can send and receive them without a copy when the local storage of
the box is contiguous.

Ordering contract: every rank executes its buckets in increasing index, and in
each bucket posts its sends and receives together as one grouped launch. For
a pair of ranks the sender's messages to a peer and the peer's receives from it
are listed in the same order. Ranks with nothing in a bucket skip it. Any set
of ranks doing this completes: bucket k only waits on peers that have finished
bucket k - 1.

Typical use::

    schedule = build_schedule(model_plan, bucket_bytes=256 << 20)
    mine = schedule.rank_slice(rank)       # RankSchedule: this rank's buckets only
    for bucket in mine.buckets:
        ...  # pack bucket.sends, post sends and recvs, unpack bucket.recvs
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import get_args

import numpy as np

from ..config.sync import Relay, either
from .bands import Band, band_count, make_bands
from .plan import ModelPlan
from .relay import RelayKey, entry_specs, find_relay, relay_pays

ALIGN = 16

_SlabEntry = tuple[int, int, int, int | None, int | None]
"""(slab index, tensor, band, src position, dst position) of a slab one rank takes part in."""
_BoxEntry = tuple[int, tuple[int, ...], tuple[int, ...], int]
"""(tensor, global offsets, sizes, bytes) of one box bound for a message."""


@dataclass(frozen=True)
class Segment:
    """One box of one tensor inside a message, at byte offset `start`."""

    tensor: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    start: int


@dataclass(frozen=True)
class Message:
    """One contiguous byte buffer exchanged with `peer` in a bucket."""

    peer: int
    nbytes: int
    segments: tuple[Segment, ...]
    relay: RelayKey | None = None
    """Set on a message of relayed boxes a worker receives or forwards (`rl_sync.planning.relay`): a
    forwarded message is read from the forwarding worker's destination storage."""


@dataclass(frozen=True)
class RankBucket:
    """A rank's part of one bucket: what it sends, receives and copies locally."""

    index: int
    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]
    local: tuple[Segment, ...]


@dataclass(frozen=True)
class RankSchedule:
    """Everything one rank does in a round, bucket by bucket."""

    rank: int
    buckets: tuple[RankBucket, ...]


class Schedule:
    """Buckets over a `ModelPlan`; `rank_slice(rank)` gives one rank its part."""

    def __init__(
        self,
        plan: ModelPlan,
        bucket_bytes: int,
        coalesce_bytes: int,
        cuts: tuple[int, ...] | None = None,
        relay: bool = False,
    ):
        if bucket_bytes <= 0 or coalesce_bytes < 0:
            raise ValueError(
                f"bucket_bytes must be > 0 and coalesce_bytes >= 0, got {bucket_bytes} and {coalesce_bytes}"
            )
        self.plan = plan
        """The plan as the sides laid it out (what each rank holds)."""
        self.relay = find_relay(plan) if relay else None
        """Chains among engine replicas (`rl_sync.planning.relay`), or None: every box sent directly."""
        self.routed = plan if self.relay is None else ModelPlan(entry_specs(plan, self.relay), plan.colocated)
        """The plan the trainers' transfers follow (relayed tensors into their entry replica)."""
        self.bucket_bytes = bucket_bytes
        self.coalesce_bytes = coalesce_bytes
        self.relayed = np.zeros(len(plan), dtype=bool)
        """Per tensor: whether it is relayed."""
        if self.relay is not None:
            self.relayed[sorted(self.relay.tensors)] = True
        routed = self.routed
        forwarded = self._forward_factor(np.arange(len(routed)))[:, 0].tolist()
        keys = list(zip(routed.tensor_template.tolist(), routed.itemsizes.tolist(), forwarded))
        counts = {
            key: band_count(routed.templates[key[0]], key[1] * key[2], bucket_bytes) for key in dict.fromkeys(keys)
        }
        _check_slabs(sum(counts[key] for key in keys), bucket_bytes)
        cache: dict[tuple[int, int, int], tuple[Band, ...]] = {}
        for key in counts:  # a relayed tensor's bands counted twice: its receivers forward as much again
            cache[key] = make_bands(routed.templates[key[0]], key[1] * key[2], bucket_bytes)
        self.bands = [cache[key] for key in keys]
        self.order = _interleaved_order(routed)
        num_bands = np.array([len(b) for b in self.bands], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(num_bands[self.order])])
        self.num_slabs = int(starts[-1])
        self.slab_start = np.empty(len(routed), dtype=np.int64)
        self.slab_start[self.order] = starts[:-1]
        self.cuts = tuple(cuts) if cuts is not None else cut_buckets(self._loads(), self.num_slabs, bucket_bytes)
        self._check_cuts()
        self.relay_choice = "relay on" if self.relay is not None else "direct"
        """What `build_schedule` chose about relay, and why."""

    @property
    def relay_depth(self) -> int:
        """Buckets a round takes beyond the direct ones: one per relay stage."""
        return 0 if self.relay is None else self.relay.replicas - 1

    @property
    def num_buckets(self) -> int:
        """Bucket indices a round uses (direct ones, then the relay stages' tail)."""
        return len(self.cuts) - 1 + (self.relay_depth if self.num_slabs else 0)

    @cached_property
    def slabs(self) -> list[tuple[int, int]]:
        """(tensor, band) of every slab, in schedule order."""
        return [(t, b) for t in self.order.tolist() for b in range(len(self.bands[t]))]

    def bucket_slabs(self, bucket: int) -> list[tuple[int, int]]:
        """(tensor, band) of every slab in `bucket`, in schedule order."""
        return self.slabs[self.cuts[bucket] : self.cuts[bucket + 1]]

    def _loads(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(slab, rank, bytes) of every rank's send + receive load in every slab."""
        slabs, ranks, loads = [], [], []
        for _, tensors in self.routed.groups():
            for size in np.unique(self.routed.itemsizes[tensors]).tolist():
                group = tensors[self.routed.itemsizes[tensors] == size]
                table = np.concatenate(
                    [self.routed.rank_table(group, "src"), self.routed.rank_table(group, "dst")], axis=1
                )
                forwarded = self._forward_factor(group)
                for b, band in enumerate(self.bands[int(group[0])]):
                    load = np.concatenate([band.send_numel, band.recv_numel]) * size
                    keep = load > 0
                    receives = (np.arange(len(load)) >= len(band.send_numel))[keep]
                    slabs.append(np.repeat(self.slab_start[group] + b, int(keep.sum())))
                    ranks.append(table[:, keep].ravel())
                    loads.append((load[keep] * np.where(receives, forwarded, 1)).ravel())
        if not slabs:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(slabs), np.concatenate(ranks), np.concatenate(loads)

    def _forward_factor(self, tensors: np.ndarray) -> np.ndarray:
        """(len(tensors), 1): 2 for relayed tensors, whose receivers forward as much again in the
        next bucket (so a bucket holds about `bucket_bytes` per rank in steady state), else 1."""
        return np.where(self.relayed[tensors], 2, 1)[:, None]

    def _check_cuts(self) -> None:
        cuts = self.cuts
        if not cuts or cuts[0] != 0 or cuts[-1] != self.num_slabs or any(b <= a for a, b in itertools.pairwise(cuts)):
            raise ValueError(
                f"bucket cuts must rise strictly from 0 to the slab count {self.num_slabs}, got {cuts[:8]}..."
            )

    def rank_slice(self, rank: int, tensors: Collection[int] | None = None) -> RankSchedule:
        """This rank's buckets; `tensors` restricts a round to a subset (same on every rank)."""
        direct = self._direct_slice(rank, tensors)
        if self.relay is None or (place := self.relay.where.get(rank)) is None:
            return direct
        entry, k = place
        chain = self.relay.chains[entry]
        relayed = direct if entry == rank else self._direct_slice(entry, tensors)
        return RankSchedule(rank, merge_buckets(direct.buckets, relayed_buckets(relayed.buckets, chain, k)))

    def _direct_slice(self, rank: int, tensors: Collection[int] | None) -> RankSchedule:
        chosen = range(len(self.routed)) if tensors is None else sorted(set(tensors))
        entries: list[_SlabEntry] = []
        for tensor in chosen:
            spec = self.routed.specs[tensor]
            src_pos, dst_pos = spec.src.mesh.index_of(rank), spec.dst.mesh.index_of(rank)
            if src_pos is not None or dst_pos is not None:
                first = int(self.slab_start[tensor])
                entries.extend((first + b, tensor, b, src_pos, dst_pos) for b in range(len(self.bands[tensor])))
        entries.sort()
        bucket_of = np.searchsorted(self.cuts, [e[0] for e in entries], side="right") - 1
        by_bucket: dict[int, list[_SlabEntry]] = {}
        for bucket, entry in zip(bucket_of.tolist(), entries):
            by_bucket.setdefault(bucket, []).append(entry)
        buckets = (self._rank_bucket(index, slabs) for index, slabs in sorted(by_bucket.items()))
        return RankSchedule(rank, tuple(b for b in buckets if b.sends or b.recvs or b.local))

    def _rank_bucket(self, index: int, slabs: list[_SlabEntry]) -> RankBucket:
        sends: dict[tuple[int, bool], list[_BoxEntry]] = {}
        recvs: dict[tuple[int, bool], list[_BoxEntry]] = {}
        local: list[Segment] = []
        for _, tensor, band_index, src_pos, dst_pos in slabs:
            spec, size = self.routed.specs[tensor], int(self.routed.itemsizes[tensor])
            band = self.bands[tensor][band_index]
            for side, pos, peers, out in (
                ("src", src_pos, spec.dst.mesh, sends),
                ("dst", dst_pos, spec.src.mesh, recvs),
            ):
                if pos is not None:
                    for peer, offsets, sizes, numel in band.transfers(side, pos):
                        key = (peers.ranks[peer], bool(self.relayed[tensor]))
                        out.setdefault(key, []).append((tensor, offsets, sizes, numel * size))
            if band_index == 0 and src_pos is not None and dst_pos is not None:
                local.extend(self._local_segments(tensor, src_pos, dst_pos, size))
        return RankBucket(index, self._messages(sends), self._messages(recvs, index), tuple(local))

    def _local_segments(self, tensor: int, src_pos: int, dst_pos: int, size: int) -> list[Segment]:
        t = self.routed.templates[self.routed.tensor_template[tensor]]
        rows = np.nonzero((t.local_src == src_pos) & (t.local_dst == dst_pos))[0].tolist()
        return [
            Segment(
                tensor,
                tuple(t.local_offsets[j].tolist()),
                tuple(t.local_sizes[j].tolist()),
                int(t.local_sizes[j].prod()) * size,
                0,
            )
            for j in rows
        ]

    def _messages(
        self, by_key: dict[tuple[int, bool], list[_BoxEntry]], bucket: int | None = None
    ) -> tuple[Message, ...]:
        """Messages per (peer, relayed): relayed boxes never share a message with others, and
        received ones (`bucket` given) are keyed for forwarding in reception order."""
        messages: list[Message] = []
        keyed = 0
        for peer, relayed in sorted(by_key):
            small: list[_BoxEntry] = []
            large: list[_BoxEntry] = []
            for entry in by_key[(peer, relayed)]:
                (small if entry[3] < self.coalesce_bytes else large).append(entry)
            for message in ([_packed(peer, small)] if small else []) + [_packed(peer, [entry]) for entry in large]:
                if relayed and bucket is not None:
                    message, keyed = replace(message, relay=(bucket, keyed)), keyed + 1
                messages.append(message)
        return tuple(messages)


def relayed_buckets(entry_buckets: Sequence[RankBucket], chain: Sequence[int], k: int) -> list[RankBucket]:
    """The forwarding of place `k` of `chain`: what the entry worker received in bucket j (its
    keyed messages), received from `chain[k - 1]` in bucket j + k and sent to `chain[k + 1]`
    in bucket j + k + 1 (see `rl_sync.planning.relay`)."""
    out = []
    for bucket in entry_buckets:
        keyed = [m for m in bucket.recvs if m.relay is not None]
        if keyed and k > 0:
            out.append(RankBucket(bucket.index + k, (), tuple(replace(m, peer=chain[k - 1]) for m in keyed), ()))
        if keyed and k + 1 < len(chain):
            out.append(RankBucket(bucket.index + k + 1, tuple(replace(m, peer=chain[k + 1]) for m in keyed), (), ()))
    return out


def merge_buckets(*lists: Sequence[RankBucket]) -> tuple[RankBucket, ...]:
    """One bucket per index, holding every list's sends, receives and local copies of it (in the
    order of the lists), by increasing index."""
    merged: dict[int, RankBucket] = {}
    for bucket in (b for buckets in lists for b in buckets):
        have = merged.get(bucket.index)
        merged[bucket.index] = (
            bucket
            if have is None
            else RankBucket(
                bucket.index, have.sends + bucket.sends, have.recvs + bucket.recvs, have.local + bucket.local
            )
        )
    return tuple(merged[i] for i in sorted(merged))


def _interleaved_order(plan: ModelPlan) -> np.ndarray:
    """Tensors in schedule order: round-robin over groups that share both meshes.

    Expert tensors live on many small mesh pairs; taking the k-th tensor of every
    pair before the (k+1)-th keeps all of them busy in every bucket.
    """
    group_ids: dict[tuple, int] = {}
    seen: dict[int, int] = {}
    group = np.empty(len(plan), dtype=np.int64)
    turn = np.empty(len(plan), dtype=np.int64)
    for i, spec in enumerate(plan.specs):
        g = group_ids.setdefault((spec.src.mesh, spec.dst.mesh), len(group_ids))
        group[i], turn[i] = g, seen.get(g, 0)
        seen[g] = turn[i] + 1
    return np.lexsort((group, turn))


def cut_buckets(loads: tuple[np.ndarray, np.ndarray, np.ndarray], num_slabs: int, bucket_bytes: int) -> tuple[int, ...]:
    """Greedy cuts over slabs: a bucket ends before the slab that would put any
    rank over `bucket_bytes` (a slab over the bound alone gets its own bucket).

    `loads` is (slab, rank, bytes) entries. Vectorised over ranks: each bucket
    costs a few array operations, not a pass over its slabs.

    How: the entries are summed per (rank, slab) and sorted rank-major, so each
    rank's loads form one segment in slab order. `climb` is the running total of
    load inside each rank's segment, lifted by `rank * big` so that the whole
    array rises monotonically across segments and one `searchsorted` answers all
    ranks at once. For a bucket starting at slab `start`, `base` is each rank's
    climb just before its first slab >= `start`; the first entry whose climb
    exceeds `base + bucket_bytes` is where that rank overflows; the bucket ends
    at the earliest such slab over all ranks (or at the end).
    """
    slab, rank, load = loads
    if not len(slab):
        return (0, num_slabs) if num_slabs else (0,)
    keys = rank * num_slabs + slab
    order = np.argsort(keys, kind="stable")
    keys, load = keys[order], load[order]
    first = np.flatnonzero(np.diff(keys, prepend=-1))
    keys, load = keys[first], np.add.reduceat(load, first)
    rank, slab = keys // num_slabs, keys % num_slabs
    seg_start = np.flatnonzero(np.diff(rank, prepend=-1))
    ranks = rank[seg_start]
    seg_end = np.append(seg_start[1:], len(keys))
    big = int(load.sum()) + bucket_bytes + 1
    total = np.cumsum(load)
    within = total - np.repeat(total[seg_start] - load[seg_start], seg_end - seg_start)
    climb = within + rank * big
    cuts, start = [0], 0
    while start < num_slabs:
        pos = np.searchsorted(keys, ranks * num_slabs + start)
        base = np.where(pos > seg_start, climb[np.maximum(pos - 1, 0)], ranks * big)
        over = np.searchsorted(climb, base + bucket_bytes, side="right")
        # a first slab over the bound stays; the rank's next slab then ends the bucket
        over = np.where((over < seg_end) & (slab[np.minimum(over, len(slab) - 1)] == start), over + 1, over)
        ends = np.where(over < seg_end, slab[np.minimum(over, len(slab) - 1)], num_slabs)
        start = max(int(ends.min()), start + 1)  # every bucket takes a slab: at most num_slabs turns
        cuts.append(start)
    return tuple(cuts)


MAX_SLABS = 1 << 19
"""Bound on (tensor, row band) slabs, hence on buckets and on the work of cutting them (about
0.1 ms each on a 2-core machine): 524,288. A Kimi-K2-sized plan (256 to 128 ranks) has 69,917
with 256 MiB buckets and 484,733 with 16 MiB ones."""


def _check_slabs(slabs: int, bucket_bytes: int) -> None:
    if slabs > MAX_SLABS:
        raise ValueError(
            f"bucket_bytes={bucket_bytes} cuts this plan into {slabs} (tensor, row band) slabs, more "
            f"than the {MAX_SLABS} a schedule may hold; raise bucket_bytes"
        )


def _packed(peer: int, entries: list[_BoxEntry]) -> Message:
    segments, cursor = [], 0
    for tensor, offsets, sizes, nbytes in entries:
        cursor = -(-cursor // ALIGN) * ALIGN
        segments.append(Segment(tensor, offsets, sizes, nbytes, cursor))
        cursor += nbytes
    return Message(peer, cursor, tuple(segments))


def build_schedule(
    plan: ModelPlan, bucket_bytes: int = 256 << 20, coalesce_bytes: int = 1 << 20, relay: Relay = "off"
) -> Schedule:
    """Cut `plan` into buckets of at most `bucket_bytes` per rank (see module doc); `relay`:
    among engine replicas (`rl_sync.planning.relay`) never, always (refused when nothing can), or when
    `relay_pays` says it shortens the round. `Schedule.relay_choice` says what was chosen and why."""
    if relay not in get_args(Relay):
        raise ValueError(f"relay must be {either(get_args(Relay))}, got {relay!r}")
    if relay == "off":
        return Schedule(plan, bucket_bytes, coalesce_bytes)
    relayed = Schedule(plan, bucket_bytes, coalesce_bytes, relay=True)
    if relayed.relay is None:
        if relay == "on":
            raise ValueError(
                "relay='on' needs destination tensors replicated over two or more engine replicas "
                "(mesh dim 0 Replicate, one engine per index) and workers apart from the trainers; "
                "this plan has none"
            )
        return _chosen(
            Schedule(plan, bucket_bytes, coalesce_bytes), "direct: no tensor is replicated over engine replicas"
        )
    if relay == "on":  # the byte model's figures for the summary only: no direct schedule to weigh against
        _, why = relay_pays(plan, relayed.routed, relayed.relay, len(relayed.cuts) - 1)
        return _chosen(relayed, "relay: asked for (relay='on'); " + why)
    direct = Schedule(plan, bucket_bytes, coalesce_bytes)
    pays, why = relay_pays(plan, relayed.routed, relayed.relay, direct.num_buckets)
    return _chosen(relayed, "relay: " + why) if pays else _chosen(direct, "direct: " + why)


def _chosen(schedule: Schedule, why: str) -> Schedule:
    schedule.relay_choice = why
    return schedule
