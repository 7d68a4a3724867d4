"""Bad input never corrupts: every wire field corrupted, random bit flips, fuzzed sparse payloads."""

from __future__ import annotations

import contextlib
import dataclasses

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.engine import sparse_codec
from rl_sync.planning.layout import Layout, Mesh, Shard
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import build_schedule
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, encoded_nbytes
from rl_sync.transport.cuda_ipc import IpcExport, IpcRegion, IpcRendezvous, IpcTensor
from rl_sync.transport.gloo import GlooRendezvous
from rl_sync.transport.nccl import NcclRendezvous
from rl_sync.wire.codec import decode, encode
from rl_sync.wire.messages import InitInfo, RankReport, RankStats, RoundInfo, TensorReport
from rl_sync.wire.plan_info import LayoutInfo, PlanInfo

LAYOUT = LayoutInfo.of(Layout(Mesh((2,)), (Shard(0),)))
GLOO = GlooRendezvous("127.0.0.1", 1234)
REGIONS = (IpcRegion("legacy", 1024, handle=b"\x01" * 64), IpcRegion("vmm", 4 << 21, chunks=(2 << 21, 2 << 21)))
EXPORT = IpcExport(
    "uuid", REGIONS, (IpcTensor("w", 0, 512, (4, 2), (2, 1), "bfloat16"),), b"e", b"d", "/tmp/x/s", b"t" * 32
)
SAMPLES = [
    InitInfo(
        rank=1,
        world_size=4,
        num_trainers=2,
        worker_ranks=(2, 3),
        transport="gloo",
        rendezvous=encode(GLOO),
        prefix="p",
        timeout_s=5.0,
        join_timeout_s=4.0,
        sparse_baseline="device",
        integrity="keyed",
        interface="",
        secret=b"s" * 32,
    ),
    RoundInfo(3, "sparse", ("a", "b"), 10.0, True),
    RankStats(
        rank=0,
        role="trainer",
        version=1,
        mode="m2n",
        seconds=0.5,
        sent_bytes=10,
        received_bytes=0,
        zero_copy_bytes=10,
        staged_bytes=0,
        local_bytes=0,
        messages=1,
        buckets=1,
        staging_bytes=0,
        baseline_bytes=0,
        dense_bytes=0,
        changed_elements=0,
        encodings={"indices": 1},
        fallbacks=0,
    ),
    RankReport(0, "cpu", "", (TensorReport("w", "bfloat16", (4, 2), LAYOUT),), {"w": "reload"}, 16),
    EXPORT,
    GLOO,
    NcclRendezvous(tuple(range(128)), tuple(range(128, 256))),
    IpcRendezvous(EXPORT, "gloo", encode(GLOO)),
    PlanInfo.from_schedule(
        build_schedule(
            plan_model(
                [TensorSpec("w", "float32", (4, 2), LAYOUT.to_layout(), Layout(Mesh((2,), start_rank=2), (Shard(1),)))]
            )
        )
    ),
]
WRONG: list[object] = [None, "x", 1.5, -1, [], {}, b"\x00", True, [["nested"]], 2**63 - 1]


def _plain(value):
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def _fields(sample):
    return [f.name for f in dataclasses.fields(sample)]


def _envelope(sample, body):
    return msgpack.packb({"schema": 1, "type": type(sample).__name__, "zlib": False, "body": body}, use_bin_type=True)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: type(s).__name__)
def test_every_field_corrupted_is_refused_with_its_name(sample):
    cls, good = type(sample), msgpack.unpackb(encode(sample), raw=False)["body"]
    assert decode(cls, encode(sample)) == sample
    tried = 0
    for field in _fields(sample):
        missing = dict(good)
        missing.pop(field)
        with pytest.raises(ValueError, match=field):
            decode(cls, _envelope(sample, missing))
        for value in WRONG:
            bad = dict(good, **{field: value})
            try:
                decoded = decode(cls, _envelope(sample, bad))
            except ValueError:
                tried += 1
                continue
            got = _plain(getattr(decoded, field))
            same = got == float(value) if isinstance(got, float) and isinstance(value, int) else got == value
            assert same, f"{field} accepted {value!r} as {got!r}"
    extra = dict(good, intruder=1)
    with pytest.raises(ValueError, match="intruder"):
        decode(cls, _envelope(sample, extra))
    assert tried >= len(_fields(sample)) * 5


