"""Sparse encodings and the codec: exact round trips, bit-exact change detection, strict validation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.engine import sparse_codec
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, check_count, choose, encoded_nbytes


def _round_trip(code: int, cur: torch.Tensor, base: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    changes = sparse_codec.Changes(cur, base)
    k = changes.count
    block = torch.zeros(encoded_nbytes(code, cur.numel(), k, cur.element_size()), dtype=torch.uint8)
    sparse_codec.encode(code, changes, block)
    index, values, ok = sparse_codec.decode(code, k, cur.numel(), cur.dtype, block)
    assert bool(ok)
    sparse_codec.apply(code, live, index, values)
    return live


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 9),
    density=st.floats(0, 1),
    code=st.sampled_from([INDICES, BITMAP, DENSE, BLOCKED]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.float16]),
    strided=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_every_encoding_round_trips_into_strided_live_views(rows, cols, density, code, dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(rows, cols, generator=gen) * 10).to(dtype)
    change = torch.rand(rows, cols, generator=gen) < density
    cur = torch.where(change, (torch.randn(rows, cols, generator=gen) * 10).to(dtype), base)
    holder = torch.zeros(cols + 3, rows, dtype=dtype)
    live = holder[1 : cols + 1].t() if strided else torch.zeros(rows, cols, dtype=dtype)
    live.copy_(base)
    out = _round_trip(code, cur, base, live)
    dense = torch.contiguous_format
    assert torch.equal(
        out.clone(memory_format=dense).view(torch.uint8), cur.clone(memory_format=dense).view(torch.uint8)
    )
    if strided:
        assert (holder[0] == 0).all() and (holder[cols + 1 :] == 0).all()


def test_changes_are_found_by_bit_pattern():
    base = torch.tensor([0.0, float("nan"), 1.0, -0.0], dtype=torch.bfloat16)
    cur = torch.tensor([-0.0, float("nan"), 1.0, 0.0], dtype=torch.bfloat16)
    cur.view(torch.int16)[1] = base.view(torch.int16)[1] ^ 1  # another NaN payload
    assert sparse_codec.changed(cur, base).tolist() == [True, True, False, True]
    assert sparse_codec.changed(base.clone(), base).tolist() == [False, False, False, False]


def test_choice_follows_density():
    n, size = 1_000_000, 2
    assert choose(n, 10, size, allow_dense=True) == INDICES
    assert choose(n, 10_000, size, allow_dense=True) == BLOCKED
    assert choose(n, 200_000, size, allow_dense=True) == BITMAP
    assert choose(n, 990_000, size, allow_dense=True) == DENSE
    assert choose(n, 990_000, size, allow_dense=False) == BITMAP
    assert encoded_nbytes(BLOCKED, n, n // 100, size) <= 0.021 * n * size


def test_blocked_round_trip_across_many_blocks():
    n = 3 * (1 << 16) + 5
    base = torch.zeros(n, dtype=torch.bfloat16)
    cur = base.clone()
    cur[[0, 1, 65535, 65536, 140000, n - 1]] = 1.0
    out = _round_trip(BLOCKED, cur, base, base.clone())
    assert torch.equal(out.view(torch.int16), cur.view(torch.int16))


def test_blocked_counts_are_checked():
    n, k = 70_000, 2
    block = _block(BLOCKED, n, k)
    block[:8].view(torch.int32).copy_(torch.tensor([3, -1], dtype=torch.int32))
    assert not bool(sparse_codec.decode(BLOCKED, k, n, torch.float32, block)[2])


def _block(code, n, k, dtype=torch.float32):
    return torch.zeros(encoded_nbytes(code, n, k, torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8)


@pytest.mark.parametrize("indices", [[0, 5, 3], [1, 1, 2], [0, 2, 8], [-1, 0, 1]])
def test_bad_indices_are_caught_before_writing(indices):
    block = _block(INDICES, 8, 3)
    block[:12].view(torch.int32).copy_(torch.tensor(indices, dtype=torch.int32))
    _, _, ok = sparse_codec.decode(INDICES, 3, 8, torch.float32, block)
    assert not bool(ok)


@pytest.mark.parametrize("slot", [-1, 2])
def test_a_box_slot_outside_the_bucket_is_refused(slot):
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 2)
    with pytest.raises(IndexError, match=rf"^box slot {slot} is outside this bucket's 2 boxes$"):
        received.add(slot, INDICES, 3, 8, torch.float32, _block(INDICES, 8, 3), torch.zeros(8))
    assert received.commit() == []


def test_bitmap_count_and_padding_are_checked():
    block = _block(BITMAP, 10, 2)
    block[0] = 0b00000111
    assert not bool(sparse_codec.decode(BITMAP, 2, 10, torch.float32, block)[2])
    block = _block(BITMAP, 10, 3)
    block[0], block[1] = 0b00000011, 0b00001000  # bit 11 is past n = 10
    assert not bool(sparse_codec.decode(BITMAP, 3, 10, torch.float32, block)[2])


def test_payload_size_must_match_its_header():
    with pytest.raises(ValueError, match=r"payload of 8 bytes, header implies 32"):
        sparse_codec.decode(INDICES, 3, 8, torch.float32, torch.zeros(8, dtype=torch.uint8))


def test_a_payload_not_16_byte_aligned_is_refused_on_both_sides():
    """Every encoded transfer starts 16-byte aligned; a buffer that does not is refused before
    anything is encoded, validated or written (the fused kernels address parts from it)."""
    cur, base = torch.zeros(1000, dtype=torch.bfloat16), torch.zeros(1000, dtype=torch.bfloat16)
    cur[::10] = 1.0
    nbytes = encoded_nbytes(BITMAP, 1000, 100, 2)
    buffer = torch.zeros(nbytes + 16, dtype=torch.uint8)
    found = sparse_codec.BucketChanges([(cur, base.clone())], [(0, (0,), (1000,))])
    with pytest.raises(ValueError, match=r"payload buffer at address 0x[0-9a-f]+ is not 16-byte aligned"):
        found.encode(0, BITMAP, buffer[1 : 1 + nbytes])
    found.encode(0, BITMAP, buffer[16:])
    found.finish()
    live = base.clone()
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 1)
    shifted = torch.zeros(nbytes + 16, dtype=torch.uint8)
    shifted[8 : 8 + nbytes] = buffer[16:]
    with pytest.raises(ValueError, match=r"is not 16-byte aligned"):
        received.add(0, BITMAP, 100, 1000, torch.bfloat16, shifted[8 : 8 + nbytes], live)
    assert torch.equal(live, base)


@pytest.mark.parametrize(
    "code, k, n, message",
    [
        (7, 1, 4, "encoding code 7 is not 0, 1, 2 or 3"),
        (INDICES, 5, 4, "indices header claims 5 changed of 4 elements"),
        (DENSE, 2, 4, "dense header claims 2 changed of 4 elements"),
        (BITMAP, -1, 4, "bitmap header claims -1 changed of 4 elements"),
    ],
)
def test_headers_are_bounded_by_the_plan(code, k, n, message):
    with pytest.raises(ValueError, match=message):
        check_count(code, k, n, "segment")


def test_a_bucket_diffs_overlapping_boxes_against_the_baseline_it_started_with():
    """A box sent to two replicas and an overlapping box, through `BucketChanges` and
    `BucketReceiver`: each payload equals the per-box codec's against the old baseline, the
    baseline of what was sent ends equal to the source, and the receivers end with the source's values."""
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(64, 300, generator=gen).to(torch.bfloat16)
    cur = torch.where(torch.rand(64, 300, generator=gen) < 0.05, base + 1, base)
    baseline = base.clone()
    rows = [(0, 32), (0, 32), (16, 48)]
    codes = [BLOCKED, BITMAP, INDICES]
    found = sparse_codec.BucketChanges(
        [(cur[a:b], baseline[a:b]) for a, b in rows], [(0, (a, 0), (b - a, 300)) for a, b in rows]
    )
    payloads = []
    for i, ((a, b), code) in enumerate(zip(rows, codes)):
        changes = sparse_codec.Changes(cur[a:b], base[a:b])
        assert found.counts[i] == changes.count
        payloads.append(torch.zeros(encoded_nbytes(code, cur[a:b].numel(), changes.count, 2), dtype=torch.uint8))
        found.encode(i, code, payloads[-1])
        reference = torch.zeros_like(payloads[-1])
        sparse_codec.encode(code, changes, reference)
        assert torch.equal(payloads[-1], reference)
    found.finish()
    assert torch.equal(baseline[:48].view(torch.int16), cur[:48].view(torch.int16))
    assert torch.equal(baseline[48:].view(torch.int16), base[48:].view(torch.int16))
    live = base.clone()
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 3)
    for slot, ((a, b), code, payload) in enumerate(zip(rows, codes, payloads)):
        received.add(slot, code, found.counts[slot], cur[a:b].numel(), torch.bfloat16, payload, live[a:b])
    assert received.commit() == []
    assert torch.equal(live[:48].view(torch.int16), cur[:48].view(torch.int16))


