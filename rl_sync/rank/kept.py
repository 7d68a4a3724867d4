"""A worker's destinations as bound, followed round by round (`rl_sync.rank.watch`).

`KeptDestinations` holds the mapping `rl_sync_destinations` returned, the
entries bound from it, the shadows of double buffering, and the watch that
notices what changed under them. `follow()` binds the changed names anew and
says why each changed; what the session reads and writes (`entries`) is a new
object only when it changed, so a compiled round replays otherwise (a rebound
live weight under double buffering changes only the commit's target).

Typical use (what `WorkerRank` does)::

    kept = KeptDestinations(mapping, rank=1, double_buffer=False)
    session.run(..., dests=kept.entries.endpoints)
    rebound = kept.follow()          # {} in the usual round; else {name: why}
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..engine.aliasing import check_disjoint
from ..engine.endpoint import Endpoint
from ..engine.sources import Entries, checked_destination, worker_entries, worker_entry
from .watch import Bound, Watch, bound


class KeptDestinations:
    """One worker's bound destinations (see the module docstring)."""

    def __init__(self, mapping: Mapping, rank: int, double_buffer: bool):
        self.mapping, self.rank, self.what = mapping, rank, f"worker rank {rank}"
        self.live = worker_entries(mapping, rank)
        self.where = self.live.where()
        self.fallbacks = tuple(n for n, d in mapping.items() if d.fallback)
        self.watch = Watch(mapping, self._bound, self.what)
        self.shadow: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.entries = self.live
        if double_buffer:
            self.entries = Entries(self.live.reports, self._shadowed(self.live.endpoints))

    def _bound(self, name: str, value: object) -> Bound:
        dest = checked_destination(name, value, self.rank)
        return bound(dest, dest.local, slot=dest.slot)

    def _shadowed(self, endpoints: dict[str, Endpoint]) -> dict[str, Endpoint]:
        """Receive into contiguous shadows of the bound views; `commit` copies them in."""
        shadows, self.shadow = {}, {}
        for name, endpoint in endpoints.items():
            if name in self.fallbacks:
                shadows[name] = endpoint
                continue
            shadow = endpoint.tensor.detach().clone(memory_format=torch.contiguous_format)
            shadows[name] = Endpoint(shadow, endpoint.origin)
            self.shadow[name] = (endpoint.tensor, shadow)
        return shadows

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
        self.watch.record(again)
        self.live = live
        self._take(list(again))
        return {name: why for name, (_, why) in again.items()}

    def _take(self, names: list[str]) -> None:
        """Read and write the rebound `names` where `live` now says."""
        if self.shadow is None:
            self.entries = self.live
            return
        unshadowed = [n for n in names if n not in self.shadow]
        for name in names:
            if name in self.shadow:
                self.shadow[name] = (self.live.endpoints[name].tensor, self.shadow[name][1])
        if unshadowed:
            endpoints = dict(self.entries.endpoints)
            for name in unshadowed:
                endpoints.pop(name, None)
                if name in self.live.endpoints:
                    endpoints[name] = self.live.endpoints[name]
            self.entries = Entries(self.live.reports, endpoints)

    def commit(self) -> None:
        """Double buffering: copy every shadow into its live weight."""
        if self.shadow:
            pairs = list(self.shadow.values())
            torch._foreach_copy_([live for live, _ in pairs], [shadow for _, shadow in pairs])
