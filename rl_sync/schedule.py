"""The schedule: a model plan cut into ordered buckets, each one grouped P2P launch.

A tensor whose transfers would put more than `bucket_bytes` on one rank is
cut into row bands (global dim 0), so every bucket stays near its bound. The
sequence of (tensor, band) pieces, in plan order, is then cut greedily into
buckets so that no rank sends plus receives more than `bucket_bytes` in one
bucket (a single piece larger than that gets a bucket of its own). The cut is
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

from collections.abc import Collection
from dataclasses import dataclass
from functools import cached_property
import numpy as np

from .bands import Band, band_count, make_bands
from .plan import ModelPlan

ALIGN = 16


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

    def __init__(self, plan: ModelPlan, bucket_bytes: int, coalesce_bytes: int, cuts: tuple[int, ...] | None = None):
        if bucket_bytes <= 0 or coalesce_bytes < 0:
            raise ValueError(
                f"bucket_bytes must be > 0 and coalesce_bytes >= 0, got {bucket_bytes} and {coalesce_bytes}"
            )
        self.plan = plan
        self.bucket_bytes = bucket_bytes
        self.coalesce_bytes = coalesce_bytes
        keys = list(zip(plan.tensor_template.tolist(), plan.itemsizes.tolist()))
        counts = {key: band_count(plan.templates[key[0]], key[1], bucket_bytes) for key in dict.fromkeys(keys)}
        _check_pieces(sum(counts[key] for key in keys), bucket_bytes)
        cache: dict[tuple[int, int], tuple[Band, ...]] = {}
        for key in counts:
            cache[key] = make_bands(plan.templates[key[0]], key[1], bucket_bytes)
        self.bands = [cache[key] for key in keys]
        self.order = _interleaved_order(plan)
        counts = np.array([len(b) for b in self.bands], dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(counts[self.order])])
        self.num_pieces = int(starts[-1])
        self.piece_start = np.empty(len(plan), dtype=np.int64)
        self.piece_start[self.order] = starts[:-1]
        self.cuts = tuple(cuts) if cuts is not None else cut_buckets(self._loads(), self.num_pieces, bucket_bytes)
        self._check_cuts()

    @property
    def num_buckets(self) -> int:
        return len(self.cuts) - 1

    @cached_property
    def pieces(self) -> list[tuple[int, int]]:
        """(tensor, band) of every piece, in schedule order."""
        return [(t, b) for t in self.order.tolist() for b in range(len(self.bands[t]))]

    def bucket_pieces(self, bucket: int) -> list[tuple[int, int]]:
        """(tensor, band) of every piece in `bucket`, in schedule order."""
        return self.pieces[self.cuts[bucket] : self.cuts[bucket + 1]]

    def _loads(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(piece, rank, bytes) of every rank's send + receive load in every piece."""
        pieces, ranks, loads = [], [], []
        for template, tensors in self.plan.groups():
            for size in np.unique(self.plan.itemsizes[tensors]).tolist():
                group = tensors[self.plan.itemsizes[tensors] == size]
                table = np.concatenate([self.plan.rank_table(group, "src"), self.plan.rank_table(group, "dst")], axis=1)
                for b, band in enumerate(self.bands[int(group[0])]):
                    load = np.concatenate([band.send_numel, band.recv_numel]) * size
                    keep = load > 0
                    pieces.append(np.repeat(self.piece_start[group] + b, int(keep.sum())))
                    ranks.append(table[:, keep].ravel())
                    loads.append(np.broadcast_to(load[keep], (len(group), int(keep.sum()))).ravel())
        if not pieces:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(pieces), np.concatenate(ranks), np.concatenate(loads)

    def _check_cuts(self) -> None:
        cuts = self.cuts
        if not cuts or cuts[0] != 0 or cuts[-1] != self.num_pieces or any(b <= a for a, b in zip(cuts, cuts[1:])):
            raise ValueError(
                f"bucket cuts must rise strictly from 0 to the piece count {self.num_pieces}, got {cuts[:8]}..."
            )

    def rank_slice(self, rank: int, tensors: Collection[int] | None = None) -> RankSchedule:
        """This rank's buckets; `tensors` restricts a round to a subset (same on every rank)."""
        chosen = range(len(self.plan)) if tensors is None else sorted(set(tensors))
        entries = []
        for tensor in chosen:
            spec = self.plan.specs[tensor]
            src_pos, dst_pos = spec.src.mesh.index_of(rank), spec.dst.mesh.index_of(rank)
            if src_pos is not None or dst_pos is not None:
                first = int(self.piece_start[tensor])
                entries.extend((first + b, tensor, b, src_pos, dst_pos) for b in range(len(self.bands[tensor])))
        entries.sort()
        bucket_of = np.searchsorted(self.cuts, [e[0] for e in entries], side="right") - 1
        by_bucket: dict[int, list] = {}
        for bucket, entry in zip(bucket_of.tolist(), entries):
            by_bucket.setdefault(bucket, []).append(entry)
        buckets = (self._rank_bucket(index, pieces) for index, pieces in sorted(by_bucket.items()))
        return RankSchedule(rank, tuple(b for b in buckets if b.sends or b.recvs or b.local))

    def _rank_bucket(self, index: int, pieces: list) -> RankBucket:
        sends: dict[int, list] = {}
        recvs: dict[int, list] = {}
        local: list[Segment] = []
        for _, tensor, band_index, src_pos, dst_pos in pieces:
            spec, size = self.plan.specs[tensor], int(self.plan.itemsizes[tensor])
            band = self.bands[tensor][band_index]
            for side, pos, peers, out in (("src", src_pos, spec.dst.mesh, sends), ("dst", dst_pos, spec.src.mesh, recvs)):
                if pos is not None:
                    for peer, offsets, sizes, numel in band.rows(side, pos):
                        out.setdefault(peers.ranks[peer], []).append((tensor, offsets, sizes, numel * size))
            if band_index == 0 and src_pos is not None and dst_pos is not None:
                local.extend(self._local_segments(tensor, src_pos, dst_pos, size))
        return RankBucket(index, self._messages(sends), self._messages(recvs), tuple(local))

    def _local_segments(self, tensor: int, src_pos: int, dst_pos: int, size: int) -> list[Segment]:
        t = self.plan.templates[self.plan.tensor_template[tensor]]
        rows = np.nonzero((t.local_src == src_pos) & (t.local_dst == dst_pos))[0].tolist()
        return [
            Segment(tensor, tuple(t.local_offsets[j].tolist()), tuple(t.local_sizes[j].tolist()),
                    int(t.local_sizes[j].prod()) * size, 0)
            for j in rows
        ]

    def _messages(self, by_peer: dict[int, list]) -> tuple[Message, ...]:
        messages = []
        for peer in sorted(by_peer):
            small, large = [], []
            for entry in by_peer[peer]:
                (small if entry[3] < self.coalesce_bytes else large).append(entry)
            if small:
                messages.append(_packed(peer, small))
            messages.extend(_packed(peer, [entry]) for entry in large)
        return tuple(messages)


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


