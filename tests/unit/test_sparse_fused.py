"""The fused sparse codec's host side, without running a kernel: which boxes overlap, which
launch a box takes, a bucket's geometry built once and found again by where its boxes are, and
which boxes stay on the torch path."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from rl_sync.engine import sparse_codec, sparse_fused, sparse_launch, sparse_receiver, sparse_table, sparse_triton
from rl_sync.engine.sparse_codec import overlapping


def test_only_boxes_of_one_tensor_that_share_an_element_overlap():
    boxes = [
        (0, (0, 0), (4, 8)),
        (0, (3, 7), (1, 1)),  # element (3, 7), inside the first
        (0, (4, 0), (4, 8)),  # touches the first, shares nothing
        (1, (0, 0), (4, 8)),  # the same place in another tensor
    ]
    assert overlapping(boxes) == (True, True, False, False)


def test_a_box_is_busy_above_one_change_per_bitmap_word_and_busier_above_one_in_five():
    assert [sparse_fused.density(k, 1024) for k in (0, 32, 33, 204, 205, 1024)] == [0, 0, 1, 1, 2, 2]


def _pairs(tensors: int = 3, n: int = 10_000) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)) for _ in range(tensors)]


def test_a_bucket_geometry_is_built_once_and_rebuilt_when_a_box_moves():
    pairs = _pairs()
    first = sparse_fused.geometry(pairs, [0, 1, 2], [False] * 3)
    again = sparse_fused.geometry([(c.view(-1), b.view(-1)) for c, b in pairs], [0, 1, 2], [False] * 3)
    assert again is first
    moved = [pairs[0], (pairs[1][0].clone(), pairs[1][1]), pairs[2]]
    assert sparse_fused.geometry(moved, [0, 1, 2], [False] * 3) is not first
    assert sparse_fused.geometry(pairs, [0, 1, 2], [True, True, False]) is not first


def test_a_kept_bucket_finds_its_geometry_by_its_tensor_objects(monkeypatch):
    """With the bucket's `KeptTables`, a round of the same source and baseline objects (in new
    lists), candidates and overlaps finds the last round's geometry without working out where the
    boxes are; another object, other candidates, other overlaps or another answer of
    `sparse_cuda.usable` take the signature again. The objects are held by weak references: a
    source cast anew each round is not kept alive."""
    signatures = []
    signature = sparse_fused._signature
    monkeypatch.setattr(sparse_fused, "_signature", lambda *a: signatures.append(1) or signature(*a))
    pairs, kept = _pairs(), sparse_codec.KeptTables()
    first = sparse_fused.geometry(pairs, [0, 1, 2], (False,) * 3, kept)
    assert sparse_fused.geometry([tuple(p) for p in pairs], [0, 1, 2], (False,) * 3, kept) is first
    assert len(signatures) == 1
    views = [(c.view(-1), b.view(-1)) for c, b in pairs]  # (other objects, the same places)
    assert sparse_fused.geometry(views, [0, 1, 2], (False,) * 3, kept) is first and len(signatures) == 2
    assert sparse_fused.geometry(views, [0, 1], (False,) * 3, kept) is not first and len(signatures) == 3
    assert sparse_fused.geometry(views, [0, 1, 2], (True, True, False), kept) is not first
    moved = [views[0], (pairs[1][0].clone(), views[1][1]), views[2]]
    assert sparse_fused.geometry(moved, [0, 1, 2], (False,) * 3, kept) is not first and len(signatures) == 5
    assert kept.geometry is not None and kept.geometry[0][2]() is moved[1][0]
    again = [views[0], moved[1], views[2]]  # (the same objects, overlaps given as a list)
    found = sparse_fused.geometry(again, [0, 1, 2], [False] * 3, kept)
    assert found is kept.geometry[3] and len(signatures) == 5
    from rl_sync.engine import sparse_cuda

    monkeypatch.setattr(sparse_cuda, "usable", lambda device: not found.cuda)  # (RL_SYNC_SPARSE_KERNELS changed)
    assert sparse_fused.geometry(again, [0, 1, 2], (False,) * 3, kept).cuda is not found.cuda
    del moved, again  # (its clone is held by nothing else: the kept geometry does not keep it alive)
    assert kept.geometry[0][2]() is None


def test_a_placed_buffer_is_a_quarter_more_than_the_last_payloads_and_a_sixteenth_of_dense_at_least():
    """`_Geometry.capacity`: a quarter of the dense bytes before any round; then a quarter more than
    the last round's payloads and 16 bytes a box, never under a sixteenth of the dense bytes; and
    the class with the most programs is the one queued early next round (none after a quiet one)."""
    g = sparse_fused.geometry(_pairs(tensors=3, n=1 << 16), [0, 1, 2], [False] * 3)
    g.dense_bytes = 3 * 2 * (1 << 16)
    assert (g.capacity(), g.likely) == (98_304, None)
    g.learn(200_000, [0, 12, 3])
    assert (g.capacity(), g.likely) == (250_048, 1)
    g.learn(0, [0, 0, 0])
    assert (g.capacity(), g.likely) == (24_576, None)


def test_geometry_gives_each_box_whole_blocks_of_tile_slots_and_leaves_out_what_cannot_fuse():
    n = 70_000  # two wire blocks of 65,536 elements
    pairs = _pairs(2, n) + [(torch.zeros(8, dtype=torch.float32), torch.zeros(8, dtype=torch.float64))]
    made = sparse_fused.geometry(pairs, [0, 1, 2], [False] * 3)
    per_box = 2 * (65_536 // sparse_table.TILE)
    assert sorted(made.boxes) == [0, 1]  # dtypes differ: box 2 takes the torch path
    assert [made.boxes[i].slot for i in (0, 1)] == [0, per_box]
    assert made.slots == 2 * per_box
    assert [launch.total for launch in made.diff] == [2 * sparse_table.tiles(n) * sparse_triton.DIFF_PARTS]


def test_a_source_and_baseline_of_different_shapes_never_take_the_fused_path():
    cur, base = torch.zeros(10_000, dtype=torch.bfloat16), torch.zeros(100, dtype=torch.bfloat16)
    assert sparse_fused.geometry([(cur, base)], [0], [False]).boxes == {}


def test_boxes_whose_payloads_go_to_another_kind_of_device_take_the_torch_path(monkeypatch):
    """CUDA sources sent over a host transport (Gloo): the fused kernels cannot write host payloads."""
    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"

    def refuse(*args):
        raise AssertionError("the fused path was taken")

    monkeypatch.setattr(sparse_fused, "FusedSender", refuse)
    cur, base = torch.zeros(5000, dtype=torch.bfloat16), torch.zeros(5000, dtype=torch.bfloat16)
    cur[::50] = 2.0
    found = sparse_codec.BucketChanges([(cur, base)], [(0, (0,), (5000,))], payloads=torch.device("meta"))
    assert found.counts == [100]


def test_launches_take_the_cuda_kernels_only_on_the_vectorized_path_and_expand_only_when_busy():
    from rl_sync.engine import sparse_cuda
    from rl_sync.engine import sparse_triton as kernels

    pick = sparse_launch.kernel
    assert pick("diff", (2, True), None, True) is sparse_cuda.diff
    assert pick("compact", (2, True), 1, True) is sparse_cuda.compact
    assert pick("expand", (8, True), 2, True) is sparse_cuda.expand
    assert pick("compact", (2, True), 0, True) is sparse_cuda.compact  # (its sparse kernel: `compact_sparse`)
    assert pick("expand", (2, True), 0, True) is kernels.expand  # sparse boxes: Triton's mark-by-mark launches
    assert (
        pick("diff", (2, False), None, True) is kernels.diff and pick("expand", (4, False), 1, True) is kernels.expand
    )
    assert (
        pick("diff", (2, True), None, False) is kernels.diff and pick("compact", (2, True), 1, False) is kernels.compact
    )


def test_bitmap_destinations_that_share_a_byte_are_told_apart_from_disjoint_ones():
    """The CUDA `expand` rewrites whole 16-byte runs, so a bucket whose bitmap destinations overlap
    takes Triton's (`FusedReceiver.write`)."""
    assert sparse_receiver.disjoint([]) and sparse_receiver.disjoint([(0, 64)])
    assert sparse_receiver.disjoint([(64, 128), (0, 64), (128, 130)])  # touching, in any order
    assert not sparse_receiver.disjoint([(64, 128), (0, 65)])
    assert not sparse_receiver.disjoint([(0, 1000), (16, 32)])  # one inside another