def test_the_payload_exchange_completes_while_and_even_when_the_receiver_is_prepared():
    """A sparse round prepares its receiver between posting the payload exchange and waiting on it;
    when preparing fails, the exchange still completes (no peer waits on this rank) and the error
    comes out."""
    from rl_sync.engine import sparse_round

    steps = []

    class Transport:
        def post(self, sends, recvs, label=""):
            steps.append("post")
            pending = type("Pending", (), {"wait": lambda self, deadline: steps.append("wait")})
            return pending()

        def complete(self, deadline):
            steps.append("complete")

    buf = torch.zeros(4, dtype=torch.uint8)
    got = sparse_round._exchange(
        Transport(), [(1, buf)], [(1, buf)], 0.0, "bucket 0", lambda: steps.append("prepare") or 7
    )
    assert got == 7 and steps == ["post", "prepare", "wait", "complete"]
    steps.clear()

    def refuse():
        steps.append("prepare")
        raise ValueError("not aligned")

    with pytest.raises(ValueError, match="not aligned"):
        sparse_round._exchange(Transport(), [(1, buf)], [(1, buf)], 0.0, "bucket 0", refuse)
    assert steps == ["post", "prepare", "wait", "complete"]


def test_a_clean_receiver_gives_its_zeroed_flags_to_the_next_one_of_its_size(monkeypatch):
    """A commit that wrote every box gives its flag buffer, all zero again, to the next receiver of
    as many boxes on the device (once: a later commit returns the first answer and reads nothing);
    a commit that named a malformed box keeps its raised flags away from later receivers, which
    start from zeros."""
    from collections import OrderedDict

    monkeypatch.setattr(sparse_codec, "_SPARE_FLAGS", OrderedDict())
    cpu = torch.device("cpu")
    cur, base = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    good = _block(BITMAP, 10, 9)
    sparse_codec.encode(BITMAP, sparse_codec.Changes(cur, base), good)
    bad = good.clone()
    bad[0] ^= 0b10  # one mark fewer than k

    def receiver(block: torch.Tensor, boxes: int = 1) -> sparse_codec.BucketReceiver:
        received = sparse_codec.BucketReceiver(cpu, boxes)
        received.add(0, BITMAP, 9, 10, torch.float32, block, torch.zeros(10))
        return received

    first = receiver(good)
    assert first.commit() == [] and first.commit() == []
    second, other_size, third = receiver(good), receiver(good, boxes=2), receiver(good)
    assert second.flags is first.flags and other_size.flags is not first.flags and third.flags is not first.flags
    assert second.commit() == [] and third.commit() == []
    failed = receiver(bad)
    assert any(failed.flags is spare for spare in (first.flags, third.flags))  # (a spare, all zero)
    assert failed.commit() == [0] and failed.flags.any()
    after = [receiver(good) for _ in range(2)]
    assert all(r.flags is not failed.flags and not r.flags.any() for r in after)
    lender = receiver(good, boxes=2)  # (its slot 1 left empty)
    assert lender.commit() == []
    borrower = receiver(good, boxes=2)
    borrower.add(1, BITMAP, 9, 10, torch.float32, bad, torch.zeros(10))
    assert borrower.flags is lender.flags and borrower.commit() == [1]
    assert lender.commit() == []  # answered once: the buffer it gave away, flag 1 raised, is not read