def cut_buckets(loads: tuple[np.ndarray, np.ndarray, np.ndarray], num_pieces: int, bucket_bytes: int) -> tuple[int, ...]:
    """Greedy cuts over pieces: a bucket ends before the piece that would put any
    rank over `bucket_bytes` (a piece over the bound alone gets its own bucket).

    `loads` is (piece, rank, bytes) entries. Vectorised over ranks: each bucket
    costs a few array operations, not a pass over its pieces.
    """
    piece, rank, load = loads
    if not len(piece):
        return (0, num_pieces) if num_pieces else (0,)
    keys = rank * num_pieces + piece
    order = np.argsort(keys, kind="stable")
    keys, load = keys[order], load[order]
    first = np.flatnonzero(np.diff(keys, prepend=-1))
    keys, load = keys[first], np.add.reduceat(load, first)
    rank, piece = keys // num_pieces, keys % num_pieces
    seg_start = np.flatnonzero(np.diff(rank, prepend=-1))
    ranks = rank[seg_start]
    seg_end = np.append(seg_start[1:], len(keys))
    big = int(load.sum()) + bucket_bytes + 1
    total = np.cumsum(load)
    within = total - np.repeat(total[seg_start] - load[seg_start], seg_end - seg_start)
    climb = within + rank * big
    cuts, start = [0], 0
    while start < num_pieces:
        pos = np.searchsorted(keys, ranks * num_pieces + start)
        base = np.where(pos > seg_start, climb[np.maximum(pos - 1, 0)], ranks * big)
        over = np.searchsorted(climb, base + bucket_bytes, side="right")
        # a first piece over the bound stays; the rank's next piece then ends the bucket
        over = np.where((over < seg_end) & (piece[np.minimum(over, len(piece) - 1)] == start), over + 1, over)
        ends = np.where(over < seg_end, piece[np.minimum(over, len(piece) - 1)], num_pieces)
        start = max(int(ends.min()), start + 1)  # every bucket takes a piece: at most num_pieces turns
        cuts.append(start)
    return tuple(cuts)


MAX_PIECES = 1 << 19
"""Bound on (tensor, row band) pieces, hence on buckets and on the work of cutting them (about
0.1 ms each on a 2-core machine): 524,288. A Kimi-K2-sized plan (256 to 128 ranks) has 69,917
with 256 MiB buckets and 484,733 with 16 MiB ones."""


def _check_pieces(pieces: int, bucket_bytes: int) -> None:
    if pieces > MAX_PIECES:
        raise ValueError(f"bucket_bytes={bucket_bytes} cuts this plan into {pieces} (tensor, row band) pieces, more "
                         f"than the {MAX_PIECES} a schedule may hold; raise bucket_bytes")


def _packed(peer: int, entries: list) -> Message:
    segments, cursor = [], 0
    for tensor, offsets, sizes, nbytes in entries:
        cursor = -(-cursor // ALIGN) * ALIGN
        segments.append(Segment(tensor, offsets, sizes, nbytes, cursor))
        cursor += nbytes
    return Message(peer, cursor, tuple(segments))


def build_schedule(plan: ModelPlan, bucket_bytes: int = 256 << 20, coalesce_bytes: int = 1 << 20) -> Schedule:
    """Cut `plan` into buckets of at most `bucket_bytes` per rank (see module doc)."""
    return Schedule(plan, bucket_bytes, coalesce_bytes)