def test_a_bucket_geometry_records_which_diff_it_cuts_its_tiles_for(monkeypatch):
    """The CUDA `diff` takes fewer, bigger programs a tile than Triton's: a geometry built for one is
    not found again for the other, and strided boxes keep Triton's programs either way."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.engine import sparse_triton as kernels

    holder = torch.zeros(200, 300, dtype=torch.bfloat16)
    pairs = [*_pairs(2, 40_000), (holder[:, :100], holder[:, 100:200])]  # the last one strided
    programs = {}
    for cuda in (True, False):
        monkeypatch.setattr(sparse_cuda, "usable", lambda device, cuda=cuda: cuda)
        made = sparse_fused.geometry(pairs, [0, 1, 2], [False] * 3)
        programs[cuda] = {launch.key[1]: launch.total for launch in made.diff}
        assert sparse_fused.geometry(pairs, [0, 1, 2], [False] * 3) is made
    tiles = sparse_table.tiles(40_000)
    assert programs[True] == {True: 2 * tiles * sparse_cuda.DIFF_PARTS, False: sparse_table.tiles(20_000) * 8}
    assert programs[False] == {True: 2 * tiles * kernels.DIFF_PARTS, False: sparse_table.tiles(20_000) * 8}


def test_a_receiver_checks_every_row_in_one_cuda_launch_or_in_tritons_two(monkeypatch):
    """With the CUDA kernels, one `starts` launch: a program a tile for each bitmap row, one for each
    blocked row, and a zeroed counter a row; with Triton's, `bitmap_counts` then `scan`. Blocked rows
    are checked for order and written by the same kernels' `blocked_check` and `blocked_apply`, and
    the writes follow the checks."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.engine import sparse_triton as kernels
    from rl_sync.sparse.encodings import BITMAP, BLOCKED, encoded_nbytes

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    boxes = [(BITMAP, 40_000), (BLOCKED, 70_000), (BITMAP, 20_000)]
    launched = []

    def spy(name):
        return lambda *args: launched.append((name, args))

    blocked = ("blocked_check", "blocked_apply")
    for module, name in [(sparse_cuda, name) for name in ("starts", "expand", *blocked)] + [
        (kernels, name) for name in ("expand", "bitmap_counts", "scan", *blocked)
    ]:
        monkeypatch.setattr(module, name, spy(("cuda " if module is sparse_cuda else "") + name))
    for cuda in (True, False):
        monkeypatch.setattr(sparse_cuda, "usable", lambda device, cuda=cuda: cuda)
        launched.clear()
        received = sparse_codec.BucketReceiver(torch.device("cpu"), len(boxes))
        for slot, (code, n) in enumerate(boxes):
            payload = torch.zeros(encoded_nbytes(code, n, 5, 2), dtype=torch.uint8)
            received.add(slot, code, 5, n, torch.bfloat16, payload, torch.zeros(n, dtype=torch.bfloat16))
        assert received.commit() == []
        names = [name for name, _ in launched]
        if cuda:  # (the bitmap rows are sparse: Triton's `expand`)
            assert names == ["cuda starts", "cuda blocked_check", "expand", "cuda blocked_apply"]
        else:
            assert names == ["bitmap_counts", "scan", "blocked_check", "expand", "blocked_apply"]
        if cuda:
            _, firsts, rows, programs, counts, starts, *_, done = launched[0][1]
            tiles = [sparse_table.tiles(40_000), 1, sparse_table.tiles(20_000)]
            per = sparse_cuda.STARTS_WARPS  # tiles a program (a warp each)
            each = [-(-tiles[0] // per), 1, -(-tiles[2] // per)]
            assert (firsts.tolist(), rows, programs) == ([0, each[0], each[0] + 1, sum(each)], 3, sum(each))
            assert counts.numel() == starts.numel() == tiles[0] + 2 + tiles[2]
            counters, size = sparse_codec.flags_layout(len(boxes))  # `starts`' counters: zeroed with the flags
            assert done.data_ptr() == received.flags.data_ptr() + 4 * counters and received.flags.numel() == size


@pytest.mark.parametrize("cuda", [True, False])
def test_a_receiver_writes_each_key_in_turn_its_expands_by_density_then_its_blocked_rows(monkeypatch, cuda):
    """Rows of two element widths, bitmap ones of both busy classes and blocked ones, added out of
    order: one write launch per (key, density class), each key's `expand`s before its
    `blocked_apply`, each over its own rows' programs."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.engine import sparse_triton as kernels
    from rl_sync.sparse.encodings import BITMAP, BLOCKED, encoded_nbytes

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: cuda)
    writes = []
    for module in (sparse_cuda, kernels):
        monkeypatch.setattr(module, "expand", lambda *a: writes.append(("expand", a[4], a[6], a[3])))
    for module in (sparse_cuda, kernels):
        monkeypatch.setattr(module, "blocked_apply", lambda *a: writes.append(("apply", a[4], None, a[3])))
        monkeypatch.setattr(module, "blocked_check", lambda *a: None)
    monkeypatch.setattr(sparse_cuda, "starts", lambda *a: None)
    for name in ("bitmap_counts", "scan"):
        monkeypatch.setattr(kernels, name, lambda *a: None)
    boxes = [  # (code, n, k, dtype)
        (BLOCKED, 70_000, 5, torch.float32),
        (BITMAP, 40_000, 10_000, torch.bfloat16),  # busier
        (BITMAP, 20_000, 5_000, torch.float32),  # busier
        (BLOCKED, 70_000, 5, torch.bfloat16),
        (BITMAP, 40_000, 4_000, torch.bfloat16),  # busy
    ]
    received = sparse_codec.BucketReceiver(torch.device("cpu"), len(boxes))
    for slot, (code, n, k, dtype) in enumerate(boxes):
        payload = torch.zeros(encoded_nbytes(code, n, k, dtype.itemsize), dtype=torch.uint8)
        received.add(slot, code, k, n, dtype, payload, torch.zeros(n, dtype=dtype))
    assert received.commit() == []
    bf16, fp32, blocks = (2, True), (4, True), -(-70_000 // 65_536)
    assert writes == [
        ("expand", bf16, 1, sparse_table.tiles(40_000)),
        ("expand", bf16, 2, sparse_table.tiles(40_000)),
        ("apply", bf16, None, blocks),
        ("expand", fp32, 2, sparse_table.tiles(20_000)),
        ("apply", fp32, None, blocks),
    ]


BUSY_N, BUSY_K = 40_000, 4_000
"""`_busy_sender`'s boxes: elements and changes."""


def _busy_sender(monkeypatch, cuda: bool, compact) -> sparse_codec.BucketChanges:
    """A sender of 7 busy boxes of 40,000 bf16 elements (3 tiles each), `BUSY_K` changes each (the
    `diff` of `sparse_cuda` with `cuda`, else Triton's, stubbed to count them), flushing from one
    tile on, its `compact` launches handed to `compact` (the same module's)."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.engine import sparse_triton as kernels

    def diff(table, firsts, boxes, total, key, words, counts, totals):
        totals.fill_(BUSY_K)

    module = sparse_cuda if cuda else kernels
    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: cuda)
    monkeypatch.setattr(sparse_fused, "FLUSH_TILES", 1)
    monkeypatch.setattr(module, "diff", diff)
    monkeypatch.setattr(module, "compact", compact)
    return sparse_codec.BucketChanges(_pairs(7, BUSY_N), [(i, (0,), (BUSY_N,)) for i in range(7)])


def test_a_sender_compacts_the_boxes_encoded_so_far_once_they_hold_a_share_of_the_bucket(monkeypatch):
    """`encode` launches `compact` for the boxes it has encoded once they hold a `FLUSHES`-th of the
    bucket's tiles (the first time a `FIRST_FLUSH`-th: the device waits for that one); `complete`
    launches the rest: every box once, in the order encoded."""
    from rl_sync.sparse.encodings import BITMAP, encoded_nbytes

    launched = []
    found = _busy_sender(
        monkeypatch, False, lambda table, *args: launched.append(table.view(-1, sparse_table.SEND_COLUMNS))
    )
    assert found.counts == [BUSY_K] * 7
    per_launch = []
    for i in range(7):
        found.encode(i, BITMAP, torch.zeros(encoded_nbytes(BITMAP, BUSY_N, BUSY_K, 2), dtype=torch.uint8))
        per_launch.append(len(launched))
    assert per_launch == [1, 1, 2, 2, 3, 3, 4]  # 21 tiles: the first once 2 (an eighth) wait, then 5 (a quarter)
    found.finish()
    assert [table[:, sparse_table.SEND_COUNT].tolist() for table in launched] == [[0], [1, 2], [3, 4], [5, 6]]


def test_rounds_of_a_bucket_reuse_its_scratch_lent_to_one_sender_at_a_time(monkeypatch):
    """A sender borrows its bucket's scratch from the geometry and gives it back at `advance`, its
    counts zeroed behind its launches: the next round's sender takes the same buffers and counts
    from zero. A sender that comes while the scratch is lent gets new buffers, kept in its place."""
    from rl_sync.engine import sparse_triton as kernels

    def diff(table, firsts, boxes, total, key, words, counts, totals):
        totals += BUSY_K  # (added: counts left from an earlier round would show)

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(kernels, "diff", diff)
    pairs, boxes = _pairs(3, BUSY_N), [(i, (0,), (BUSY_N,)) for i in range(3)]
    first = sparse_codec.BucketChanges(pairs, boxes)
    while_lent = sparse_codec.BucketChanges(pairs, boxes)
    lent = [found._fused._scratch for found in (first, while_lent)]
    assert lent[0] is not lent[1] and all(found.counts == [BUSY_K] * 3 for found in (first, while_lent))
    first.finish()
    while_lent.finish()
    for _ in range(2):
        again = sparse_codec.BucketChanges(pairs, boxes)
        assert again._fused._scratch is lent[1] and again.counts == [BUSY_K] * 3
        again.finish()


def test_a_receiver_refuses_a_box_added_after_its_tables_were_prepared(monkeypatch):
    """`prepare` uploads the tables of the boxes added so far: a later box would be missing from
    every launch, so it is refused, naming its slot."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.sparse.encodings import BITMAP, encoded_nbytes

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: False)
    n, k = 40_000, 5_000
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 2)
    box = (BITMAP, k, n, torch.bfloat16, torch.zeros(encoded_nbytes(BITMAP, n, k, 2), dtype=torch.uint8))
    received.add(0, *box, torch.zeros(n, dtype=torch.bfloat16))
    received.prepare()
    with pytest.raises(RuntimeError, match="box 1 was added after this bucket's receiver tables were prepared"):
        received.add(1, *box, torch.zeros(n, dtype=torch.bfloat16))


