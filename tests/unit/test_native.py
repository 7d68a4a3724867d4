"""The C scan of `rl_sync.rank.native`: what it reports, and how it refuses bad arguments."""

from __future__ import annotations

import pytest
import torch

from rl_sync.rank import native


@pytest.fixture(scope="module")
def scan():
    module = native.scan()
    assert module is not None, "the C scan builds and loads on this machine"
    return module


def _rows(scan, tensors: list[torch.Tensor]) -> torch.Tensor:
    rows = torch.zeros(len(tensors), native.ROW, dtype=torch.int64)
    scan.record(tensors, rows, list(range(len(tensors))))
    return rows


def test_every_change_of_layout_is_reported_and_values_written_in_place_are_not(scan):
    tensors = [torch.zeros(4, 3) for _ in range(7)]
    with torch.inference_mode():
        tensors.append(torch.zeros(2))
    rows = _rows(scan, tensors)
    with torch.inference_mode():
        for t in tensors:
            t.add_(1)  # values written in place (an inference tensor too)
    assert scan.moved(tensors, rows) == []
    tensors[1].data = torch.zeros(4, 3)  # new storage
    tensors[2].t_()  # strides and shape
    tensors[3].data = tensors[3].data.view(torch.int32)  # dtype, same memory
    tensors[4].untyped_storage().resize_(0)  # storage freed
    tensors[5].data = tensors[5].data[1:]  # same storage, another offset
    assert scan.moved(tensors, rows) == [1, 2, 3, 4, 5]
    scan.record(tensors, rows, [1, 2])
    assert scan.moved(tensors, rows) == [3, 4, 5], "what is recorded anew is no longer reported"


def test_more_than_four_dims_are_not_recorded(scan):
    tensors = [torch.zeros(1, 2, 1, 2, 1), torch.zeros(1, 2, 1, 2), torch.zeros(3, 1, 1, 1, 1)]
    rows = torch.zeros(len(tensors), native.ROW, dtype=torch.int64)
    assert scan.record(tensors, rows, [2, 1, 0]) == [2, 0], "the slots left unrecorded, in the order given"
    assert rows[:, 1].tolist()[0] == native.UNRECORDED and rows[1, 1] != native.UNRECORDED
    tensors[0].data = torch.zeros(3)
    assert scan.moved(tensors, rows) == []


def test_identities_and_held_objects(scan):
    a, b = [object() for _ in range(4)], []
    b[:] = a
    b[2] = object()
    assert scan.differ(a, b) == [2]
    holders = [{"k": a[0]}, {}, {"k": a[2]}]
    assert scan.held_moved(holders, ["k", "k", "k"], [a[0], a[1], a[3]], True) == [1, 2]

    class Box:
        k = a[0]

    assert scan.held_moved([Box(), object()], ["k", "k"], [a[0], a[0]], False) == [1]


def test_bad_arguments_are_refused_saying_what_was_expected(scan):
    rows = torch.zeros(1, native.ROW, dtype=torch.int64)
    with pytest.raises(TypeError, match=r"^tensors must be a list, got tuple$"):
        scan.moved((torch.zeros(1),), rows)
    with pytest.raises(TypeError, match=r"^an item of tensors is a int, not a tensor$"):
        scan.moved([3], rows)
    rows_expected = r"^rows must be a contiguous CPU int64 tensor of at least 2 rows of 10 words$"
    with pytest.raises(ValueError, match=rows_expected):
        scan.moved([torch.zeros(1), torch.zeros(1)], rows)
    with pytest.raises(IndexError, match=r"^slot 4 is outside the 1 tensors$"):
        scan.record([torch.zeros(1)], rows, [4])
    with pytest.raises(ValueError, match=r"^differ: lists of 1 and 2 items$"):
        scan.differ([1], [1, 2])
    with pytest.raises(TypeError, match="unhashable"):  # (only a missing key or attribute counts as moved)
        scan.held_moved([{}], [["unhashable"]], [None], True)


