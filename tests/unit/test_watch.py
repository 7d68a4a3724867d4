"""The per-round watch: every replacement or move is noticed, values written in place are not,
and a changed name is resolved to the memory its owner has now, at the place it had."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rl_sync.engine.sources import alias
from rl_sync.rank.tensors import geometries, tensor_table
from rl_sync.rank.trainer import source_bound
from rl_sync.rank.watch import Watch, bound
from rl_sync.storage import Slot

pytestmark = pytest.mark.usefixtures("each_scan")


@dataclass(frozen=True, eq=False)
class Held:
    """A destination-like value: a local tensor, maybe cut from what a slot holds."""

    local: torch.Tensor
    slot: Slot | None = None


def _resolve(name: str, value: Held):
    return bound(value, value.local, slot=value.slot)


class Engine:
    """Parameters, and the names a rank binds to them: q and k are slots of a fused parameter
    (found through its slot), w a whole parameter, v a view of one found through its `_base`."""

    def __init__(self):
        self.params = {
            "fused": torch.arange(24.0).reshape(6, 4),
            "whole": torch.arange(9.0).reshape(3, 3),
            "vec": torch.arange(5.0, dtype=torch.bfloat16),
        }
        self.places = {"q": ("fused", 0, 2), "k": ("fused", 2, 6), "w": ("whole", 0, 3), "v": ("vec", 1, 4)}
        self.mapping = {
            "q": Held(self.params["fused"][0:2], Slot(self.params, "fused")),
            "k": Held(self.params["fused"][2:6], Slot(self.params, "fused")),
            "w": Held(self.params["whole"]),
            "v": Held(self.params["vec"][1:4]),
        }
        self.owners = {"q": "fused", "k": "fused", "w": "whole", "v": "vec"}

    def names_of(self, param: str) -> set[str]:
        return {n for n, p in self.owners.items() if p == param}


def _write(engine: Engine, param: str) -> set[str]:
    engine.params[param].add_(1)
    return set()


def _new_storage(engine: Engine, param: str) -> set[str]:
    engine.params[param].data = engine.params[param].clone() * 2
    return engine.names_of(param)


def _set_clone(engine: Engine, param: str) -> set[str]:
    engine.params[param].set_(engine.params[param].clone())
    return engine.names_of(param)


def _replaced_in_slot(engine: Engine, param: str) -> set[str]:
    """A new tensor where the engine keeps the parameter (only the fused one has a slot)."""
    if param != "fused":
        return set()
    engine.params[param] = engine.params[param].clone() + 100
    return engine.names_of(param)


def _rebuilt(engine: Engine, param: str) -> set[str]:
    """A new parameter and new values for every name cut from it."""
    engine.params[param] = engine.params[param].clone() - 1
    for name in engine.names_of(param):
        _, start, stop = engine.places[name]
        old = engine.mapping[name]
        local = engine.params[param] if name == "w" else engine.params[param][start:stop]
        engine.mapping[name] = Held(local, old.slot)
    return engine.names_of(param)


OPS = {
    "write": _write,
    "new storage": _new_storage,
    "set_ clone": _set_clone,
    "replaced in slot": _replaced_in_slot,
    "rebuilt": _rebuilt,
}


def _check_resolved(engine: Engine, watch: Watch) -> None:
    """A write through each name's round alias lands in the memory the engine reads now, at the
    name's place."""
    for name, (param, start, stop) in engine.places.items():
        local = watch.bound[name].local
        assert local is not None
        marker = torch.full_like(local, 7 + start)
        alias(local).copy_(marker)
        assert torch.equal(engine.params[param][start:stop], marker), f"{name}: the write missed the live memory"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(sorted(OPS)), st.sampled_from(["fused", "whole", "vec"])), max_size=8))
def test_every_replacement_or_move_is_noticed_and_followed_and_writes_are_not(steps):
    engine = Engine()
    watch = Watch(engine.mapping, _resolve, "worker rank 0")
    assert watch.changed(engine.mapping) == []
    for op, param in steps:
        expected = OPS[op](engine, param)
        changed = watch.changed(engine.mapping)
        assert changed is not None and {watch.keys[i] for i in changed} == expected, (op, param)
        watch.record(watch.resolve(engine.mapping, changed))
        assert watch.changed(engine.mapping) == [], "recorded: nothing is seen twice"
        _check_resolved(engine, watch)


def test_values_written_in_place_are_read_once_then_cost_nothing(each_scan):
    engine = Engine()
    watch = Watch(engine.mapping, _resolve, "worker rank 0")
    engine.params["fused"].mul_(3)
    versions = getattr(watch.table, "versions", None)
    before = None if versions is None else list(versions)
    assert watch.changed(engine.mapping) == []
    if each_scan == "Python pass":
        assert watch.table.versions != before, "the new version is taken as seen once its geometry was checked"
    else:
        assert versions is None, "the C scan reads no version"


def test_another_layout_at_the_same_address_is_noticed_by_the_c_scan_only(each_scan):
    """`.data =` giving the same memory another shape moves no version and no pointer: the C
    scan, which compares the layout itself, notices it, the Python pass does not (README). A
    tensor of more than four dims, whose layout the C scan does not record, is compared in Python."""
    engine = Engine()
    engine.mapping["x"] = Held(torch.zeros(2, 1, 3, 1, 2))
    watch = Watch(engine.mapping, _resolve, "worker rank 0")
    whole = engine.params["whole"]
    whole.data = whole.data.view(9)
    seen = ["w"] if each_scan == "C scan" else []
    assert [watch.keys[i] for i in watch.changed(engine.mapping)] == seen
    engine.mapping["x"].local.data = torch.zeros(2, 1, 3, 1, 2)
    assert [watch.keys[i] for i in watch.changed(engine.mapping)] == [*seen, "x"]


