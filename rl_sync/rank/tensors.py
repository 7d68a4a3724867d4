"""The tensors a `rl_sync.rank.watch.Watch` reads each round, as aligned columns.

Each distinct tensor has a slot: the names that read or write through it, and
its geometry (data pointer, shape, strides, dtype) as recorded (`recorded`). A
slot freed by a name bound elsewhere holds a shared empty tensor until a new
tensor takes it, so no column is rebuilt when a few names change. `moved()` says
which slots' geometry differs from the one recorded, in one of two ways:

* `LayoutTable` (where `rl_sync.rank.native` is built): one C pass compares
  every tensor's pointer, shape, strides, dtype and device with a row recorded
  for it; values written in place cost nothing. Recording is a C pass too (a
  staged commit records every tensor it swapped, each commit), and a slot's
  geometry is read back from its row when asked for.
* `VersionTable` (the Python pass): every data pointer and every version
  counter in C loops (`map` over the columns), then the geometry of only the
  slots whose pointer or version moved (and of inference tensors, which keep no
  version).

    table = tensor_table()
    slot = table.hold(weight, name=3)
    table.reread([slot])
    moved = table.moved()        # slots whose geometry differs from the one recorded
    pointer, shape, strides, dtype = table.recorded(slot)
"""

from __future__ import annotations

import functools
import operator
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from itertools import compress, count
from types import ModuleType

import torch

from . import native

_BASE = torch._C.TensorBase
COLUMNS = (_BASE.data_ptr, _BASE.size, _BASE.stride, operator.attrgetter("dtype"))
"""Read off each tensor, in C loops: data pointer, shape, strides, dtype. (Not the device: a
tensor moved to another device has a new data pointer, the old storage being alive, held by the
round's alias, and CUDA addresses being unified with the host's.)"""
_POINTER, _VERSION = _BASE.data_ptr, operator.attrgetter("_version")
_MAX_DIM = (native.ROW - 2) // 2
"""Dims a row holds (sizes, then strides, after the pointer and the packed word)."""
_EMPTY = torch.empty(0)
"""What a free slot holds: nothing moves it."""