def test_a_dict_is_compared_with_its_names_and_values_in_one_pass(scan):
    values = [object() for _ in range(4)]
    names = [f"w.{i}" for i in range(4)]
    mapping = dict(zip(names, values))
    assert scan.mapping_differ(mapping, names, values) == []
    mapping["w.2"] = object()
    assert scan.mapping_differ(mapping, names, values) == [2]
    assert scan.mapping_differ(mapping, ["".join(["w.", str(i)]) for i in range(4)], values) == [2], "equal names"
    assert scan.mapping_differ(dict(reversed(list(mapping.items()))), names, values) is None, "another order"
    assert scan.mapping_differ({**mapping, "w.4": None}, names, values) is None, "another count"
    assert scan.mapping_differ(dict(zip(["w.0", "w.1", "x", "w.3"], values)), names, values) is None, "another name"
    with pytest.raises(TypeError, match=r"must be dict, not list"):
        scan.mapping_differ([], names, values)
    with pytest.raises(ValueError, match=r"^mapping_differ: lists of 4 and 3 items$"):
        scan.mapping_differ(mapping, names, values[:3])


def test_the_cpp_swap_exchanges_the_memory_behind_storages_and_refuses_what_does_not_match():
    """What PyTorch releases without `UntypedStorage._swap_data_ptr_` swap through."""
    from rl_sync.rank import swap

    module = native.swap()
    assert module is not None, "the C++ swap builds and loads on this machine"
    live = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    spare = torch.full((6,), 9.0)
    view, addresses = live[1], (live.data_ptr(), spare.data_ptr())
    module.swap([live.untyped_storage()._cdata], [spare.untyped_storage()._cdata])
    assert (spare.data_ptr(), live.data_ptr()) == addresses
    assert torch.equal(live, torch.full((2, 3), 9.0)) and torch.equal(view, torch.full((3,), 9.0))
    assert spare.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    del spare  # frees what was the live tensor's memory; the live one keeps the spare's
    assert torch.equal(live * 1, torch.full((2, 3), 9.0))
    short, other, fits = torch.zeros(2), torch.ones(3), torch.full((3,), 5.0)
    cdata = lambda *tensors: [t.untyped_storage()._cdata for t in tensors]  # noqa: E731
    expected = r"^swap: storages of 24 bytes on cpu and 8 bytes on cpu; expected the same size on the same device$"
    with pytest.raises(ValueError, match=expected):
        module.swap(cdata(other, live), cdata(fits, short))
    with pytest.raises(ValueError, match=expected):
        swap.swap_memory(live.untyped_storage(), short.untyped_storage())
    null = r"^swap: b\[1\] is a null StorageImpl address; expected UntypedStorage._cdata$"
    with pytest.raises(ValueError, match=null):
        module.swap(cdata(other, live), [fits.untyped_storage()._cdata, 0])
    not_an_int = r"^swap: a\[0\] is a torch.storage.UntypedStorage, not UntypedStorage._cdata \(an int\)$"
    with pytest.raises(TypeError, match=not_an_int):
        module.swap([live.untyped_storage()], cdata(short))
    with pytest.raises(TypeError, match=r"^swap: b must be a list of UntypedStorage._cdata, got tuple$"):
        module.swap(cdata(live), tuple(cdata(short)))
    with pytest.raises(ValueError, match=r"^swap: lists of 1 and 2 storages; expected pairs$"):
        module.swap(cdata(live), cdata(short, other))
    assert torch.equal(live, torch.full((2, 3), 9.0)) and short.tolist() == [0.0, 0.0], "a refusal changes nothing"
    assert other.tolist() == [1.0] * 3 and fits.tolist() == [5.0] * 3, "nor the pairs before the one refused"
    module.swap(cdata(other, fits), cdata(fits, other))  # a storage swapped twice in one call: back as it was
    assert other.tolist() == [1.0] * 3 and fits.tolist() == [5.0] * 3
