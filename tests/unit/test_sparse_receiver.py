"""A bucket's receivers keep its destinations and tables (`sparse_codec.KeptTables`), without
running a kernel: a round after the first queues exactly the launches a receiver working
everything out afresh would, whether its headers keep the shape of an earlier round or not, and
views that change are worked out again. A destination view of other elements than its box is
refused on either path."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from rl_sync.engine import sparse_codec, sparse_cuda
from rl_sync.engine import sparse_triton as kernels
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, choose, message_layout

_KERNELS = [(sparse_cuda, name) for name in ("starts", "expand", "blocked_check", "blocked_apply")] + [
    (kernels, name) for name in ("bitmap_counts", "scan", "expand", "blocked_check", "blocked_apply")
]


def _host(value, table: bool):
    """A launch argument as the test compares it: its table and program starts (`table`) as
    lists, counts and keys as they are, buffers (allocated anew each round) by kind alone."""
    if table:
        return value.tolist() if isinstance(value, (np.ndarray, torch.Tensor)) else list(value)
    return "buffer" if isinstance(value, (torch.Tensor, sparse_cuda.Address)) else value


def _spy(label: str, calls: list):
    tables = 1 if label.endswith("scan") else 2  # (`scan` takes no program starts)
    return lambda *a: calls.append((label, *(_host(v, i < tables) for i, v in enumerate(a))))


@pytest.fixture
def launched(monkeypatch):
    """Every receiver launch, its arguments as `_host` gives them; these CPU tensors "on a GPU"."""
    calls: list[tuple] = []
    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: True)
    for module, name in _KERNELS:
        label = f"{module.__name__.rsplit('.', 1)[1]}.{name}"
        monkeypatch.setattr(module, name, _spy(label, calls))
    return calls


def _aligned(nbytes: int) -> torch.Tensor:
    buffer = torch.zeros(nbytes + 16, dtype=torch.uint8)
    return buffer[(-buffer.data_ptr()) % 16 :][:nbytes]


def _views(rng: random.Random) -> tuple[list[torch.Tensor], list[torch.dtype]]:
    """A message's destinations: contiguous or strided, bf16, fp32 or a view of another dtype than
    the wire's (the torch path)."""
    views, dtypes = [], []
    for _ in range(rng.randint(1, 5)):
        n, dtype = rng.choice([700, 40_000, 70_000]), rng.choice([torch.bfloat16, torch.float32])
        if rng.random() < 0.3:
            views.append(torch.zeros(2, n, dtype=dtype)[:, : n // 2])  # strided
        else:
            views.append(torch.zeros(n, dtype=torch.float16 if rng.random() < 0.1 else dtype))
        dtypes.append(dtype)
    return views, dtypes


def _header(rng: random.Random, views: list[torch.Tensor], dtypes: list[torch.dtype]) -> list[int]:
    header = []
    for view, dtype in zip(views, dtypes):
        n = view.numel()
        k = min(n, int(n * rng.choice([0.0, 0.002, 0.01, 0.05, 0.1, 0.3, 1.0])))
        code = rng.choice([choose(n, k, dtype.itemsize, True), BITMAP, BLOCKED, INDICES])
        header += [code, n if code == DENSE else k]
    return header


def _layouts(messages, headers) -> list:
    return [
        message_layout(header, [v.numel() for v in views], [d.itemsize for d in dtypes], "m")
        for (views, dtypes), header in zip(messages, headers)
    ]


def _round(messages, layouts, payloads, kept, launched: list) -> list:
    """The launches of one round's receiver (`kept`, or None: afresh) of `messages` laid out as
    `layouts`, their payloads in `payloads`."""
    launched.clear()
    received = sparse_codec.BucketReceiver(torch.device("cpu"), sum(len(v) for v, _ in messages), kept)
    first = 0
    for (views, dtypes), layout, payload in zip(messages, layouts, payloads):
        received.add_message(first, layout, dtypes, payload, views)
        first += len(views)
    received.prepare()
    if received._fused is not None:
        received._fused.validate()
        received._fused.write()
    return list(launched)


def _both(messages, headers, kept, launched: list) -> tuple[list, list]:
    """(the launches with `kept`, those afresh) of one round of `messages` under `headers`."""
    layouts = _layouts(messages, headers)
    payloads = [_aligned(layout.nbytes) for layout in layouts]
    return _round(messages, layouts, payloads, kept, launched), _round(messages, layouts, payloads, None, launched)


@pytest.mark.parametrize("usable", [True, False])
@pytest.mark.parametrize("seed", range(12))
def test_kept_tables_queue_the_launches_a_fresh_receiver_queues(launched, monkeypatch, seed, usable):
    """Rounds of one bucket (two messages, views of every kind) whose headers keep an earlier
    round's shape or change it: the receiver with the bucket's `KeptTables` queues the launches
    (tables, program starts, programs, keys, density classes) one working everything out afresh
    queues; a shape seen before is found again."""
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: usable)
    rng = random.Random(seed)
    messages = [_views(rng), _views(rng)]
    kept = sparse_codec.KeptTables()
    headers = [[_header(rng, *m) for m in messages] for _ in range(3)]
    seen = 0
    for round_ in range(6):
        these = headers[round_ % 3] if round_ != 4 else [_header(rng, *m) for m in messages]
        shapes = len(kept.tables)
        with_kept, fresh = _both(messages, these, kept, launched)
        assert with_kept == fresh
        seen += len(fresh)
        if round_ in (3, 5):  # (headers of an earlier round: its tables found again)
            assert len(kept.tables) == shapes
    assert seen


def test_kept_destinations_are_found_by_the_view_objects_and_worked_out_again_when_one_changes(launched, monkeypatch):
    """A message's destinations are found again while the same view objects come in its slot (in
    another list, too); a view replaced by another object, or a message in another slot, has them
    worked out again, and the tables made for the old ones are dropped."""
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: True)
    views, dtypes = [torch.zeros(40_000, dtype=torch.bfloat16) for _ in range(3)], [torch.bfloat16] * 3
    header = [BITMAP, 4_000] * 3
    kept = sparse_codec.KeptTables()
    _both([(views, dtypes)], [header], kept, launched)
    dests = kept.destinations[0][3]
    _both([(list(views), list(dtypes))], [header], kept, launched)
    assert kept.destinations[0][3] is dests and len(kept.tables) == 1
    moved = [views[0], torch.zeros(40_000, dtype=torch.bfloat16), views[2]]
    with_kept, fresh = _both([(moved, dtypes)], [header], kept, launched)
    assert kept.destinations[0][3] is not dests and len(kept.tables) == 1 and with_kept == fresh
    assert kept.destinations[0][3][1].columns[0] != dests[1].columns[0]  # (the new view's start)


