"""Buckets encoded on the device (`sparse_cuda.place`, `sparse_fused.FusedSender` given `allow_dense`):
each box's encoding as `choose` picks it, the payloads laid out one after another bit for bit as
the torch codec writes them, baselines advanced, a bucket that does not fit its buffer left to the
host, and a sparse round through them."""

from __future__ import annotations

import time
import types

import pytest
import torch

from rl_sync.engine import sparse_codec, sparse_fused
from rl_sync.engine.endpoint import Endpoint
from rl_sync.engine.sparse_round import BucketViews, SparseCounters, SparseIO, run_sparse_bucket
from rl_sync.planning.schedule import Message, RankBucket, Segment
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, choose, payload_layout

from .test_sparse_triton import _bits, _pair

pytestmark = pytest.mark.usefixtures("cuda_kernels")


@pytest.fixture
def cuda_kernels(monkeypatch):
    pytest.importorskip("cupy")
    monkeypatch.setenv("RL_SYNC_SPARSE_KERNELS", "cuda")


def _meaningful(code: int, n: int, k: int, width: int, payload: torch.Tensor) -> list[torch.Tensor]:
    """The bytes of a payload a receiver reads (not the padding between its parts)."""
    at = payload_layout(code, n, k, width)
    if code == DENSE:
        return [payload[: n * width]]
    head = {BITMAP: -(-n // 32) * 4, BLOCKED: at.head, INDICES: 0}[code]  # (the bitmap in whole words)
    positions = {BITMAP: 0, BLOCKED: 2 * k, INDICES: 4 * k}[code]
    return [
        payload[:head],
        payload[at.positions : at.positions + positions],
        payload[at.values : at.values + width * k],
    ]


def _bucket(densities, dtype, rows=96, cols=4099, seed=0):
    """One (cur, baseline) pair a density, and the reference count and payload of each (torch codec)."""
    pairs, refs = [], []
    for i, density in enumerate(densities):
        cur, base = _pair(rows, cols, density, dtype, seed + i)
        changes = sparse_codec.Changes(cur.clone(), base.clone())
        pairs.append((cur, base))
        refs.append(changes)
    return pairs, refs


def _check(found, pairs, refs, allow_dense: bool):
    placed = found.placed
    assert placed is not None
    for i, ((cur, _), changes) in enumerate(zip(pairs, refs)):
        n, width, k = cur.numel(), cur.element_size(), changes.count
        code = choose(n, k, width, allow_dense)
        assert (found.counts[i], placed.codes[i]) == (k, code), i
        span = placed.span(i, i + 1)
        assert span.numel() == payload_layout(code, n, k, width).nbytes
        assert placed.header(i, i + 1).tolist() == [code, n if code == DENSE else k]  # (as a round sends it)
        ref = torch.zeros(span.numel(), dtype=torch.uint8, device=cur.device)
        sparse_codec.encode(code, changes, ref)
        for got, want in zip(_meaningful(code, n, k, width, span), _meaningful(code, n, k, width, ref)):
            assert torch.equal(got, want), (i, code)
    assert placed.span(0, len(pairs)).numel() == placed.total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.float64])