@pytest.mark.parametrize(
    "move",
    [
        lambda t: t.resize_(2, 3),
        lambda t: t.t_(),
        lambda t: t.as_strided_((3, 3), (1, 3)),
        lambda t: t.unsqueeze_(0),
        lambda t: t.untyped_storage().resize_(0),
    ],
)
def test_a_tensor_laid_out_anew_in_place_is_noticed_even_after_a_failed_round(move):
    engine = Engine()
    watch = Watch(engine.mapping, _resolve, "worker rank 0")
    move(engine.params["whole"])
    assert [watch.keys[i] for i in watch.changed(engine.mapping)] == ["w"]
    assert [watch.keys[i] for i in watch.changed(engine.mapping)] == ["w"], "unrecorded (the side refused): seen again"


def test_a_view_whose_parent_was_laid_out_anew_cannot_be_cut_again_and_says_why():
    engine = Engine()
    watch = Watch(engine.mapping, _resolve, "worker rank 2")
    engine.params["fused"].resize_(3, 4)
    changed = watch.changed(engine.mapping)
    with pytest.raises(ValueError) as raised:
        watch.resolve(engine.mapping, changed)
    assert str(raised.value) == (
        "worker rank 2: tensor 'q' is cut from a tensor that was replaced or moved since the group bound it "
        "(now shape (3, 4), strides (4, 1), torch.float32 on cpu; bound as shape (6, 4), strides (4, 1), "
        "torch.float32 on cpu); nothing was read or written; repair() binds it anew (the next push does, "
        "with auto_repair)"
    )
    engine.params["fused"] = "not a tensor"
    with pytest.raises(ValueError, match=r"'q' is cut from a tensor .* \(now no tensor; bound as shape \(6, 4\)"):
        watch.resolve(engine.mapping, watch.changed(engine.mapping))
    del engine.params["fused"]
    assert [watch.keys[i] for i in watch.changed(engine.mapping)] == ["q", "k"], "a key gone from its slot"


def test_the_geometry_recorded_is_what_each_tensor_had_when_recorded(each_scan):
    tensors = [
        torch.zeros(4, 3),
        torch.zeros(1, 2, 1, 2, 1),  # (more dims than the C scan's rows hold)
        torch.zeros(2, 5, dtype=torch.bfloat16)[:, 1:4],
        torch.zeros(0, dtype=torch.int8),
        torch.zeros(2, 3, dtype=torch.float8_e4m3fn).t(),
        torch.zeros((), dtype=torch.float64),
    ]
    table = tensor_table()
    slots = [table.hold(t, name) for name, t in enumerate(tensors)]
    table.reread(slots)
    was = geometries(tensors)
    assert [table.recorded(k) for k in slots] == was
    tensors[0].data = torch.zeros(3, 4, dtype=torch.int32)
    tensors[1].data = torch.zeros(2, 1, 2, 1, 1)
    tensors[2].t_()
    tensors[4].data = torch.zeros(1, 2, 1, 3, 1, dtype=torch.float8_e4m3fn)
    tensors[5].data = torch.zeros(2, 2)
    assert table.moved() == [*slots[:3], *slots[4:]]
    assert [table.recorded(k) for k in slots] == was, "recorded, not read anew"
    table.reread(slots)
    assert [table.recorded(k) for k in slots] == geometries(tensors) and table.moved() == []
    tensors[1].data = torch.zeros(3)  # five dims to one
    table.reread([slots[1]])
    assert table.recorded(slots[1]) == geometries([tensors[1]])[0] and table.moved() == []
    table.release(tensors[4], 4)  # a slot of five dims freed, then taken by a tensor of one
    fresh = torch.ones(2)
    assert table.hold(fresh, 6) == slots[4]
    table.reread([slots[4]])
    assert table.recorded(slots[4]) == geometries([fresh])[0] and table.moved() == []


def test_other_names_are_not_a_change_but_no_answer():
    engine = Engine()
    watch = Watch(engine.mapping, _resolve, "worker rank 0")
    assert watch.changed({**engine.mapping, "extra": engine.mapping["w"]}) is None
    assert watch.changed(dict(reversed(engine.mapping.items()))) is None


class FakeDTensor:
    """What the watch reads of a DTensor: its local shard and its layout (`_spec`)."""

    def __init__(self, local: torch.Tensor, spec: object):
        self._local_tensor, self._spec = local, spec


def test_a_dtensor_is_watched_through_its_local_shard_and_layout():
    padded = torch.zeros(10)
    dtensor = FakeDTensor(padded[:8], "Shard(0)")
    sources = {"w": dtensor}
    watch = Watch(sources, source_bound, "trainer rank 0")
    b = watch.bound["w"]
    assert b.local is dtensor._local_tensor and b.owner is padded
    padded.add_(1)  # an optimizer step: written in place
    assert watch.changed(sources) == []
    dtensor._local_tensor = padded[:8]  # another local shard object
    assert watch.changed(sources) == [0]
    assert watch.resolve(sources, [0])["w"].why == "replaced under its name"
    watch.record(watch.resolve(sources, [0]))
    dtensor._spec = "Replicate()"
    assert watch.changed(sources) == [0]
    assert watch.changed({"w": dtensor}) == [0], "a new mapping object with the same contents is no change by itself"
