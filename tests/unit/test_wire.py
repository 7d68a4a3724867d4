"""Wire codecs: round trips, strict decoding, and only ValueError on bad bytes."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import build_schedule
from rl_sync.wire.codec import SCHEMA_VERSION, decode, encode
from rl_sync.wire.plan_info import PlanInfo

from .strategies import layouts, shapes


@dataclass(frozen=True)
class Inner:
    size: int
    tag: str | None


@dataclass(frozen=True)
class Sample:
    name: str
    shape: tuple[int, ...]
    items: list[Inner]
    table: dict[str, float]
    blob: bytes
    ok: bool


SAMPLE = Sample("w", (2, 3), [Inner(1, None), Inner(2, "x")], {"a": 1.5}, b"\x00\x01", True)


def _envelope(body, schema=SCHEMA_VERSION, type_name="Sample"):
    return msgpack.packb({"schema": schema, "type": type_name, "zlib": False, "body": body}, use_bin_type=True)


def _body():
    return msgpack.unpackb(encode(SAMPLE), raw=False)["body"]


@pytest.mark.parametrize("compress", [False, True])
def test_round_trip(compress):
    assert decode(Sample, encode(SAMPLE, compress=compress)) == SAMPLE


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.pop("ok"), r"Sample: missing fields \['ok'\], unexpected fields \[\]"),
        (lambda b: b.update(extra=1), r"Sample: missing fields \[\], unexpected fields \['extra'\]"),
        (lambda b: b.update(ok=1), r"Sample.ok: expected bool, got int"),
        (lambda b: b.update(shape=[2, "3"]), r"Sample.shape\[1\]: expected int, got str"),
        (lambda b: b["items"][1].update(size=True), r"Sample.items\[1\].size: expected int, got bool"),
        (lambda b: b.update(table={"a": "x"}), r"Sample.table\['a'\]: expected float, got str"),
        (lambda b: b.update(blob="text"), r"Sample.blob: expected bytes, got str"),
    ],
)
def test_strict_decoding_names_the_field(mutate, message):
    body = _body()
    mutate(body)
    with pytest.raises(ValueError, match=message):
        decode(Sample, _envelope(body))


def test_schema_version_and_type_are_checked():
    with pytest.raises(ValueError, match=r"schema version 99 is not supported; expected 1"):
        decode(Sample, _envelope(_body(), schema=99))
    with pytest.raises(ValueError, match=r"expected a Sample message, got type 'Inner'"):
        decode(Sample, _envelope(_body(), type_name="Inner"))


def test_truncated_and_oversized_messages_are_refused():
    blob = encode(SAMPLE)
    for cut in range(len(blob)):
        with pytest.raises(ValueError):
            decode(Sample, blob[:cut])
    with pytest.raises(ValueError, match=r"exceeds the 10-byte limit"):
        decode(Sample, blob, max_bytes=10)


def test_compressed_bomb_is_refused():
    body = b"\x00" * (1 << 20)
    import zlib

    bomb = msgpack.packb({"schema": 1, "type": "Sample", "zlib": True, "body": zlib.compress(body)})
    with pytest.raises(ValueError, match=r"inflates past the 4096-byte limit"):
        decode(Sample, bomb, max_bytes=4096)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_only_raise_value_error(data):
    for cls in (Sample, PlanInfo):
        with contextlib.suppress(ValueError):
            decode(cls, data)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=5) | st.binary(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    )
)
def test_random_well_formed_msgpack_only_raises_value_error(body):
    for cls in (Sample, PlanInfo):
        with pytest.raises(ValueError):
            decode(cls, _envelope(body, type_name=cls.__name__))


@settings(max_examples=50, deadline=None)
@given(data=st.data())
def test_plan_info_round_trip_rebuilds_the_same_schedule(data):
    specs = []
    for i in range(data.draw(st.integers(1, 4))):
        shape = data.draw(shapes())
        specs.append(
            TensorSpec(
                f"layers.{i}.w", "bfloat16", shape, data.draw(layouts(shape)), data.draw(layouts(shape, start=64))
            )
        )
    schedule = build_schedule(plan_model(specs), bucket_bytes=data.draw(st.integers(1, 4096)))
    rebuilt = decode(PlanInfo, encode(PlanInfo.from_schedule(schedule), compress=True)).to_schedule()
    assert rebuilt.plan.specs == schedule.plan.specs
    assert rebuilt.cuts == schedule.cuts
    for rank in (0, 64):
        assert rebuilt.rank_slice(rank) == schedule.rank_slice(rank)


def test_plan_info_refuses_inconsistent_tables():
    layout = Layout(Mesh((1,)), (Replicate(),))
    other = Layout(Mesh((2,), start_rank=1), (Shard(0),))
    info = PlanInfo.from_schedule(build_schedule(plan_model([TensorSpec("w", "float32", (4,), layout, other)])))
    body = msgpack.unpackb(encode(info), raw=False)["body"]
    body["src_index"] = [5]
    with pytest.raises(ValueError, match=r"PlanInfo.src_index holds an index outside \[0, 2\)"):
        decode(PlanInfo, _envelope(body, type_name="PlanInfo"))
    body["src_index"], body["cuts"] = [0], [0, 7]
    with pytest.raises(ValueError, match=r"bucket cuts must rise strictly from 0 to the slab count 1"):
        decode(PlanInfo, _envelope(body, type_name="PlanInfo")).to_schedule()


def _plan_body() -> dict:
    layout = Layout(Mesh((1,)), (Replicate(),))
    other = Layout(Mesh((2,), start_rank=1), (Shard(0),))
    info = PlanInfo.from_schedule(build_schedule(plan_model([TensorSpec("w", "float32", (4,), layout, other)])))
    return msgpack.unpackb(encode(info), raw=False)["body"]


def test_a_message_of_too_many_items_is_refused_before_it_is_built():
    import zlib

    many = {"names": [[[]] * 400 for _ in range(3)]}  # 1,203 arrays from about 1 KB
    blob = msgpack.packb({"schema": 1, "type": "PlanInfo", "zlib": True, "body": zlib.compress(msgpack.packb(many))})
    with pytest.raises(ValueError, match=r"^PlanInfo: message holds more than 1000 items$"):
        decode(PlanInfo, blob, max_items=1000)
    one_array = msgpack.packb({"schema": 1, "type": "PlanInfo", "zlib": False, "body": [None] * 1001})
    with pytest.raises(ValueError, match=r"1001 exceeds max_array_len\(1000\)"):
        decode(PlanInfo, one_array, max_items=1000)
    bomb = zlib.compress(msgpack.packb([[]] * 9_000_000), 9)  # 9 MB of empty arrays in about 9 KB
    assert len(bomb) < 20_000
    with pytest.raises(ValueError, match=r"9000000 exceeds max_array_len\(8388608\)"):
        decode(PlanInfo, msgpack.packb({"schema": 1, "type": "PlanInfo", "zlib": True, "body": bomb}))


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("shapes", [[1 << 63]], r"PlanInfo.shapes\[0\]: ints must fit int64, got 9223372036854775808"),
        ("cuts", [0, 1 << 64 - 1], r"PlanInfo.cuts: ints must fit int64"),
        ("bucket_bytes", 1 << 63, r"PlanInfo.bucket_bytes: ints must fit int64"),
    ],
)
def test_ints_past_int64_are_refused_by_name(field, value, message):
    body = _plan_body()
    body[field] = value
    with pytest.raises(ValueError, match=message):
        decode(PlanInfo, _envelope(body, type_name="PlanInfo"))


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b.update(shapes=[[1 << 62]]), r"shape \(4611686018427387904,\) holds more than 2\*\*48 elements"),
        (lambda b: b["layouts"][1].update(ranks=[1, (1 << 62)]), r"mesh ranks must be ints in \[0, 1048576\)"),
        (
            lambda b: b["layouts"][1].update(mesh_shape=[1 << 21], ranks=[]),
            r"mesh shape \(2097152,\) holds 2097152 ranks, more than the 1048576",
        ),
    ],
)
def test_huge_shapes_and_ranks_are_refused_when_the_plan_is_rebuilt(mutate, message):
    body = _plan_body()
    mutate(body)
    with pytest.raises(ValueError, match=message):
        decode(PlanInfo, _envelope(body, type_name="PlanInfo")).to_schedule()


def test_a_schedule_of_too_many_slabs_is_refused_at_once():
    fsdp = Layout(Mesh((2,)), (Shard(0),))
    plan = plan_model([TensorSpec("w", "bfloat16", (1 << 24, 1), fsdp, Layout(Mesh((2,), start_rank=2), (Shard(0),)))])
    with pytest.raises(
        ValueError,
        match=r"^bucket_bytes=1 cuts this plan into 16777216 \(tensor, row band\) slabs, "
        r"more than the 524288 a schedule may hold; raise bucket_bytes$",
    ):
        build_schedule(plan, bucket_bytes=1)
    assert build_schedule(plan, bucket_bytes=1 << 20).num_buckets == 16  # 16 MiB per rank in 1 MiB bands
