"""The tensors a `rl_sync.rank.watch.Watch` reads each round, as aligned columns.

Each distinct tensor has a slot: the names that read or write through it, and
its data pointer, version counter and geometry as recorded. `moved()` reads
every pointer and every version in C loops (`map` over the columns), and the
geometry of only the slots whose pointer or version moved (and of inference
tensors, which keep no version); a slot freed by a name bound elsewhere holds a
shared empty tensor until a new tensor takes it, so no column is rebuilt when a
few names change.

    table = TensorTable()
    slot = table.hold(weight, name_index=3)
    table.reread([slot])
    moved = table.moved()        # slots whose geometry differs from the one recorded
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import compress, count

import torch

_BASE = torch._C.TensorBase
COLUMNS = (_BASE.data_ptr, _BASE.size, _BASE.stride, operator.attrgetter("dtype"))
"""Read off each tensor, in C loops: data pointer, shape, strides, dtype. (Not the device: a
tensor moved to another device has a new data pointer, the old storage being alive, held by the
round's alias, and CUDA addresses being unified with the host's.)"""
_POINTER, _VERSION = _BASE.data_ptr, operator.attrgetter("_version")
_EMPTY = torch.empty(0)
"""What a free slot holds: nothing moves it."""


def geometries(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """(data pointer, shape, strides, dtype) of each tensor."""
    return list(zip(*(map(read, tensors) for read in COLUMNS)))


class TensorTable:
    """Distinct tensors and what was recorded of them (see the module docstring)."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []
        self.versioned: list[torch.Tensor] = []
        """`tensors`, with `_EMPTY` for an inference tensor (whose version cannot be read)."""
        self.names: list[set[int]] = []
        self.pointers: list[int] = []
        self.versions: list[int] = []
        self.geometry: list[tuple] = []
        self.place: dict[int, int] = {}
        """Slot of each tensor, by `id`."""
        self.free: list[int] = []
        self.uncounted: set[int] = set()
        """Slots of inference tensors: their geometry is read every round."""

    def hold(self, tensor: torch.Tensor, name: int) -> int:
        """The slot of `tensor` (taken on first sight), now read through by name `name`; its
        pointer, version and geometry are recorded by the next `reread` of it."""
        slot = self.place.get(id(tensor))
        if slot is None:
            slot = self.free.pop() if self.free else self._grow()
            self.place[id(tensor)], self.tensors[slot] = slot, tensor
            inference = tensor.is_inference()
            self.versioned[slot] = _EMPTY if inference else tensor
            (self.uncounted.add if inference else self.uncounted.discard)(slot)
        self.names[slot].add(name)
        return slot

    def _grow(self) -> int:
        self.tensors.append(_EMPTY)
        self.versioned.append(_EMPTY)
        self.names.append(set())
        self.pointers.append(0)
        self.versions.append(0)
        self.geometry.append(())
        return len(self.tensors) - 1

    def release(self, tensor: torch.Tensor, name: int) -> None:
        """Name `name` no longer reads through `tensor`; a slot no name reads is freed."""
        slot = self.place[id(tensor)]
        self.names[slot].discard(name)
        if not self.names[slot]:
            del self.place[id(tensor)]
            self.tensors[slot] = self.versioned[slot] = _EMPTY
            self.uncounted.discard(slot)
            self.free.append(slot)
            self.reread([slot])

    def reread(self, slots: Iterable[int]) -> None:
        """Record the pointer, version and geometry of `slots` as they are now."""
        slots = sorted(set(slots))
        now = geometries([self.tensors[k] for k in slots])
        for k, geometry, version in zip(slots, now, map(_VERSION, [self.versioned[k] for k in slots])):
            self.geometry[k], self.pointers[k], self.versions[k] = geometry, geometry[0], version

    def slot_of(self, tensor: torch.Tensor) -> int:
        return self.place[id(tensor)]

    def moved(self) -> list[int]:
        """Slots whose geometry differs from the one recorded. A version that moved with the
        geometry as recorded (values written in place) is taken as seen; one whose geometry
        moved keeps its old version, so it is seen again until it is recorded anew."""
        pointers = list(map(_POINTER, self.tensors))
        versions = list(map(_VERSION, self.versioned))
        repointed = [] if pointers == self.pointers else _unequal(pointers, self.pointers)
        written = [] if versions == self.versions else _unequal(versions, self.versions)
        if not (repointed or written or self.uncounted):
            return []
        if len(written) == len(self.tensors):  # (every tensor written: an optimizer step)
            tensors, recorded, order = self.tensors, self.geometry, written
        else:
            order = sorted(set(repointed).union(written, self.uncounted))
            tensors = list(map(self.tensors.__getitem__, order))
            recorded, pointers = list(map(self.geometry.__getitem__, order)), list(map(pointers.__getitem__, order))
        now = zip(pointers, *(map(read, tensors) for read in COLUMNS[1:]))
        moved = list(compress(order, map(operator.ne, now, recorded)))
        if written:
            kept = [self.versions[k] for k in moved]
            self.versions = versions
            for k, version in zip(moved, kept):
                self.versions[k] = version
        return moved


def _unequal(a: list, b: list) -> list[int]:
    return list(compress(count(), map(operator.ne, a, b)))