def test_a_message_layout_places_each_box_after_the_one_before_and_checks_every_header():
    """`message_layout` gives each box the layout and start a box-by-box sum of `payload_layout`
    gives, for every encoding and width; a header of the wrong length, or one whose count cannot
    describe its box, is refused, naming the message and the segment."""
    from rl_sync.sparse.encodings import message_layout, payload_layout

    ns, sizes = [1000, 70_000, 5, 3000, 1], [2, 1, 8, 4, 2]
    header = [BITMAP, 100, BLOCKED, 900, INDICES, 2, DENSE, 3000, INDICES, 0]
    layout = message_layout(header, ns, sizes, "message from rank 3")
    start = 0
    for i, (code, k, n, at, first) in enumerate(layout.boxes):
        assert (code, k, n, first) == (header[2 * i], header[2 * i + 1], ns[i], start)
        assert at == payload_layout(code, n, k, sizes[i]) and first % 16 == 0
        start += at.nbytes
    assert layout.nbytes == start
    with pytest.raises(ValueError, match=r"^message from rank 3, segment 3: dense header claims 2999 changed of 3000"):
        message_layout(header[:7] + [2999] + header[8:], ns, sizes, "message from rank 3")
    with pytest.raises(ValueError, match=r"^m: a header of 9 values and 5 element sizes for 5 boxes; expected 10"):
        message_layout(header[:9], ns, sizes, "m")


