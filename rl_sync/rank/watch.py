"""Each round, what changed under the tensors a rank reads or writes, at a cost that follows what changed.

Between rounds, the process holding a rank's tensors may replace or move them:
a new object in the mapping its hook returned (`held["w"] = Destination(...)`),
a new tensor where a destination's `Slot` says the engine keeps its parameter
(`module.weight = Parameter(...)`), new storage for the same tensor (`p.data =
...`, `set_`, a storage resized to nothing and back), or the same memory laid
out anew in place (`resize_`, `t_()`, `as_strided_`). A `Watch` records, when a
side is resolved, each name's value, the objects it was resolved through
(`Link`s: a DTensor's local shard and layout, a slot's tensor) and the tensors
it reads or writes through; each round, `changed(mapping)` says which names
changed, for the cost of

* identity passes over the mapping's keys, values and links (C loops, tens of
  nanoseconds a name);
* one pass reading each distinct tensor's data pointer, and one reading the
  version counter of each tensor that others are cut from (`Tensor._version`,
  moved by every in-place op, those that change shape or strides included);
* the geometry (address, shape, strides, dtype, device) of only the tensors
  whose pointer or version moved, and of inference tensors (no version).

rl-sync reads and writes through aliases with version counters of their own
(`Tensor.data`), so its own writes move no version; a trainer's optimizer
moves every version each step, so a trainer checks its shards' geometry each
round after one. `resolve(changed)` resolves the changed names again: a
replaced value afresh, a moved tensor as it is now, a view whose parent moved
or was replaced cut again at the same place of the new one (which must have the
parent's shape, strides, dtype and device), else a `ValueError` naming the side,
rank and tensor. Not noticed: `.data =` giving a tensor another shape, strides
or dtype over the same memory at the same address (no op runs, so no version
moves); such a tensor is read or written where it was.

Typical use (what `TrainerRank` and `WorkerRank` do)::

    watch = Watch(mapping, resolve=source_bound, what="trainer rank 0")
    changed = watch.changed(mapping)       # [] in the usual round; None: other names
    if changed:
        again = watch.resolve(mapping, changed)
        ...                                # the side checks and uses `again`
        watch.record(again)
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from itertools import compress
from typing import Any, NamedTuple

import torch

from ..storage import Slot

_BASE = torch._C.TensorBase
_POINTER, _SIZE, _STRIDE = _BASE.data_ptr, _BASE.size, _BASE.stride
_DTYPE, _DEVICE, _VERSION = operator.attrgetter("dtype"), operator.attrgetter("device"), operator.attrgetter("_version")


class Link(NamedTuple):
    """An object a name was resolved through: `holder[key]` (`item`) or `getattr(holder, key)`."""

    holder: object
    key: str
    held: object
    item: bool


class Bound(NamedTuple):
    """One name as its side resolved it."""

    value: object
    """What the mapping held (a `Destination`, a DTensor, a `Sharded`, a tensor)."""
    links: tuple[Link, ...]
    local: torch.Tensor | None
    """The tensor the rank reads or writes (through an alias of its own)."""
    owner: torch.Tensor | None
    """What `local` was cut from (the slot's tensor, its `_base`), or `local` itself."""


class Rebound(NamedTuple):
    """A changed name resolved again, and why it changed."""

    bound: Bound
    why: str


def geometries(tensors: Sequence[torch.Tensor]) -> list[tuple]:
    """(data pointer, shape, strides, dtype, device) of each tensor, read in C loops."""
    columns = (_POINTER, _SIZE, _STRIDE, _DTYPE, _DEVICE)
    return list(zip(*(map(read, tensors) for read in columns)))


def bound(value: object, local: torch.Tensor | None, links: tuple[Link, ...] = (), slot: Slot | None = None) -> Bound:
    """`value` resolved to `local`: owned by what `slot` holds (watched through it), else by
    `local`'s `_base`, else by `local` itself."""
    if slot is not None:
        held = slot.holder.get(slot.key)
        return Bound(value, (*links, Link(slot.holder, slot.key, held, True)), local, held)
    owner = None if local is None else local if local._base is None else local._base
    return Bound(value, links, local, owner)


class Watch:
    """The names of one side of a rank, as last resolved, and the per-round check of the module
    docstring. `resolve(name, value)` resolves a value afresh (the side's rule); `what` names the
    side and rank in errors ("worker rank 1")."""

    def __init__(self, mapping: Mapping, resolve: Callable[[str, object], Bound], what: str):
        self.resolve_value, self.what = resolve, what
        self.bound = {name: resolve(name, value) for name, value in mapping.items()}
        self.geometry: dict[int, tuple] = {}
        self._index(list(self.bound.values()))

    def _index(self, fresh: list[Bound]) -> None:
        """The flat lists the per-round passes read, rebuilt from `self.bound`; the geometry of
        the tensors of `fresh` is read anew, every other tensor's kept."""
        news = [t for b in fresh for t in (b.local, b.owner) if t is not None]
        self.geometry.update(zip(map(id, news), geometries(news)))
        self.keys = list(self.bound)
        self.values = [b.value for b in self.bound.values()]
        links = [(i, link) for i, b in enumerate(self.bound.values()) for link in b.links]
        self.links = [_Links.of([(i, k) for i, k in links if k.item == item], item) for item in (True, False)]
        place: dict[int, int] = {}
        self.tensors: list[torch.Tensor] = []
        self.names_of: list[list[int]] = []
        cut_from: dict[int, set[int]] = {}
        for i, b in enumerate(self.bound.values()):
            mine = {self._place(t, place) for t in (b.local, b.owner) if t is not None}
            for k in mine:
                self.names_of[k].append(i)
            if b.owner is not None:
                cut_from.setdefault(place[id(b.owner)], set()).update(mine)
        self.geometry = {id(t): self.geometry[id(t)] for t in self.tensors}
        self.pointers = [self.geometry[id(t)][0] for t in self.tensors]
        counted = [k for k in cut_from if not self.tensors[k].is_inference()]
        self.counted = [self.tensors[k] for k in counted]
        self.versions = list(map(_VERSION, self.counted))
        self.sharing = [sorted(cut_from[k]) for k in counted]
        self.uncounted = sorted({m for k in cut_from if self.tensors[k].is_inference() for m in cut_from[k]})

    def _place(self, tensor: torch.Tensor, place: dict[int, int]) -> int:
        """`tensor`'s index in `self.tensors`, appended on first sight."""
        if id(tensor) not in place:
            place[id(tensor)] = len(self.tensors)
            self.tensors.append(tensor)
            self.names_of.append([])
        return place[id(tensor)]

    def changed(self, mapping: Mapping) -> list[int] | None:
        """Indices (in the order resolved) of the names that changed since they were resolved;
        None when `mapping` holds other names."""
        if list(mapping) != self.keys:
            return None
        values = list(mapping.values())
        changed = set() if all(map(operator.is_, values, self.values)) else set(_differ(values, self.values))
        changed.update(self._links_moved())
        for k in self._tensors_moved():
            changed.update(self.names_of[k])
        return sorted(changed)

    def _links_moved(self) -> list[int]:
        return [i for links in self.links for i in links.moved()]

    def _tensors_moved(self) -> list[int]:
        """Tensors whose geometry moved; a version moved with no geometry moved is taken as seen."""
        pointers = list(map(_POINTER, self.tensors))
        suspects = set() if pointers == self.pointers else set(_unequal(pointers, self.pointers))
        versions = list(map(_VERSION, self.counted))
        counters = [] if versions == self.versions else _unequal(versions, self.versions)
        for m in counters:
            suspects.update(self.sharing[m])
        suspects.update(self.uncounted)
        order = sorted(suspects)
        now = geometries([self.tensors[k] for k in order])
        moved = {k for k, g in zip(order, now) if g != self.geometry[id(self.tensors[k])]}
        for m in counters:
            if moved.isdisjoint(self.sharing[m]):
                self.versions[m] = versions[m]  # written in place, laid out as before
        return sorted(moved)

    def resolve(self, mapping: Mapping, changed: Sequence[int]) -> dict[str, Rebound]:
        """The changed names resolved again (see the module docstring), not yet recorded."""
        out = {}
        for i in changed:
            name = self.keys[i]
            b, value = self.bound[name], mapping[name]
            if value is not b.value or any(_held(link) is not link.held for link in b.links if not link.item):
                out[name] = Rebound(self.resolve_value(name, value), "replaced under its name")
            elif any(_held(link) is not link.held for link in b.links if link.item):
                out[name] = Rebound(self._moved(name, b), "replaced where its slot says it is kept")
            else:
                out[name] = Rebound(self._moved(name, b), "moved: new storage, or laid out anew in place")
        return out

    def _moved(self, name: str, b: Bound) -> Bound:
        """`b` as it is now that a tensor under it moved or its slot holds another one."""
        slot = next((link for link in b.links if link.item), None)
        owner = b.owner if slot is None else _held(slot)
        if b.local is None or b.owner is None or (slot is None and b.owner is b.local):
            return b
        if owner is b.owner and geometries([b.owner])[0] == self.geometry[id(b.owner)]:
            return b  # the view itself was moved: taken as it is now
        local = self._cut_again(name, b, owner)
        assert isinstance(owner, torch.Tensor)  # it was cut from
        links = tuple(link if not link.item else link._replace(held=owner) for link in b.links)
        return Bound(b.value, links, local, owner)

    def _cut_again(self, name: str, b: Bound, owner: object) -> torch.Tensor:
        """`b.local` cut at the same place of `owner`, which must be laid out as `b.owner` was."""
        assert b.local is not None and b.owner is not None  # only views are cut again
        was = self.geometry[id(b.owner)]
        now = geometries([owner])[0] if isinstance(owner, torch.Tensor) else None
        if now is None or now[1:] != was[1:]:
            seen = "no tensor" if now is None else _layout(now)
            raise ValueError(
                f"{self.what}: tensor {name!r} is cut from a tensor that was replaced or moved since the "
                f"group bound it (now {seen}; bound as {_layout(was)}); nothing was read or written; "
                "repair() binds it anew (the next push does, with auto_repair)"
            )
        assert isinstance(owner, torch.Tensor)  # `now` was read off it
        pointer, shape, strides, dtype, _ = self.geometry[id(b.local)]
        start = owner.storage_offset() * owner.element_size() + pointer - was[0]
        span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dtype.itemsize if b.local.numel() else 0
        if start < 0 or start % dtype.itemsize or start + span > owner.untyped_storage().nbytes():
            raise ValueError(
                f"{self.what}: tensor {name!r} cannot be cut again from the tensor its slot holds now: "
                f"bytes [{start}, {start + span}) of a storage of {owner.untyped_storage().nbytes()}, as "
                f"{dtype}; repair() binds it anew (the next push does, with auto_repair)"
            )
        local = torch.empty(0, dtype=dtype, device=owner.device)
        return local.set_(owner.untyped_storage(), start // dtype.itemsize, shape, strides)

    def record(self, again: Mapping[str, Rebound]) -> None:
        """Take `again` (from `resolve`, accepted by the side) as the names' resolution."""
        fresh = [r.bound for r in again.values()]
        self.bound.update(zip(again, fresh))
        self._index(fresh)


def _differ(a: list, b: list) -> list[int]:
    return list(compress(range(len(a)), map(operator.is_not, a, b)))


def _unequal(a: list, b: list) -> list[int]:
    return list(compress(range(len(a)), map(operator.ne, a, b)))


class _Links(NamedTuple):
    """Links of one kind (items or attributes) as columns, for a per-round pass in C loops."""

    names: list[int]
    holders: list
    keys: list[str]
    held: list
    get: Callable[[Any, str], Any]

    @classmethod
    def of(cls, links: list[tuple[int, Link]], item: bool) -> _Links:
        get = operator.getitem if item else getattr
        return cls(
            [i for i, _ in links],
            [k.holder for _, k in links],
            [k.key for _, k in links],
            [k.held for _, k in links],
            get,
        )

    def moved(self) -> list[int]:
        """The names whose link holds another object now (or none: a missing key or attribute)."""
        try:
            now = list(map(self.get, self.holders, self.keys))
        except (KeyError, AttributeError):
            now = [_get_or_none(self.get, h, k) for h, k in zip(self.holders, self.keys)]
        return list(compress(self.names, map(operator.is_not, now, self.held)))


def _held(link: Link) -> object:
    return _get_or_none(operator.getitem if link.item else getattr, link.holder, link.key)


def _get_or_none(get: Callable[[Any, str], Any], holder: object, key: str) -> object:
    try:
        return get(holder, key)
    except (KeyError, AttributeError):
        return None


def _layout(g: tuple) -> str:
    return f"shape {tuple(g[1])}, strides {g[2]}, {g[3]} on {g[4]}"
