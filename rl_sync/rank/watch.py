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

* identity passes over the mapping's keys, values and links;
* one pass comparing each distinct tensor's data pointer, shape, strides, dtype
  and device with what was recorded (`rl_sync.rank.tensors`).

Both run in C loops of `rl_sync.rank.native` (a few nanoseconds a name for
identities, tens for a tensor) where it is built; else in Python's C loops
(`map`: tens of nanoseconds a name), and the tensor pass reads each data pointer
and version counter (`Tensor._version`, moved by every in-place op, those that
change shape or strides included), then the geometry of only the tensors whose
pointer or version moved, and of inference tensors (no version). rl-sync reads
and writes through aliases with version counters of their own (`Tensor.data`),
so its own writes move no version; a trainer's optimizer moves every version
each step, so the Python pass reads a trainer's shards' geometry each round
after one. `resolve(changed)` resolves the changed names again: a
replaced value afresh, a moved tensor as it is now, a view whose parent moved
or was replaced cut again at the same place of the new one (which must have the
parent's shape, strides, dtype and device), else a `ValueError` naming the side,
rank and tensor. Not noticed by the Python pass: `.data =` giving a tensor
another shape, strides or dtype over the same memory at the same address (no op
runs, so no version moves); such a tensor is read or written where it was.

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
from collections.abc import Callable, Collection, Mapping, Sequence
from itertools import compress
from typing import Any, NamedTuple

import torch

from ..storage import Slot
from . import native
from .tensors import geometries, tensor_table


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

    def tensors(self) -> list[torch.Tensor]:
        """`local` and `owner`, once each."""
        out = [] if self.local is None else [self.local]
        if self.owner is not None and self.owner is not self.local:
            out.append(self.owner)
        return out


class Rebound(NamedTuple):
    """A changed name resolved again, and why it changed."""

    bound: Bound
    why: str


def bound(value: object, local: torch.Tensor | None, links: tuple[Link, ...] = (), slot: Slot | None = None) -> Bound:
    """`value` resolved to `local`: owned by what `slot` holds (watched through it), else by
    `local`'s `_base`, else by `local` itself."""
    if slot is not None:
        held = slot.holder.get(slot.key)
        if not isinstance(held, torch.Tensor):
            raise TypeError(
                f"a destination's slot {slot.key!r} holds {type(held).__name__}, not the tensor it is cut from"
            )
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
        self.keys = list(self.bound)
        self.index = {name: i for i, name in enumerate(self.keys)}
        self.values = [b.value for b in self.bound.values()]
        scan = native.scan()
        self.differ: Callable[[list, list], list[int]] = _differ if scan is None else scan.differ
        self.mapping_differ = None if scan is None else scan.mapping_differ
        self.held_moved = None if scan is None else scan.held_moved
        self.table = tensor_table()
        slots = [self.table.hold(t, i) for i, b in enumerate(self.bound.values()) for t in b.tensors()]
        self.table.reread(slots)
        self._link_columns()

    def _link_columns(self) -> None:
        links = [(i, link) for i, b in enumerate(self.bound.values()) for link in b.links]
        self.links = [
            _Links.of([(i, k) for i, k in links if k.item == item], item, self.held_moved) for item in (True, False)
        ]
        self.link_at: dict[int, list[int]] = {}
        """Positions of each name's links in their columns, in its `links` order."""
        for column in self.links:
            for position, i in enumerate(column.names):
                self.link_at.setdefault(i, []).append(position)

    def changed(self, mapping: Mapping) -> list[int] | None:
        """Indices (in the order resolved) of the names that changed since they were resolved;
        None when `mapping` holds other names."""
        values = self._values_changed(mapping)
        if values is None:
            return None
        changed = set(values)
        for links in self.links:
            changed.update(links.moved())
        for slot in self.table.moved():
            changed.update(self.table.names[slot])
        return sorted(changed)

    def _values_changed(self, mapping: Mapping) -> list[int] | None:
        """Indices of the names whose value is another object; None when `mapping` holds other
        names (or the same in another order). A dict is walked in one C pass where it is built."""
        if self.mapping_differ is not None and type(mapping) is dict:
            return self.mapping_differ(mapping, self.keys, self.values)
        if len(mapping) != len(self.keys):
            return None
        keys = list(mapping)
        if self.differ(keys, self.keys) and keys != self.keys:
            return None  # (the same names as other string objects compare equal)
        return self.differ(list(mapping.values()), self.values)

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

    def _recorded(self, tensor: torch.Tensor) -> tuple:
        return self.table.recorded(self.table.slot_of(tensor))

    def _moved(self, name: str, b: Bound) -> Bound:
        """`b` as it is now that a tensor under it moved or its slot holds another one."""
        slot = next((link for link in b.links if link.item), None)
        owner = b.owner if slot is None else _held(slot)
        if b.local is None or b.owner is None or (slot is None and b.owner is b.local):
            return b
        if owner is b.owner and geometries([b.owner])[0] == self._recorded(b.owner):
            return b  # the view itself was moved: taken as it is now
        local = self._cut_again(name, b, owner)
        assert isinstance(owner, torch.Tensor)  # it was cut from
        links = tuple(link if not link.item else link._replace(held=owner) for link in b.links)
        return Bound(b.value, links, local, owner)

    def _cut_again(self, name: str, b: Bound, owner: object) -> torch.Tensor:
        """`b.local` cut at the same place of `owner`, which must be laid out as `b.owner` was."""
        assert b.local is not None and b.owner is not None  # only views are cut again
        was = self._recorded(b.owner)
        tensor = owner if isinstance(owner, torch.Tensor) else None
        now = None if tensor is None else geometries([tensor])[0]
        if tensor is None or now is None or now[1:] != was[1:] or tensor.device != b.local.device:
            seen = "no tensor" if tensor is None or now is None else _layout(now, tensor.device)
            raise ValueError(
                f"{self.what}: tensor {name!r} is cut from a tensor that was replaced or moved since the "
                f"group bound it (now {seen}; bound as {_layout(was, b.local.device)}); nothing was read or "
                "written; repair() binds it anew (the next push does, with auto_repair)"
            )
        pointer, shape, strides, dtype = self._recorded(b.local)
        storage = tensor.untyped_storage()
        start = tensor.storage_offset() * tensor.element_size() + pointer - was[0]
        span = (sum((n - 1) * s for n, s in zip(shape, strides)) + 1) * dtype.itemsize if b.local.numel() else 0
        if start < 0 or start % dtype.itemsize or start + span > storage.nbytes():
            raise ValueError(
                f"{self.what}: tensor {name!r} cannot be cut again from the tensor its slot holds now: "
                f"bytes [{start}, {start + span}) of a storage of {storage.nbytes()}, as {dtype}; repair() "
                "binds it anew (the next push does, with auto_repair)"
            )
        local = torch.empty(0, dtype=dtype, device=tensor.device)
        return local.set_(storage, start // dtype.itemsize, shape, strides)

    def record(self, again: Mapping[str, Rebound]) -> None:
        """Take `again` (from `resolve`, accepted by the side) as the names' resolution; costs what
        those names hold, not what the others do (unless their links take another form)."""
        held: list[int] = []
        relink = False
        for name, (new, _) in again.items():
            i, old = self.index[name], self.bound[name]
            for tensor in old.tensors():
                self.table.release(tensor, i)
            held.extend(self.table.hold(tensor, i) for tensor in new.tensors())
            self.bound[name], self.values[i] = new, new.value
            relink = relink or not self._relinked(i, old, new)
        self.table.reread(held)
        if relink:
            self._link_columns()

    def _relinked(self, i: int, old: Bound, new: Bound) -> bool:
        """Put `new`'s links where `old`'s were; False when they take another form."""
        if [link.item for link in old.links] != [link.item for link in new.links]:
            return False
        for link, position in zip(sorted(new.links, key=lambda k: not k.item), self.link_at.get(i, [])):
            self.links[0 if link.item else 1].set(position, link)
        return True

    def over(self, storages: Collection[int]) -> list[int]:
        """The slots of the tensors over `storages` (their `UntypedStorage._cdata`)."""
        return [k for k, t in enumerate(self.table.tensors) if t.numel() and t.untyped_storage()._cdata in storages]

    def settle(self, slots: Sequence[int]) -> None:
        """Record the tensors of `slots` as they are now: rl-sync itself moved their memory (a
        double-buffered commit's swap), so it is no change of the engine's."""
        self.table.reread(slots)

    def sharing(self, again: Mapping[str, Rebound]) -> set[str]:
        """The names of `again` and every name that reads or writes through a tensor one of them
        did or does now (what may share memory with them), before `record`."""
        out = set(again)
        for name, (new, _) in again.items():
            for tensor in self.bound[name].tensors() + new.tensors():
                slot = self.table.place.get(id(tensor))
                if slot is not None:
                    out.update(self.keys[i] for i in self.table.names[slot])
        return out


def _differ(a: list, b: list) -> list[int]:
    return list(compress(range(len(a)), map(operator.is_not, a, b)))


class _Links(NamedTuple):
    """Links of one kind (items or attributes) as columns, for a per-round pass in C loops."""

    names: list[int]
    holders: list
    keys: list[str]
    held: list
    item: bool
    held_moved: Callable[[list, list, list, bool], list[int]] | None
    """The C pass (`rl_sync.rank.native`), or None: Python's C loops."""

    @classmethod
    def of(cls, links: list[tuple[int, Link]], item: bool, held_moved) -> _Links:
        return cls(
            [i for i, _ in links],
            [k.holder for _, k in links],
            [k.key for _, k in links],
            [k.held for _, k in links],
            item,
            held_moved,
        )

    def set(self, position: int, link: Link) -> None:
        self.holders[position], self.keys[position], self.held[position] = link.holder, link.key, link.held

    def moved(self) -> list[int]:
        """The names whose link holds another object now (or none: a missing key or attribute)."""
        if self.held_moved is not None:
            return [self.names[i] for i in self.held_moved(self.holders, self.keys, self.held, self.item)]
        get = operator.getitem if self.item else getattr
        try:
            now = list(map(get, self.holders, self.keys))
        except (KeyError, AttributeError):
            now = [_get_or_none(get, h, k) for h, k in zip(self.holders, self.keys)]
        return list(compress(self.names, map(operator.is_not, now, self.held)))


def _held(link: Link) -> object:
    return _get_or_none(operator.getitem if link.item else getattr, link.holder, link.key)


def _get_or_none(get: Callable[[Any, str], Any], holder: object, key: str) -> object:
    try:
        return get(holder, key)
    except (KeyError, AttributeError):
        return None


def _layout(geometry: tuple, device: torch.device) -> str:
    return f"shape {tuple(geometry[1])}, strides {geometry[2]}, {geometry[3]} on {device}"