def test_a_message_of_every_encoding_is_written_bit_exactly_and_a_bad_one_adds_nothing():
    """`BucketReceiver.add_message`: the boxes of one message, each encoding, one of them strided,
    in slots after a box added alone, are written bit-exactly from the one payload; a payload of
    the wrong size, slots past the bucket or added before are refused, naming them, and leave the
    receiver as it was."""
    from rl_sync.sparse.encodings import message_layout

    gen = torch.Generator().manual_seed(11)
    base = torch.randn(6, 500, generator=gen).to(torch.bfloat16)
    cur = torch.where(torch.rand(6, 500, generator=gen) < 0.1, base + 1, base)
    codes = [BLOCKED, BITMAP, INDICES, DENSE]
    views = [
        (slice(0, 1), slice(None)),
        (slice(1, 3), slice(None)),
        (slice(3, 6), slice(0, 250)),
        (slice(3, 6), slice(250, None)),
    ]
    header, parts = [], []
    for code, at in zip(codes, views):
        changes = sparse_codec.Changes(cur[at], base[at])
        n = cur[at].numel()
        parts.append(torch.zeros(encoded_nbytes(code, n, changes.count, 2), dtype=torch.uint8))
        sparse_codec.encode(code, changes, parts[-1])
        header += [code, n if code == DENSE else changes.count]
    layout = message_layout(header, [cur[at].numel() for at in views], [2] * 4, "m")
    payload = torch.cat(parts)
    live = base.clone()
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 5)
    lone = torch.zeros(8)
    received.add(0, INDICES, 0, 8, torch.float32, _block(INDICES, 8, 0), lone)
    args = ([torch.bfloat16] * 4, payload, [live[at] for at in views])
    with pytest.raises(
        ValueError, match=rf"^payload of {payload.numel() - 16} bytes, header implies {payload.numel()}$"
    ):
        received.add_message(1, layout, [torch.bfloat16] * 4, payload[:-16], args[2])
    sizes = r"^the layout was made for element sizes \[2, 2, 2, 2\]; the dtypes have \[4, 2, 2, 2\]$"
    with pytest.raises(ValueError, match=sizes):
        received.add_message(1, layout, [torch.float32] + [torch.bfloat16] * 3, payload, args[2])
    with pytest.raises(IndexError, match=r"^box slot 5 is outside this bucket's 5 boxes$"):
        received.add_message(2, layout, *args)
    with pytest.raises(ValueError, match=r"^box slot 0 was added twice to this bucket's receiver$"):
        received.add_message(0, layout, *args)
    received.add_message(1, layout, *args)
    assert received.commit() == []
    assert torch.equal(live.view(torch.int16), cur.view(torch.int16)) and not lone.any()