@pytest.mark.parametrize("allow_dense", [True, False])
def test_a_bucket_placed_on_the_device_matches_the_torch_codec(dtype, allow_dense):
    """Every encoding (no change: indices of nothing; 0.1% and 1%: indices or blocked; 10% and
    30%: bitmap; all: dense or bitmap), every density class, NaN payloads and -0.0, in one bucket
    of the same tensors, three rounds: a first round that outgrows its buffer is encoded by the
    host and sent again; the later ones queue the likeliest class first. Then the receiver
    writes each."""
    densities = [0, 0.001, 0.01, 0.1, 0.3, 1.0, 0.1]
    pairs, _ = _bucket(densities, dtype)
    curs, baselines = [cur.clone() for cur, _ in pairs], [base.clone() for _, base in pairs]
    boxes = [(i, (0, 0), tuple(cur.shape)) for i, cur in enumerate(curs)]
    for round_ in range(3):
        fresh, refs = _bucket(densities[round_:] + densities[:round_], dtype, seed=10 * round_)
        for attempt in range(2):
            for cur, baseline, (new, base) in zip(curs, baselines, fresh):
                cur.copy_(new)
                baseline.copy_(base)
            found = sparse_codec.BucketChanges(list(zip(curs, baselines)), boxes, allow_dense=allow_dense)
            if found.placed is not None:
                break
            assert attempt == 0, "a round that outgrew its buffer outgrew the next one too"
            found.finish()
        with pytest.raises(RuntimeError, match="box 0 of this bucket was encoded on the device already"):
            found.encode(0, BITMAP, found.placed.buffer)
        found.finish()
        _check(found, fresh, refs, allow_dense)
        assert all(torch.equal(_bits(b), _bits(cur)) for cur, b in zip(curs, baselines))
        received = sparse_codec.BucketReceiver(torch.device("cuda"), len(curs))
        lives = [base.clone() for _, base in fresh]
        for i, (cur, live) in enumerate(zip(curs, lives)):
            code, k, n = found.placed.codes[i], found.counts[i], cur.numel()
            received.add(i, code, n if code == DENSE else k, n, dtype, found.placed.span(i, i + 1), live)
        assert received.commit() == []
        assert all(torch.equal(_bits(live), _bits(cur)) for cur, live in zip(curs, lives))


def test_a_bucket_that_outgrows_its_buffer_is_encoded_by_the_host_and_the_next_round_fits():
    pairs, refs = _bucket([0.1, 0.1, 0.2], torch.bfloat16, seed=7)
    baselines = [base.clone() for _, base in pairs]
    work = [(cur, b) for (cur, _), b in zip(pairs, baselines)]
    boxes = [(i, (0, 0), tuple(cur.shape)) for i, (cur, _) in enumerate(pairs)]
    shared = sparse_codec.overlapping(boxes)
    geometry = sparse_fused.geometry(work, list(range(len(pairs))), shared)
    geometry.placed_bytes, geometry.likely = 1024, 1  # as if the last round had sent almost nothing
    codes = [choose(cur.numel(), c.count, 2, True) for (cur, _), c in zip(pairs, refs)]
    sizes = [payload_layout(code, cur.numel(), c.count, 2).nbytes for code, (cur, _), c in zip(codes, pairs, refs)]
    for round_ in range(2):
        for b, (_, base) in zip(baselines, pairs):
            b.copy_(base)
        found = sparse_codec.BucketChanges(work, boxes, allow_dense=True)
        assert sparse_fused.geometry(work, list(range(len(pairs))), shared) is geometry
        assert geometry.placed_bytes == sum(sizes)  # learned, fitting or not
        if round_ == 0:
            assert found.placed is None and found.counts == [c.count for c in refs]
            outs = [torch.zeros(size, dtype=torch.uint8, device="cuda") for size in sizes]
            for i, (code, out) in enumerate(zip(codes, outs)):
                found.encode(i, code, out)
            found.finish()
            for code, changes, out in zip(codes, refs, outs):
                ref = torch.zeros_like(out)
                sparse_codec.encode(code, changes, ref)
                assert torch.equal(out, ref)
        else:
            found.finish()
            _check(found, pairs, refs, True)
        assert all(torch.equal(_bits(b), _bits(cur)) for (cur, _), b in zip(pairs, baselines))