@pytest.mark.parametrize("fused", [True, False])
def test_a_destination_view_of_other_elements_than_its_box_is_refused(monkeypatch, fused):
    """A view of fewer (or more) elements than its box would be written past its end by the fused
    kernels: refused on either path, naming the slot and both counts, and nothing of the message
    is added."""
    monkeypatch.setattr(sparse_codec, "_on_kernel_device", lambda t: fused)
    n = 40_000
    layout = message_layout([BITMAP, 10, BITMAP, 10], [n, n], [2, 2], "m")
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 3, sparse_codec.KeptTables())
    views = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n - 1, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"^box slot 2: its destination view holds 39999 elements; the box has 40000$"):
        received.add_message(1, layout, [torch.bfloat16] * 2, _aligned(layout.nbytes), views)
    assert list(received._added) == [0, 0, 0] and not received._decodes
    assert received._fused is None or received._fused.boxes == 0


def test_a_view_not_aligned_to_its_elements_is_refused_for_a_fused_box_and_left_to_the_torch_path_otherwise(
    launched, monkeypatch
):
    """A bf16 view at an odd address cannot be written by the fused kernels: a bitmap box bound for
    it is refused, naming the address, and a dense one takes the torch path (as before the
    destinations were kept)."""
    monkeypatch.setattr(sparse_cuda, "usable", lambda device: True)
    n = 64
    odd = torch.frombuffer(bytearray(2 * n + 2), dtype=torch.bfloat16, offset=1, count=n)
    dense = message_layout([DENSE, n], [n], [2], "m")
    received = sparse_codec.BucketReceiver(torch.device("cpu"), 2, sparse_codec.KeptTables())
    received.add_message(0, dense, [torch.bfloat16], _aligned(dense.nbytes), [odd])
    assert list(received._added) == [1, 0] and len(received._decodes) == 1
    bitmap = message_layout([BITMAP, 3], [n], [2], "m")
    with pytest.raises(ValueError, match="is not aligned to its 2-byte elements"):
        received.add_message(1, bitmap, [torch.bfloat16], _aligned(bitmap.nbytes), [odd])
    assert list(received._added) == [1, 0]