@settings(max_examples=400, deadline=None)
@given(index=st.integers(0, 10_000), sample=st.sampled_from(SAMPLES), bits=st.integers(0, 255))
def test_random_byte_corruption_only_raises_value_error(index, sample, bits):
    blob = bytearray(encode(sample))
    blob[index % len(blob)] ^= bits or 1
    with contextlib.suppress(ValueError):
        decode(type(sample), bytes(blob))


@settings(max_examples=300, deadline=None)
@given(
    code=st.sampled_from([INDICES, BLOCKED, BITMAP, DENSE]),
    seed=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 255)), min_size=1, max_size=4),
)
def test_corrupted_sparse_payloads_never_write_garbage(code, seed, flips):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(70_000 if code == BLOCKED else 300, generator=gen)
    cur = base.clone()
    idx = torch.randperm(base.numel(), generator=gen)[:20]
    cur[idx] += 1
    changes = sparse_codec.Changes(cur, base)
    k = changes.count
    block = torch.zeros(encoded_nbytes(code, base.numel(), k, 4), dtype=torch.uint8)
    sparse_codec.encode(code, changes, block)
    for at, bits in flips:
        block[at % block.numel()] ^= bits
    live = base.clone()
    index, values, ok = sparse_codec.decode(code, k, base.numel(), torch.float32, block)
    if bool(ok):
        sparse_codec.apply(code, live, index, values)
        assert index.numel() == 0 or (int(index.min()) >= 0 and int(index.max()) < base.numel())
    else:
        assert torch.equal(live, base)


@pytest.mark.parametrize(
    "sample, field, value, message",
    [
        (SAMPLES[0], "timeout_s", float("nan"), r"InitInfo.timeout_s must be > 0 and at most 604800 seconds, got nan"),
        (SAMPLES[0], "timeout_s", -1.0, r"InitInfo.timeout_s must be > 0"),
        (SAMPLES[0], "timeout_s", float("inf"), r"InitInfo.timeout_s must be > 0"),
        (GLOO, "store_port", 0, r"GlooRendezvous.store_port must be a port in \[1, 65535\], got 0"),
        (GLOO, "store_port", 70000, r"GlooRendezvous.store_port must be a port in \[1, 65535\], got 70000"),
        (SAMPLES[1], "timeout_s", float("nan"), r"RoundInfo.timeout_s must be > 0"),
        (SAMPLES[1], "timeout_s", 0.0, r"RoundInfo.timeout_s must be > 0"),
        (SAMPLES[1], "version", 0, r"RoundInfo.version must be > 0, got 0"),
    ],
)
def test_timeouts_ports_and_versions_out_of_range_are_refused_by_name(sample, field, value, message):
    body = msgpack.unpackb(encode(sample), raw=False)["body"]
    body[field] = value
    with pytest.raises(ValueError, match=message):
        decode(type(sample), _envelope(sample, body))


def test_a_rendezvous_out_of_range_is_refused_by_name():
    from rl_sync.vllm.service import Rendezvous

    good = msgpack.unpackb(encode(Rendezvous("127.0.0.1", 29500, "p", 5.0, b"s" * 32)), raw=False)["body"]
    for field, value, message in (
        ("port", -1, r"Rendezvous.port must be a port in \[1, 65535\], got -1"),
        ("timeout_s", float("nan"), r"Rendezvous.timeout_s must be > 0"),
    ):
        body = dict(good, **{field: value})
        blob = msgpack.packb({"schema": 1, "type": "Rendezvous", "zlib": False, "body": body})
        with pytest.raises(ValueError, match=message):
            decode(Rendezvous, blob)