def test_boxes_sent_to_two_replicas_share_a_baseline_that_advances_once_sent():
    """Two boxes over the same tensor (a bucket sent to two replicas): `place` lays out both, and
    their baseline becomes the source only at `advance`."""
    cur, base = _pair(128, 4096, 0.05, torch.bfloat16, 3)
    baseline = base.clone()
    boxes = [(0, (0, 0), (128, 4096)), (0, (0, 0), (128, 4096))]
    found = sparse_codec.BucketChanges([(cur, baseline), (cur, baseline)], boxes, allow_dense=True)
    changes = sparse_codec.Changes(cur.clone(), base.clone())
    found.complete()
    torch.cuda.synchronize()
    assert torch.equal(_bits(baseline), _bits(base))  # (nothing advanced it yet)
    _check(found, [(cur, base)] * 2, [changes] * 2, True)
    found.advance()
    assert torch.equal(_bits(baseline), _bits(cur))


def test_a_bucket_of_two_dtypes_is_left_to_the_host():
    pairs, _ = _bucket([0.1], torch.bfloat16)
    other, _ = _bucket([0.1], torch.float32)
    work = pairs + other
    found = sparse_codec.BucketChanges(work, [(i, (0, 0), (96, 4099)) for i in range(2)], allow_dense=True)
    assert found.placed is None
    found.complete()


class _Loopback:
    """A rank's transport to peer 1 that is itself: each send arrives as the receive listed with it
    (a device copy), so one process runs both sides of a sparse round."""

    rank, world_size, device = 0, 2, torch.device("cuda")

    def post(self, sends, recvs, label=""):
        assert [peer for peer, _ in sends] == [peer for peer, _ in recvs]
        for (_, sent), (_, received) in zip(sends, recvs):
            received.copy_(sent)
        return types.SimpleNamespace(wait=lambda deadline: None)

    def complete(self, deadline):
        pass


def test_a_sparse_round_sends_the_payloads_its_gpu_placed():
    """`run_sparse_bucket` over a loopback, with the bucket's views kept from round to round as a
    session keeps them: two messages of three boxes, placed on the device and written into the
    live tensors bit for bit; a round that outgrows the buffer is encoded by the host, and the
    next one fits again; a fourth round of the first one's densities finds the receiver tables
    that round made (`sparse_codec.KeptTables`)."""
    rows, cols = 512, 1024
    names = ["a", "b", "c"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    curs = [torch.randn(rows, cols, generator=gen, device="cuda").to(torch.bfloat16) for _ in names]
    baselines, lives = [c.clone() for c in curs], [c.clone() for c in curs]  # (synced)
    half = rows // 2

    def segment(tensor, first, count):
        return Segment(tensor, (first, 0), (count, cols), count * cols * 2, 0)

    messages = (
        Message(1, 0, (segment(0, 0, rows), segment(1, 0, half))),
        Message(1, 0, (segment(1, half, half), segment(2, 0, rows))),
    )
    bucket = RankBucket(0, messages, messages, ())
    endpoint = lambda ts: {i: Endpoint(t, (0, 0)) for i, t in enumerate(ts)}  # noqa: E731
    io = SparseIO(endpoint(curs), endpoint(baselines), endpoint(lives), [torch.bfloat16] * 3, allow_dense=True)
    views = BucketViews.of(bucket, io)
    rounds = (((0.01, 0.1, 0.05), 1), ((1, 1, 1), 0), ((1, 0.5, 1), 1), ((0.01, 0.1, 0.05), 1))
    for round_, (densities, placed) in enumerate(rounds):
        for cur, density in zip(curs, densities):  # (about `density` of each source changed)
            change = torch.rand(rows, cols, generator=gen, device="cuda") < density
            cur.copy_(torch.where(change, (cur.float() * 1.25 + 1).to(torch.bfloat16), cur))
        counters, shapes = SparseCounters(), len(views.tables.tables)
        run_sparse_bucket(bucket, io, _Loopback(), time.monotonic() + 60, counters, names, views)
        torch.cuda.synchronize()
        assert counters.placed == placed, round_
        assert all(torch.equal(_bits(t), _bits(c)) for ts in (lives, baselines) for t, c in zip(ts, curs))
        assert round_ < 3 or len(views.tables.tables) == shapes  # (the first round's shape)
