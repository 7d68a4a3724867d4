"""A worker's destinations as bound, followed round by round (`rl_sync.rank.watch`).

`KeptDestinations` holds the mapping `rl_sync_destinations` returned, the
entries bound from it, the shadows of double buffering (`rl_sync.rank.shadow`),
and the watch that notices what changed under them. `follow()` binds the changed names anew and
says why each changed; what the session reads and writes (`entries`) is a new
object only when it changed, so a compiled round replays otherwise (a rebound
live weight under double buffering changes only the commit's target).

Typical use (what `WorkerRank` does)::

    kept = KeptDestinations(mapping, rank=1, double_buffer=False, swappable=())
    session.run(..., dests=kept.entries.endpoints)
    rebound = kept.follow()          # {} in the usual round; else {name: why}
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from ..engine.aliasing import check_disjoint
from ..engine.sources import Entries, checked_destination, worker_entries, worker_entry
from .shadow import Shadows
from .watch import Bound, Watch, bound


class KeptDestinations:
    """One worker's bound destinations (see the module docstring)."""

    def __init__(self, mapping: Mapping, rank: int, double_buffer: bool, swappable: Collection[str] = ()):
        """`swappable`: the names the engine lets a commit swap the memory of (`Shadows.of`)."""
        self.mapping, self.rank, self.what = mapping, rank, f"worker rank {rank}"
        self.live = worker_entries(mapping, rank)
        self.where = self.live.where()
        self.fallbacks = tuple(n for n, d in mapping.items() if d.fallback)
        self.watch = Watch(mapping, self._bound, self.what)
        self.shadow: Shadows | None = None
        self.entries = self.live
        self._swapped_slots: list[int] | None = None
        """The watch's slots of the tensors over storages a commit swaps, once asked for."""
        if double_buffer:
            self.shadow = Shadows.of(self.live.endpoints, self.fallbacks, swappable)
            self.entries = Entries(self.live.reports, self.shadow.endpoints)

    def _bound(self, name: str, value: object) -> Bound:
        dest = checked_destination(name, value, self.rank)
        return bound(dest, dest.local, slot=dest.slot)

    def moved(self) -> bool:
        """Whether anything changed under the bound names since they were bound (nothing is bound
        anew: see `follow`); also when the mapping names other tensors."""
        return self.watch.changed(self.mapping) != []

    def follow(self) -> dict[str, str]:
        """Bind anew what changed since the last call; returns why each rebound name changed.
        `ValueError`, naming rank and tensor, for what cannot be bound without re-planning."""
        changed = self.watch.changed(self.mapping)
        if changed is None:
            raise ValueError(
                f"{self.what}: the destinations mapping now names {sorted(self.mapping)[:8]}, the group bound "
                f"{sorted(self.watch.keys)[:8]}; repair() binds it anew (the next push does, with auto_repair)"
            )
        if not changed:
            return {}
        again = self.watch.resolve(self.mapping, changed)
        resolved = {}
        for name, (b, _) in again.items():
            dest = checked_destination(name, b.value, self.rank)
            if dest.fallback != (name in self.fallbacks):
                raise ValueError(
                    f"{self.what}: destination {name!r} is {'now' if dest.fallback else 'no longer'} a fallback; "
                    "repair() binds it anew (the next push does, with auto_repair)"
                )
            resolved[name] = worker_entry(name, dest, b.local, self.rank)
        live = self.live.updated(resolved, self.what, self.where)
        near = self.watch.sharing(again)  # (what shares memory with a rebound name shares a tensor)
        check_disjoint({name: live.endpoints[name].tensor for name in near if name in live.endpoints}, self.rank)
        if self.shadow is not None:  # (refused before anything is recorded: the next call sees it again)
            self.shadow.check_rebound(again, self.what)
        self.watch.record(again)
        self.live = live
        self._take(list(again))
        return {name: why for name, (_, why) in again.items()}

    def _take(self, names: list[str]) -> None:
        """Read and write the rebound `names` where `live` now says."""
        self._swapped_slots = None
        if self.shadow is None:
            self.entries = self.live
        elif self.shadow.rebound({n: self.live.endpoints[n] for n in names if n in self.live.endpoints}, self.what):
            self.entries = Entries(self.live.reports, self.shadow.endpoints)

    def commit(self, swap: bool) -> None:
        """Double buffering: make every shadow live (`Shadows.commit`); where storages swapped,
        the session reads new entries and the watch records their tensors anew (rl-sync moved
        their memory, not the engine)."""
        if self.shadow is None or not self.shadow.commit(swap):
            return
        self.entries = Entries(self.live.reports, self.shadow.endpoints)
        if self._swapped_slots is None:
            self._swapped_slots = self.watch.over(self.shadow.swapped_storages())
        self.watch.settle(self._swapped_slots)