def geometries(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """(data pointer, shape, strides, dtype) of each tensor."""
    return list(zip(*(map(read, tensors) for read in COLUMNS)))


def tensor_table() -> TensorTable:
    """A `LayoutTable` where the C scan is built, else a `VersionTable`."""
    scan = native.scan()
    return VersionTable() if scan is None else LayoutTable(scan)


class TensorTable(ABC):
    """Distinct tensors and what was recorded of them (see the module docstring); a subclass
    records what its `moved()` compares."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.names: list[set[int]] = []
        self.place: dict[int, int] = {}
        """Slot of each tensor, by `id`."""
        self.free: list[int] = []

    def hold(self, tensor: torch.Tensor, name: int) -> int:
        """The slot of `tensor` (taken on first sight), now read through by name `name`; what is
        recorded of it is recorded by the next `reread` of it."""
        slot = self.place.get(id(tensor))
        if slot is None:
            slot = self.free.pop() if self.free else self._grow()
            self.place[id(tensor)], self.tensors[slot] = slot, tensor
            self._took(slot, tensor)
        self.names[slot].add(name)
        return slot

    def _grow(self) -> int:
        self.tensors.append(_EMPTY)
        self.names.append(set())
        return len(self.tensors) - 1

    def _took(self, slot: int, tensor: torch.Tensor) -> None:  # noqa: B027 (optional hook)
        """Hook: `slot` holds `tensor` now (`_EMPTY`: it was freed)."""

    def release(self, tensor: torch.Tensor, name: int) -> None:
        """Name `name` no longer reads through `tensor`; a slot no name reads is freed."""
        slot = self.place[id(tensor)]
        self.names[slot].discard(name)
        if not self.names[slot]:
            del self.place[id(tensor)]
            self.tensors[slot] = _EMPTY
            self._took(slot, _EMPTY)
            self.free.append(slot)
            self.reread([slot])

    def reread(self, slots: Iterable[int]) -> None:
        """Record `slots` as they are now."""
        self._record(sorted(set(slots)))

    @abstractmethod
    def _record(self, slots: list[int]) -> None:
        """Record the geometry of `slots`, and what `moved()` compares of them."""

    @abstractmethod
    def recorded(self, slot: int) -> tuple:
        """The geometry recorded of `slot`: (data pointer, shape, strides, dtype)."""

    def slot_of(self, tensor: torch.Tensor) -> int:
        return self.place[id(tensor)]

    @abstractmethod
    def moved(self) -> list[int]:
        """Slots whose geometry differs from the one recorded; a slot whose geometry moved is
        seen again until it is recorded anew."""

    def _differs(self, order: list[int]) -> list[int]:
        """The slots of `order` whose geometry differs from the one recorded."""
        now = geometries([self.tensors[k] for k in order])
        return list(compress(order, map(operator.ne, now, map(self.recorded, order))))


class LayoutTable(TensorTable):
    """Rows of every tensor's layout, compared in one C pass (`rl_sync.rank.native`)."""

    def __init__(self, scan: ModuleType) -> None:
        super().__init__()
        self.scan = scan
        self.rows = torch.empty(0, native.ROW, dtype=torch.int64)
        self.unrecorded: dict[int, tuple] = {}
        """The geometry of each slot whose layout the scan does not compare (`native.UNRECORDED`):
        compared here."""

    def _grow(self) -> int:
        slot = super()._grow()
        if slot == len(self.rows):
            self.rows = torch.cat([self.rows, torch.zeros(max(slot, 64), native.ROW, dtype=torch.int64)])
        return slot

    def _record(self, slots: list[int]) -> None:
        unrecorded = self.scan.record(self.tensors, self.rows, slots)
        if self.unrecorded:
            for k in slots:
                self.unrecorded.pop(k, None)
        if unrecorded:
            self.unrecorded.update(zip(unrecorded, geometries([self.tensors[k] for k in unrecorded])))

    def recorded(self, slot: int) -> tuple:
        if slot in self.unrecorded:
            return self.unrecorded[slot]
        return _decoded(self.rows[slot].tolist(), self.scan)

    def moved(self) -> list[int]:
        moved = self.scan.moved(self.tensors, self.rows)
        if self.unrecorded:
            moved = sorted(set(moved).union(self._differs(sorted(self.unrecorded))))
        return moved


class VersionTable(TensorTable):
    """Pointer and version columns read in Python's C loops (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.geometry: list[tuple] = []
        self.versioned: list[torch.Tensor] = []
        """`tensors`, with `_EMPTY` for an inference tensor (whose version cannot be read)."""
        self.pointers: list[int] = []
        self.versions: list[int] = []
        self.uncounted: set[int] = set()
        """Slots of inference tensors: their geometry is read every round."""

    def _grow(self) -> int:
        self.geometry.append(())
        self.versioned.append(_EMPTY)
        self.pointers.append(0)
        self.versions.append(0)
        return super()._grow()

    def _took(self, slot: int, tensor: torch.Tensor) -> None:
        inference = tensor.is_inference()
        self.versioned[slot] = _EMPTY if inference else tensor
        (self.uncounted.add if inference else self.uncounted.discard)(slot)

    def _record(self, slots: list[int]) -> None:
        for k, geometry in zip(slots, geometries([self.tensors[k] for k in slots])):
            self.geometry[k] = geometry
        for k, version in zip(slots, map(_VERSION, [self.versioned[k] for k in slots])):
            self.pointers[k], self.versions[k] = self.geometry[k][0], version

    def recorded(self, slot: int) -> tuple:
        return self.geometry[slot]

    def moved(self) -> list[int]:
        """A version that moved with the geometry as recorded (values written in place) is taken
        as seen; one whose geometry moved keeps its old version."""
        pointers = list(map(_POINTER, self.tensors))
        versions = list(map(_VERSION, self.versioned))
        repointed = [] if pointers == self.pointers else _unequal(pointers, self.pointers)
        written = [] if versions == self.versions else _unequal(versions, self.versions)
        if not (repointed or written or self.uncounted):
            return []
        moved = self._differs(sorted(set(repointed).union(written, self.uncounted)))
        if written:
            kept = [self.versions[k] for k in moved]
            self.versions = versions
            for k, version in zip(moved, kept):
                self.versions[k] = version
        return moved


def _decoded(row: list[int], scan: ModuleType) -> tuple:
    """The geometry a recorded row holds (see `native.ROW`)."""
    dim = row[1] & 0xFF
    shape, strides = row[2 : 2 + dim], row[2 + _MAX_DIM : 2 + _MAX_DIM + dim]
    return row[0], torch.Size(shape), tuple(strides), _dtypes(scan)[(row[1] >> 8) & 0xFF]


@functools.cache
def _dtypes(scan: ModuleType) -> dict[int, torch.dtype]:
    """Each dtype by the code the scan records it with (learnt by recording a tensor of each)."""
    kinds = dict.fromkeys(t for t in vars(torch).values() if isinstance(t, torch.dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (experimental and deprecated dtypes say so)
        samples = [t for t in map(_sample, kinds) if t is not None]
    rows = torch.zeros(len(samples), native.ROW, dtype=torch.int64)
    scan.record(samples, rows, list(range(len(samples))))
    return {(code >> 8) & 0xFF: t.dtype for code, t in zip(rows[:, 1].tolist(), samples)}


def _sample(dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor of `dtype`, made whichever way this build allows (None: no way, so no tensor has it)."""
    for make in (lambda: torch.empty(1, dtype=dtype), lambda: torch.empty(8, dtype=torch.uint8).view(dtype)):
        try:
            return make()
        except Exception:  # (each build refuses some dtypes some way: RuntimeError, TypeError, ...)
            continue
    return None


def _unequal(a: list, b: list) -> list[int]:
    return list(compress(count(), map(operator.ne, a, b)))
