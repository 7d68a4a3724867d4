"""The fused CUDA sparse codec (`engine.sparse_triton` through `sparse_codec.BucketChanges` and
`sparse_codec.BucketReceiver`) against the torch reference: the same payload bytes, the same baselines
and live weights bit for bit, and malformed payloads refused before any write."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_sync.engine import sparse_codec, sparse_cuda
from rl_sync.engine.sparse_table import density as density_class
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, encoded_nbytes

pytestmark = pytest.mark.usefixtures("sparse_kernels")  # each test with the busy launches in CUDA, then Triton
CODES = [INDICES, BLOCKED, BITMAP, DENSE]
DTYPES = [torch.bfloat16, torch.float32, torch.uint8, torch.float64]


def _reference(code: int, cur: torch.Tensor, base: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Count and payload from the torch codec, on copies."""
    changes = sparse_codec.Changes(cur.clone(), base.clone())
    out = torch.zeros(
        encoded_nbytes(code, cur.numel(), changes.count, cur.element_size()), dtype=torch.uint8, device=cur.device
    )
    sparse_codec.encode(code, changes, out)
    return changes.count, out


def _strided(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A copy of 2-D `t` living as a transposed slice of a larger zeroed holder: (view, holder)."""
    holder = torch.zeros(t.shape[1] + 3, t.shape[0], dtype=t.dtype, device=t.device)
    view = holder[1 : t.shape[1] + 1].t()
    view.copy_(t)
    return view, holder


def _pair(rows: int, cols: int, density: float, dtype: torch.dtype, seed: int, device: str = "cuda"):
    gen = torch.Generator(device=device).manual_seed(seed)
    base = (torch.randn(rows, cols, generator=gen, device=device) * 10).to(dtype)
    change = torch.rand(rows, cols, generator=gen, device=device) < density
    cur = torch.where(change, (torch.randn(rows, cols, generator=gen, device=device) * 10).to(dtype), base)
    if dtype == torch.bfloat16 and cur.numel() >= 3:
        flat_c, flat_b = cur.view(-1), base.view(-1)
        flat_c[0], flat_b[0] = float("nan"), float("nan")
        flat_c.view(torch.int16)[0] ^= 1  # another NaN payload: changed
        flat_c[1], flat_b[1] = -0.0, 0.0  # changed
        flat_c[2], flat_b[2] = -0.0, -0.0  # not changed
    return cur, base


def _receive(code: int, k: int, n: int, dtype: torch.dtype, payload: torch.Tensor, live: torch.Tensor) -> bool:
    """Validate one box of `k` changes (its header's count: `n` when dense, as a round sends it) and,
    when valid, write it; whether it was valid."""
    received = sparse_codec.BucketReceiver(live.device, 1)
    received.add(0, code, n if code == DENSE else k, n, dtype, payload, live)
    return not received.commit()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.integers(1, 300),
    cols=st.sampled_from([1, 7, 4096, 70_001]),
    density=st.sampled_from([0, 0.001, 0.01, 0.03, 0.04, 0.1, 0.5, 1]),  # 3%: sparse launch, busy words; 4%: busy
    code=st.sampled_from(CODES),
    dtype=st.sampled_from(DTYPES),
    strided_src=st.booleans(),
    strided_dst=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_fused_codec_matches_the_reference_bit_for_bit(
    rows, cols, density, code, dtype, strided_src, strided_dst, seed
):
    rows = min(rows, max(1, 600_000 // cols))
    cur, base = _pair(rows, cols, density, dtype, seed)
    k_ref, payload_ref = _reference(code, cur, base)
    src, baseline = (_strided(cur)[0], _strided(base)[0]) if strided_src else (cur.clone(), base.clone())
    found = sparse_codec.BucketChanges([(src, baseline)], [(0, (0, 0), (rows, cols))])
    assert found.counts == [k_ref]
    payload = torch.zeros_like(payload_ref)
    found.encode(0, code, payload)
    found.finish()
    assert torch.equal(payload, payload_ref)
    assert torch.equal(_bits(baseline), _bits(cur))
    live, holder = _strided(base) if strided_dst else (base.clone(), None)
    assert _receive(code, k_ref, cur.numel(), dtype, payload, live)
    assert torch.equal(_bits(live), _bits(cur))
    if holder is not None:  # nothing outside the view was touched
        assert torch.count_nonzero(holder[0]) == 0 and torch.count_nonzero(holder[cols + 1 :]) == 0


def test_a_bucket_of_overlapping_boxes_diffs_each_against_the_old_baseline():
    """A box sent to two replicas and an overlapping box: every payload is what the reference
    encodes against the baseline before the bucket, and the baseline ends equal to the source."""
    cur, base = _pair(64, 5000, 0.05, torch.bfloat16, 3)
    baseline = base.clone()
    boxes = [(0, (0, 0), (32, 5000)), (0, (0, 0), (32, 5000)), (0, (16, 0), (32, 5000)), (0, (48, 0), (16, 5000))]
    views = [(cur[o[0] : o[0] + s[0]], baseline[o[0] : o[0] + s[0]]) for _, o, s in boxes]
    refs = [_reference(code, c, b) for code, (c, b) in zip([BLOCKED, BITMAP, INDICES, DENSE], views)]
    found = sparse_codec.BucketChanges(views, boxes)
    assert found.counts == [k for k, _ in refs]
    payloads = [torch.zeros_like(ref) for _, ref in refs]
    for i, (code, payload) in enumerate(zip([BLOCKED, BITMAP, INDICES, DENSE], payloads)):
        found.encode(i, code, payload)
    found.finish()
    assert all(torch.equal(payload, ref) for payload, (_, ref) in zip(payloads, refs))
    assert torch.equal(_bits(baseline), _bits(cur))


def test_rounds_on_the_same_tensors_reuse_the_bucket_geometry_and_stay_bit_exact():
    """Four rounds over one bucket of the same live tensors, each at another density (the sparse
    and the busy launches, the second round on reusing the first's geometry): every payload is
    the reference's, and the baselines and live copies end equal to the sources. Each receiver
    after the first takes the flag buffer the one before gave back, every value zero again (the
    CUDA `starts` zeroes the counters it counted with)."""
    rows, cols = 32, 20_000
    sources = [_pair(rows, cols, 0.0, torch.bfloat16, seed)[0] for seed in range(3)]
    baselines = [s.clone() for s in sources]
    lives = [s.clone() for s in sources]
    boxes = [(i, (0, 0), (rows, cols)) for i in range(3)]
    gen = torch.Generator(device="cuda").manual_seed(5)
    given_back = None
    for density in (0.01, 0.1, 0.001, 0.03):
        for s in sources:
            change = torch.rand(rows, cols, generator=gen, device="cuda") < density
            s[change] = (s[change].float() + 1.0).to(torch.bfloat16)
        codes = [BLOCKED, BITMAP, INDICES]
        refs = [_reference(code, s, b) for code, s, b in zip(codes, sources, baselines)]
        found = sparse_codec.BucketChanges(list(zip(sources, baselines)), boxes)
        assert found.counts == [k for k, _ in refs]
        payloads = [torch.zeros_like(ref) for _, ref in refs]
        for i, (code, payload) in enumerate(zip(codes, payloads)):
            found.encode(i, code, payload)
        found.finish()
        assert all(torch.equal(p, ref) for p, (_, ref) in zip(payloads, refs)), density
        received = sparse_codec.BucketReceiver(torch.device("cuda"), 3)
        assert given_back is None or received.flags is given_back
        for i, (code, (k, _), payload, live) in enumerate(zip(codes, refs, payloads, lives)):
            received.add(i, code, k, rows * cols, torch.bfloat16, payload, live)
        assert received.commit() == [] and not received.flags.any()
        assert all(torch.equal(_bits(x), _bits(s)) for x, s in zip(baselines + lives, sources + sources)), density
        given_back = received.flags


def test_counts_of_a_bucket_come_back_in_one_transfer(monkeypatch):
    """Finding the changes of 16 boxes reads the device once (the counts), whatever their number."""
    reads = []
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.numel()) or original(t))
    pairs = [_pair(8, 10_000, 0.01, torch.bfloat16, s) for s in range(16)]
    expected = [int(sparse_codec.changed(c, b).sum()) for c, b in pairs]  # (before the CUDA `diff` advances them)
    reads.clear()
    found = sparse_codec.BucketChanges(pairs, [(i, (0, 0), (8, 10_000)) for i in range(16)])
    assert reads == [16]
    assert found.counts == expected


@pytest.mark.parametrize(
    "case", ["out of order", "beyond the box", "count over a block", "negative count", "counts not summing to k"]
)
def test_malformed_blocked_payloads_are_refused_before_any_write(case):
    n, k = 200_000, 3
    blocks = -(-n // 65536)
    payload = torch.zeros(encoded_nbytes(BLOCKED, n, k, 2), dtype=torch.uint8, device="cuda")
    counts, offsets = [2, 0, 0, 1], [5, 7, 9]
    if case == "out of order":
        offsets = [7, 5, 9]
    elif case == "beyond the box":
        offsets = [5, 7, -1]  # offset 65535 of the last block: element 262143 of 200000
    elif case == "count over a block":
        counts = [2, 0, 0, 70_000]
    elif case == "negative count":
        counts = [4, -1, 0, 0]
    else:
        counts = [2, 0, 0, 2]
    payload[: 4 * blocks].view(torch.int32).copy_(torch.tensor(counts, dtype=torch.int32))
    payload[16 : 16 + 2 * k].view(torch.int16).copy_(torch.tensor(offsets, dtype=torch.int16))
    live = torch.zeros(n, dtype=torch.bfloat16, device="cuda")
    assert not _receive(BLOCKED, k, n, torch.bfloat16, payload, live)
    torch.cuda.synchronize()
    assert torch.count_nonzero(live) == 0


@pytest.mark.parametrize("case", ["trailing bit", "count"])
def test_malformed_bitmaps_are_refused(case):
    """Both values differ from the live tensor's, so a write that the guard failed to stop shows."""
    n, k = 13, 2
    payload = torch.zeros(encoded_nbytes(BITMAP, n, k, 2), dtype=torch.uint8, device="cuda")
    payload[0] = 3
    payload[1] = 1 << 6 if case == "trailing bit" else 1
    payload[16:20].view(torch.bfloat16).copy_(torch.tensor([1.0, 2.0]))  # the values (16-byte aligned)
    live = torch.full((n,), 3.0, dtype=torch.bfloat16, device="cuda")
    assert not _receive(BITMAP, k, n, torch.bfloat16, payload, live)
    assert bool((live == 3.0).all())


def test_a_bucket_of_mixed_widths_and_encodings_round_trips_and_names_its_one_bad_box():
    """Boxes of 1, 2, 4 and 8 bytes, bitmap, blocked and indices (the torch path), strided and not,
    in one bucket: the sender's launches group them by width; the receiver validates them together
    and reports exactly the slot whose payload was corrupted, a fused one or one on the torch path,
    having written nothing."""
    specs = [
        (torch.uint8, BITMAP, 0.2),
        (torch.bfloat16, BLOCKED, 0.01),
        (torch.float32, BITMAP, 0.3),
        (torch.float64, BLOCKED, 0.005),
        (torch.bfloat16, BITMAP, 0.1),
        (torch.float32, INDICES, 0.002),
    ]
    pairs = [_pair(40, 9000, density, dtype, seed) for seed, (dtype, _, density) in enumerate(specs)]
    found = sparse_codec.BucketChanges(
        [(c.clone(), b.clone()) for c, b in pairs], [(i, (0, 0), (40, 9000)) for i in range(len(specs))]
    )
    payloads = []
    for i, ((_, code, _), (cur, base)) in enumerate(zip(specs, pairs)):
        k_ref, ref = _reference(code, cur, base)
        assert found.counts[i] == k_ref
        payloads.append(torch.zeros_like(ref))
        found.encode(i, code, payloads[-1])
        payloads[-1].ref = ref
    found.finish()
    assert all(torch.equal(p, p.ref) for p in payloads)

    def receive(corrupt: int | None):
        """The receiver, every box added and prepared before its payload's bytes arrive, as a round
        does; then they arrive."""
        received = sparse_codec.BucketReceiver(torch.device("cuda"), len(specs))
        lives = [_strided(base)[0] if i % 2 else base.clone() for i, (_, base) in enumerate(pairs)]
        arriving = [torch.zeros_like(payload) for payload in payloads]
        for i, ((dtype, code, _), (cur, _)) in enumerate(zip(specs, pairs)):
            received.add(i, code, found.counts[i], cur.numel(), dtype, arriving[i], lives[i])
        received.prepare()
        for i, (payload, buffer) in enumerate(zip(payloads, arriving)):
            buffer.copy_(payload)
            if i == corrupt == 3:
                buffer[: 4 * 6].view(torch.int32)[0] += 1  # one block claims an extra entry
            if i == corrupt == 5:
                buffer[:8].view(torch.int32)[:] = buffer[:8].view(torch.int32).flip(0).clone()  # out of order
        return received, lives

    for corrupt in (3, 5):
        received, lives = receive(corrupt)
        assert received.commit() == [corrupt]
        assert all(torch.equal(_bits(live), _bits(base)) for live, (_, base) in zip(lives, pairs)), corrupt
    received, lives = receive(corrupt=None)
    assert received.commit() == []
    assert all(torch.equal(_bits(live), _bits(cur)) for live, (cur, _) in zip(lives, pairs))


def test_launches_on_the_vectorized_path_take_the_cuda_kernels(sparse_kernels, monkeypatch):
    """Contiguous boxes take CUDA's `diff` and `compact` (busy: `compact_staged`, busier:
    `compact`, sparse: `compact_sparse`), a busy
    bitmap its `expand`; the checks (`starts`) and blocked rows (`blocked_check`, `blocked_apply`)
    take CUDA's on every path, unless Triton is asked for. Strided boxes keep Triton's `diff`,
    `compact` and `expand`, as does a sparse bitmap's `expand`."""
    launched = []
    original = sparse_cuda._queue

    def spy(handle: int, total: int, warps: int, device: int, pointers: int) -> None:
        functions = sparse_cuda._functions(device).items()
        launched.append(next(name.split("<")[0] for name, function in functions if function.ptr == handle))
        original(handle, total, warps, device, pointers)

    monkeypatch.setattr(sparse_cuda, "_queue", spy)  # (every CUDA launch, a bound `diff`'s too)
    cases = [  # (density, encoding, strided source and destination, the CUDA launches)
        (0.1, BITMAP, False, ["diff", "compact_staged", "starts", "expand"]),
        (0.4, BITMAP, False, ["diff", "compact", "starts", "expand"]),
        (0.1, BITMAP, True, ["starts"]),
        (0.01, BITMAP, False, ["diff", "compact_sparse", "starts"]),
        (0.01, BLOCKED, False, ["diff", "compact_sparse", "starts", "blocked_check", "blocked_apply"]),
        (0.01, BLOCKED, True, ["starts", "blocked_check", "blocked_apply"]),
    ]
    for density, code, strided, expected in cases:
        launched.clear()
        cur, base = _pair(64, 4096, density, torch.bfloat16, 7)
        k, ref = _reference(code, cur, base)
        src, baseline = (_strided(cur)[0], _strided(base)[0]) if strided else (cur.clone(), base.clone())
        found = sparse_codec.BucketChanges([(src, baseline)], [(0, (0, 0), (64, 4096))])
        payload = torch.zeros_like(ref)
        found.encode(0, code, payload)
        found.finish()
        live = _strided(base)[0] if strided else base.clone()
        assert torch.equal(payload, ref) and _receive(code, k, cur.numel(), torch.bfloat16, payload, live)
        assert torch.equal(_bits(live), _bits(cur))
        assert launched == (expected if sparse_kernels == "cuda" else []), (density, code, strided)


ODD = 3 * 16_384 + 8_191
"""Elements of a box whose last tile is partial (8,191 of 16,384: the CUDA `diff`'s second part of it
is empty) and whose last 16-byte lane is partial at every width (the count is odd)."""


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("code", [INDICES, BLOCKED, BITMAP])
@pytest.mark.parametrize("density", [0.01, 0.1, 0.4])  # sparse, busy, busier
def test_every_width_and_index_kind_round_trips_through_each_density_class(dtype, code, density, device="cuda"):
    """A contiguous box of `ODD` elements at each width, encoding and density class (sparse: CUDA's
    `compact_sparse`; busy, busier): the payload is the reference's byte for byte, the baseline and
    the live copy end equal to the source."""
    cur, base = _pair(1, ODD, density, dtype, 17, device)
    k, ref = _reference(code, cur, base)
    baseline, live = base.clone(), base.clone()
    found = sparse_codec.BucketChanges([(cur, baseline)], [(0, (0, 0), (1, ODD))])
    assert found.counts == [k]
    payload = torch.zeros_like(ref)
    found.encode(0, code, payload)
    found.finish()
    assert torch.equal(payload, ref) and torch.equal(_bits(baseline), _bits(cur))
    assert _receive(code, k, ODD, dtype, payload, live)
    assert torch.equal(_bits(live), _bits(cur))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("density", [0.01, 0.1])  # sparse, busy
def test_a_box_sent_twice_advances_its_baseline_once_both_are_encoded_at_every_width(dtype, density, device="cuda"):
    """The same box twice in a bucket (two replicas): both payloads are encoded against the old
    baseline, then the update-only launch advances it, partial last lane included."""
    cur, base = _pair(1, ODD, density, dtype, 23, device)
    ref = [_reference(code, cur, base) for code in (BITMAP, BLOCKED)]
    baseline = base.clone()
    found = sparse_codec.BucketChanges([(cur, baseline), (cur, baseline)], [(0, (0, 0), (1, ODD))] * 2)
    assert found.counts == [ref[0][0], ref[0][0]]
    payloads = [torch.zeros_like(r) for _, r in ref]
    for i, (code, payload) in enumerate(zip((BITMAP, BLOCKED), payloads)):
        found.encode(i, code, payload)
    found.finish()
    assert all(torch.equal(p, r) for p, (_, r) in zip(payloads, ref))
    assert torch.equal(_bits(baseline), _bits(cur))


def _changed_in(
    dtype: torch.dtype, n: int, spans: list[tuple[int, int, int]], seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cur, base) of `n` elements, `count` changes at random among the `length` from `start` for
    each `(start, length, count)` of `spans`, none elsewhere."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    base = (torch.randn(n, generator=gen, device="cuda") * 10).to(dtype)
    change = torch.zeros(n, dtype=torch.bool, device="cuda")
    for start, length, count in spans:
        change[start + torch.randperm(length, generator=gen, device="cuda")[:count]] = True
    cur = base.clone()
    cur[change] = (base[change].double() + 1).to(dtype)  # (uint8 wraps: 255 becomes 0)
    return cur, base


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("code", [INDICES, BLOCKED, BITMAP])
def test_runs_with_more_changes_than_the_stage_holds_are_compacted_from_the_source(dtype, code):
    """The CUDA `diff` stages the values of a warp's run (`sparse_cuda.stage_run`) with at most
    `1 / STAGE_SHARE` of it changed; `compact` takes a tile whose runs all fit from the stage, any
    other from the source. A busy box (`compact_staged`) whose tiles hold runs of exactly that many
    and one more, one of 10%, one of 15%, none, and a partial last tile; a sparse box
    (`compact_sparse`) with one run of one too many among few changes; a busier one (`compact`)
    with a tile of runs that fit: the payloads are the reference's, the baselines and live copies
    end equal to the sources."""
    tile, run = 16_384, sparse_cuda.stage_run(torch.empty(0, dtype=dtype).element_size())
    cap = run // sparse_cuda.STAGE_SHARE
    busy = [(0, run, cap), (run, run, cap + 1), (tile, tile, tile // 10), (2 * tile, tile, 3 * tile // 20)]
    busy.append((4 * tile, 5_000, 150))
    sparse = [(run, run, cap + 1), (5 * tile, 40 * tile, 40 * tile // 200)]
    busier = [(0, tile, tile // 10), (tile, 2 * tile, 2 * tile // 2)]
    shapes = [(4 * tile + 5_000, busy), (48 * tile, sparse), (3 * tile, busier)]
    pairs = [_changed_in(dtype, n, spans, seed) for seed, (n, spans) in enumerate(shapes)]
    refs = [_reference(code, cur, base) for cur, base in pairs]
    assert [density_class(k, cur.numel()) for (k, _), (cur, _) in zip(refs, pairs)] == [1, 0, 2]
    baselines, lives = [base.clone() for _, base in pairs], [base.clone() for _, base in pairs]
    boxes = [(i, (0,), (cur.numel(),)) for i, (cur, _) in enumerate(pairs)]
    found = sparse_codec.BucketChanges([(cur, b) for (cur, _), b in zip(pairs, baselines)], boxes)
    assert found.counts == [k for k, _ in refs]
    payloads = [torch.zeros_like(ref) for _, ref in refs]
    for i, payload in enumerate(payloads):
        found.encode(i, code, payload)
    found.finish()
    assert all(torch.equal(payload, ref) for payload, (_, ref) in zip(payloads, refs))
    received = sparse_codec.BucketReceiver(torch.device("cuda"), len(pairs))
    for i, ((k, _), payload, live) in enumerate(zip(refs, payloads, lives)):
        received.add(i, code, k, live.numel(), dtype, payload, live)
    assert received.commit() == []
    for (cur, _), baseline, live in zip(pairs, baselines, lives):
        assert torch.equal(_bits(baseline), _bits(cur)) and torch.equal(_bits(live), _bits(cur))


def test_a_round_trip_on_a_side_stream_queues_every_launch_behind_that_streams_work():
    """Each step runs on a side stream kept busy first: a kernel launched on another stream would run
    ahead of the copies it depends on, and the payload, baseline or live copy would come out wrong."""
    cur, base = _pair(64, 4096, 0.1, torch.bfloat16, 29)
    k, ref = _reference(BITMAP, cur, base)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of a busy stream
        baseline, payload = base.clone(), torch.zeros_like(ref)
        found = sparse_codec.BucketChanges([(cur, baseline)], [(0, (0, 0), (64, 4096))])
        torch.cuda._sleep(50_000_000)
        payload.zero_()
        found.encode(0, BITMAP, payload)
        found.finish()
        torch.cuda._sleep(50_000_000)
        live = base.clone()
        assert _receive(BITMAP, k, cur.numel(), torch.bfloat16, payload, live)
    torch.cuda.current_stream().wait_stream(side)
    assert found.counts == [k] and torch.equal(payload, ref)
    assert torch.equal(_bits(baseline), _bits(cur)) and torch.equal(_bits(live), _bits(cur))


def test_a_sender_advanced_on_another_stream_zeroes_its_counts_on_its_own():
    """Buckets found on a side stream and advanced under the default one, kept busy: the counts are
    zeroed on the side stream, behind the launches that read them, so the next round's `diff` there
    counts afresh (a zeroing queued behind the default stream's work would come after it)."""
    cur, base = _pair(64, 4096, 0.1, torch.bfloat16, 31)
    k, ref = _reference(BITMAP, cur, base)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    payloads, baselines = [], []
    for _ in range(2):
        with torch.cuda.stream(side):
            baseline, payload = base.clone(), torch.zeros_like(ref)
            found = sparse_codec.BucketChanges([(cur, baseline)], [(0, (0, 0), (64, 4096))])
            found.encode(0, BITMAP, payload)
            found.complete()
        torch.cuda._sleep(50_000_000)  # the default stream busy for tens of milliseconds
        found.advance()
        assert found.counts == [k]
        payloads.append(payload)
        baselines.append(baseline)
    torch.cuda.synchronize()
    assert all(torch.equal(p, ref) for p in payloads)
    assert all(torch.equal(_bits(b), _bits(cur)) for b in baselines)


@pytest.mark.parametrize("corrupt", [None, "first tile", "last tile", "stray bit", "block count"])
def test_boxes_of_many_tiles_and_blocks_are_checked_whole_before_any_write(corrupt):
    """A bitmap box of 1,031 tiles and a blocked box of 1,031 blocks (bytes) in one bucket: more counts
    than the checks scan in one pass (1,024), every tile counted by another program. Intact, both land
    bit for bit; with one bit of the bitmap cleared, or the last block's count raised by one (so either
    box's counts no longer add up to its k), or a bit set past n in the bitmap's last byte (in the box's
    partial last tile), that box alone is named and nothing is written."""
    shapes = [(1, 1030 * 16_384 + 77, BITMAP, 0.1), (1, 1030 * 65_536 + 5, BLOCKED, 0.002)]
    pairs = [_pair(rows, cols, density, torch.uint8, 31 + i) for i, (rows, cols, _, density) in enumerate(shapes)]
    found = sparse_codec.BucketChanges(
        [(c, b.clone()) for c, b in pairs], [(i, (0, 0), s[:2]) for i, s in enumerate(shapes)]
    )
    payloads = []
    for i, ((cur, _), (_, _, code, _)) in enumerate(zip(pairs, shapes)):
        payloads.append(
            torch.zeros(encoded_nbytes(code, cur.numel(), found.counts[i], 1), dtype=torch.uint8, device="cuda")
        )
        found.encode(i, code, payloads[-1])
    found.finish()
    bitmap = payloads[0][: -(-pairs[0][0].numel() // 8)]
    if corrupt in ("first tile", "last tile"):
        marked = torch.nonzero(bitmap).reshape(-1)
        byte = int(marked[0] if corrupt == "first tile" else marked[-1])
        bitmap[byte] &= bitmap[byte] - 1  # its lowest set bit cleared
    if corrupt == "stray bit":  # n is 5 past a multiple of 8: bits 5-7 of the last byte lie past it
        bitmap[-1] |= 0x80
    if corrupt == "block count":
        payloads[1][: 4 * 1031].view(torch.int32)[1030] += 1
    received = sparse_codec.BucketReceiver(torch.device("cuda"), 2)
    lives = [base.clone() for _, base in pairs]
    for i, ((cur, _), (_, _, code, _)) in enumerate(zip(pairs, shapes)):
        received.add(i, code, found.counts[i], cur.numel(), torch.uint8, payloads[i], lives[i])
    expected = {None: [], "first tile": [0], "last tile": [0], "stray bit": [0], "block count": [1]}[corrupt]
    assert received.commit() == expected
    wanted = [base for _, base in pairs] if expected else [cur for cur, _ in pairs]
    assert all(torch.equal(_bits(live), _bits(w)) for live, w in zip(lives, wanted))


@pytest.mark.parametrize("boxes", [3, 40])
def test_busy_buckets_round_trip_with_their_tables_inline_or_uploaded(boxes):
    """Busy bitmap boxes on the vectorized path: 3 carry the sender's and receiver's tables in the
    CUDA kernels' parameters, 40 are too many (`sparse_cuda.INLINE_VALUES`) and upload them; either
    way the payloads are the reference's and the live copies end equal to the sources, and a
    corrupted bitmap writes nothing."""
    pairs = [_pair(8, 5000, 0.3, torch.bfloat16, seed) for seed in range(boxes)]
    sources = [(c.clone(), b.clone()) for c, b in pairs]
    found = sparse_codec.BucketChanges(sources, [(i, (0, 0), (8, 5000)) for i in range(boxes)])
    refs = [_reference(BITMAP, c, b) for c, b in pairs]
    payloads = [torch.zeros_like(ref) for _, ref in refs]
    for i, payload in enumerate(payloads):
        found.encode(i, BITMAP, payload)
    found.finish()
    assert all(torch.equal(p, ref) for p, (_, ref) in zip(payloads, refs))
    for corrupt in (boxes - 1, None):
        lives = [b.clone() for _, b in pairs]
        received = sparse_codec.BucketReceiver(torch.device("cuda"), boxes)
        for i, ((k, _), payload, live) in enumerate(zip(refs, payloads, lives)):
            if i == corrupt:
                payload = payload.clone()
                payload[0] ^= 1  # one mark more or fewer than k
            received.add(i, BITMAP, k, 8 * 5000, torch.bfloat16, payload, live)
        assert received.commit() == ([] if corrupt is None else [corrupt])
        wanted = [b for _, b in pairs] if corrupt is not None else [c for c, _ in pairs]
        assert all(torch.equal(_bits(live), _bits(w)) for live, w in zip(lives, wanted)), corrupt