def test_a_receiver_refuses_a_slot_added_twice():
    """Each box of a bucket has one slot (the fused checks keep a counter a box, in the flags'
    buffer): a second box in the same slot is refused, naming it."""
    from rl_sync.sparse.encodings import BLOCKED, encoded_nbytes

    received = sparse_codec.BucketReceiver(torch.device("cpu"), 2)
    box = (BLOCKED, 5, 100, torch.bfloat16, torch.zeros(encoded_nbytes(BLOCKED, 100, 5, 2), dtype=torch.uint8))
    received.add(1, *box, torch.zeros(100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="box slot 1 was added twice to this bucket's receiver"):
        received.add(1, *box, torch.zeros(100, dtype=torch.bfloat16))


def test_a_receiver_carries_few_rows_inline_and_uploads_many(monkeypatch):
    """With the CUDA kernels, a bucket of busy bitmap rows few enough for `sparse_cuda.INLINE_VALUES`
    passes its table and program starts to `starts` and `expand` as host values (no upload), with
    zeroed counters; one of more rows uploads them. The inline launches take their buffers by
    address: the flags, the guard and the counters in the flags' buffer, the counts and positions in
    one allocation."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.sparse.encodings import BITMAP, encoded_nbytes

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: True)
    launched = []
    monkeypatch.setattr(sparse_cuda, "starts", lambda *a: launched.append(("starts", a)))
    monkeypatch.setattr(sparse_cuda, "expand", lambda *a: launched.append(("expand", a)))
    n, k = 40_000, 5_000  # busy
    many = sparse_cuda.INLINE_VALUES // sparse_table.RECV_COLUMNS
    assert sparse_cuda.fits_inline(3, sparse_table.RECV_COLUMNS) and not sparse_cuda.fits_inline(
        many, sparse_table.RECV_COLUMNS
    )
    for boxes in (3, many):
        launched.clear()
        received = sparse_codec.BucketReceiver(torch.device("cpu"), boxes)
        for slot in range(boxes):
            payload = torch.zeros(encoded_nbytes(BITMAP, n, k, 2), dtype=torch.uint8)
            received.add(slot, BITMAP, k, n, torch.bfloat16, payload, torch.zeros(n, dtype=torch.bfloat16))
        assert received.commit() == []
        (_, checks), (_, writes) = launched
        table, firsts, rows, *_, done = checks
        assert rows == boxes and writes[:3] == (table, writes[1], boxes)
        if boxes == 3:
            each = -(-sparse_table.tiles(n) // sparse_cuda.STARTS_WARPS)
            assert len(table) == 3 * sparse_table.RECV_COLUMNS and firsts == [0, each, 2 * each, 3 * each]
            assert writes[1] == [0, sparse_table.tiles(n), 2 * sparse_table.tiles(n), 3 * sparse_table.tiles(n)]
            counts, starts, flags, guard = checks[4:8]  # by address: the flags' buffer, one allocation
            counters, _ = sparse_codec.flags_layout(boxes)
            at = received.flags.data_ptr()
            assert [flags.data_ptr(), guard.data_ptr(), done.data_ptr()] == [at, at + 4 * boxes, at + 4 * counters]
            assert counts.data_ptr() == starts.data_ptr() + 8 * 3 * sparse_table.tiles(n)
        else:
            assert all(isinstance(t, torch.Tensor) for t in (table, firsts, writes[1]))


def test_a_bucket_of_blocked_rows_is_checked_and_written_in_cuda_with_its_table_inline(monkeypatch):
    """With the CUDA kernels, blocked rows (a round at 1% density) are checked by `starts` and
    `blocked_check` and written by `blocked_apply`, all CUDA launches: a few rows' table rides
    inline in each (no upload), strided destinations included."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.sparse.encodings import BLOCKED, encoded_nbytes

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: True)
    launched = []
    for name in ("starts", "blocked_check", "blocked_apply"):
        monkeypatch.setattr(sparse_cuda, name, lambda *a, name=name: launched.append((name, a)))
    n, k = 70_000, 700
    holder = torch.zeros(2, n, dtype=torch.bfloat16)
    views = [torch.zeros(n, dtype=torch.bfloat16), holder[:, : n // 2], torch.zeros(n, dtype=torch.bfloat16)]
    received = sparse_codec.BucketReceiver(torch.device("cpu"), len(views))
    for slot, view in enumerate(views):
        payload = torch.zeros(encoded_nbytes(BLOCKED, n, k, 2), dtype=torch.uint8)
        received.add(slot, BLOCKED, k, n, torch.bfloat16, payload, view)
    assert received.commit() == []
    assert [name for name, _ in launched] == ["starts", "blocked_check", "blocked_apply", "blocked_apply"]
    for name, (table, firsts, boxes, *_) in launched:
        assert len(table) == 3 * sparse_table.RECV_COLUMNS and not isinstance(table, torch.Tensor), name
        assert boxes == 3 and isinstance(firsts, list), name
    blocks = -(-n // 65_536)  # a program a wire block
    (_, checks), (_, blocked), *writes = launched
    assert (checks[1], checks[3]) == ([0, 1, 2, 3], 3) and (blocked[1], blocked[3]) == (
        [0, blocks, 2 * blocks, 3 * blocks],
        3 * blocks,
    )
    assert [(args[4], args[1], args[3]) for _, args in writes] == [  # by key: the strided row, then the others
        ((2, False), [0, 0, blocks, blocks], blocks),
        ((2, True), [0, blocks, blocks, 2 * blocks], 2 * blocks),
    ]


def test_a_sender_carries_a_flush_of_few_busy_rows_inline(monkeypatch):
    """With the CUDA kernels, each `compact` launch passes its rows and program starts as host
    values: the same rows, in the order encoded, as an uploaded table would hold."""
    from rl_sync.sparse.encodings import BITMAP, encoded_nbytes

    launched = []
    found = _busy_sender(monkeypatch, True, lambda table, firsts, boxes, *args: launched.append((table, firsts)))
    for i in range(7):
        found.encode(i, BITMAP, torch.zeros(encoded_nbytes(BITMAP, BUSY_N, BUSY_K, 2), dtype=torch.uint8))
    found.finish()
    columns, count = sparse_table.SEND_COLUMNS, sparse_table.SEND_COUNT
    assert [table[count::columns] for table, _ in launched] == [[0], [1, 2], [3, 4], [5, 6]]
    assert [firsts for _, firsts in launched] == [[0, 3]] + [[0, 3, 6]] * 3


def _aligned(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes starting 16-byte aligned."""
    buffer = torch.zeros(nbytes + 16, dtype=torch.uint8)
    return buffer[(-buffer.data_ptr()) % 16 :][:nbytes]


def test_a_message_refused_at_its_second_box_leaves_nothing_of_its_first(monkeypatch):
    """A message whose second view is refused (an int16 view at an odd address) adds nothing: a
    message after it takes its slots as if the refused one had never come, one row each."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.sparse.encodings import BITMAP, message_layout

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)  # these CPU tensors "on a GPU"
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: False)
    n = 64
    odd = torch.frombuffer(bytearray(2 * n + 2), dtype=torch.int16, offset=1, count=n)
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 3)
    layout = message_layout([BITMAP, 1, BITMAP, 1], [n, n], [2, 2], "m")
    with pytest.raises(ValueError, match="is not aligned to its 2-byte elements"):
        views = [torch.zeros(n, dtype=torch.int16), odd]
        received.add_message(0, layout, [torch.int16] * 2, _aligned(layout.nbytes), views)
    after = message_layout([BITMAP, 1], [n], [2], "m")
    received.add_message(2, after, [torch.int16], _aligned(after.nbytes), [torch.zeros(n, dtype=torch.int16)])
    fused = received._fused
    received.prepare()
    table = fused._checks[0][1][0]  # (the checks' table: one row)
    assert fused.boxes == 1 and len(table) == sparse_table.RECV_COLUMNS
    assert table[10] == 2 and fused._entries == 1 and list(received._added) == [0, 0, 1]


def test_after_its_tables_are_prepared_a_receiver_takes_boxes_for_the_torch_path_only(monkeypatch):
    """Once the fused tables are prepared, a box for the torch path (dense) is still taken; one for
    the fused path is refused, naming its slot, and nothing of its message is added."""
    from rl_sync.engine import sparse_cuda
    from rl_sync.sparse.encodings import BITMAP, DENSE, encoded_nbytes

    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: False)
    n = 64
    live = lambda: torch.zeros(n, dtype=torch.bfloat16)  # noqa: E731
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 3)
    received.add(0, BITMAP, 0, n, torch.bfloat16, _aligned(encoded_nbytes(BITMAP, n, 0, 2)), live())
    received.prepare()
    received.add(1, DENSE, n, n, torch.bfloat16, _aligned(encoded_nbytes(DENSE, n, n, 2)), live())
    with pytest.raises(RuntimeError, match=r"^box 2 was added after this bucket's receiver tables were prepared$"):
        received.add(2, BITMAP, 0, n, torch.bfloat16, _aligned(encoded_nbytes(BITMAP, n, 0, 2)), live())
    assert list(received._added) == [1, 1, 0] and received._fused.boxes == 1