def test_a_bucket_s_views_built_once_serve_every_later_round_bit_exactly():
    """`BucketViews` of a bucket, built on its first round and passed to the rounds after (as the
    session keeps them): each round's changes, found in fp32 sources cast to the bf16 wire as they
    are that round, reach the live tensors and the baselines bit for bit, over a loopback on CPU,
    two messages of two boxes each, one of them a strided box, and a box copied locally."""
    import time
    import types

    from rl_sync.engine.endpoint import Endpoint
    from rl_sync.engine.sparse_round import BucketViews, SparseCounters, SparseIO, run_sparse_bucket
    from rl_sync.planning.schedule import Message, RankBucket, Segment

    class Loopback:  # each send arrives as the receive listed with it
        rank, world_size, device = 0, 2, torch.device("cpu")

        def post(self, sends, recvs, label=""):
            for (_, sent), (_, received) in zip(sends, recvs):
                received.copy_(sent)
            return types.SimpleNamespace(wait=lambda deadline: None)

        def complete(self, deadline):
            pass

    gen = torch.Generator().manual_seed(3)
    sources = [torch.randn(64, 48, generator=gen) for _ in range(3)]
    baselines = [s.to(torch.bfloat16) for s in sources]
    lives = [b.clone() for b in baselines]
    segment = lambda t, at, sizes: Segment(t, at, sizes, sizes[0] * sizes[1] * 2, 0)  # noqa: E731
    messages = (
        Message(1, 0, (segment(0, (0, 0), (32, 48)), segment(1, (0, 0), (64, 20)))),
        Message(1, 0, (segment(0, (32, 0), (32, 48)), segment(1, (0, 20), (64, 28)))),
    )
    bucket = RankBucket(0, messages, messages, (segment(2, (0, 0), (64, 48)),))
    endpoints = lambda ts: {i: Endpoint(t, (0, 0)) for i, t in enumerate(ts)}  # noqa: E731
    io = SparseIO(endpoints(sources), endpoints(baselines), endpoints(lives), [torch.bfloat16] * 3, allow_dense=True)
    views = BucketViews.of(bucket, io)
    for density in (0.01, 0.2, 1.0):
        for s in sources:
            s.add_(torch.where(torch.rand(s.shape, generator=gen) < density, 1.0, 0.0))
        run_sparse_bucket(bucket, io, Loopback(), time.monotonic() + 30, SparseCounters(), ["a", "b", "c"], views)
        for s, live, base in zip(sources, lives, baselines):
            wire = s.to(torch.bfloat16).view(torch.int16)
            assert torch.equal(live.view(torch.int16), wire) and torch.equal(base.view(torch.int16), wire), density


def test_a_session_keeps_sparse_views_only_while_its_endpoints_and_baselines_are_the_same_objects():
    """`RankSession._sparse_kept`: a subset's endpoints by index and its buckets' views are kept
    round after round while the endpoint mappings and the baselines are the same objects; new
    mappings (a rank binds anew when a weight moves) or new baselines start afresh."""
    import types

    from rl_sync.engine.session import RankSession

    walked = []
    session = types.SimpleNamespace(
        _sparse={},
        baselines={},
        _indices=lambda endpoints, side: walked.append(side) or {0: endpoints},
        _slice=lambda wanted: types.SimpleNamespace(buckets=["b0", "b1"]),
        _reached={},
    )
    session._key = lambda wanted, dests: RankSession._key(session, wanted, dests)
    sources, dests = {"w": 1}, {"w": 2}
    kept = RankSession._sparse_kept(session, None, sources, dests)
    assert kept.views == [None, None] and kept.src == {0: sources} and walked == ["source", "destination"]
    kept.views[0] = "views of b0"
    assert RankSession._sparse_kept(session, None, sources, dests) is kept and len(walked) == 2
    moved = RankSession._sparse_kept(session, None, dict(sources), dests)
    assert moved is not kept and moved.views == [None, None] and len(walked) == 4
    session.baselines = {}
    assert RankSession._sparse_kept(session, None, moved.sources, dests) is not moved
