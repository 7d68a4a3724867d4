"""Where a double-buffered worker receives, and how a received round becomes live.

With `SyncConfig.double_buffer` a worker's rounds land in a spare copy of what
it binds and become live only at commit, once the whole round succeeded on
every rank. Each storage behind the bound views commits one of two ways:

* **copy**: the spare is a contiguous copy of each bound view; commit copies it
  into the live view (the bound bytes, once, while the engine waits);
* **swap**: the spare is a copy of the whole storage; commit exchanges the
  memory behind the live storage and its spare (`rl_sync.rank.swap`, O(1) per
  storage), so every tensor and view of the live storage sees the new
  round at once. The spare then holds the previous round, so the next round
  that writes only part of it (sparse, `auto`, a subset of names) first catches
  it up from the live one: a copy made while the engine keeps serving. Only for
  storages whose every bound name the engine allows (`rl_sync_swappable`): those
  it reads through its tensors at each use, with no address captured (CUDA
  graphs) or memory tracked (sleep-mode pools) elsewhere.

When the engine replaces or moves a bound tensor (`rl_sync.rank.watch`),
`rebound` points the next commit at the new one; a swapped storage it lay in
commits by copy from then on.

Typical use (inside `rl_sync.rank.worker`)::

    shadows = Shadows.of(endpoints, keep=fallback_names, swappable=names)
    shadows.prepare(writes_all=False)                      # a sparse round next
    session.run(round_info, sources, shadows.endpoints)   # into the spares
    shadows.commit(swap=True)                              # live now
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import torch

from ..engine.endpoint import Endpoint
from .swap import can_swap, swap_memories


def _spare_view(view: torch.Tensor, spare: torch.UntypedStorage) -> torch.Tensor:
    """`view`'s elements in `spare`, a copy of its storage: same offset, shape and strides."""
    out = torch.empty(0, dtype=view.dtype, device=view.device)
    return out.set_(spare, view.storage_offset(), view.shape, view.stride())


def _copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    if dsts:
        torch._foreach_copy_(dsts, srcs)


@dataclass
class Swapped:
    """A storage committed by swap: the live one, its spare (a copy of it), the names bound in it."""

    live: torch.UntypedStorage
    spare: torch.UntypedStorage
    names: list[str]


@dataclass
class Shadows:
    """The spares of one worker's bound views (see the module docstring)."""

    endpoints: dict[str, Endpoint]
    """Where rounds write: the spare of each bound view, and the views kept as they are. A new
    dict after each swap, so a session compiles its round again (its copies may hold addresses)."""
    copied: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """(live view, contiguous spare) of each name committed by copy."""
    swapped: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """(live view, spare view) of each name in a storage committed by swap."""
    storages: list[Swapped] = field(default_factory=list)
    """Each storage committed by swap."""
    stale: bool = False
    """The spares of swapped storages hold the round before the live one (after a swap)."""
    swaps: int = 0
    """How many commits swapped storages (odd: each swapped storage's spare is the memory it had
    live at first; `alternate`)."""
    retiring: set[torch.device] = field(default_factory=set)
    """CUDA devices whose kernels queued before the last swap may still read the memory that is
    now the spares: `settle` waits for them before anything writes the spares."""

    @classmethod
    def of(cls, endpoints: Mapping[str, Endpoint], keep: Collection[str], swappable: Collection[str]) -> Shadows:
        """Spares for every endpoint but those named in `keep` (received as they are: fallbacks,
        loaded whole at commit). A storage is swapped when every bound name in it is in
        `swappable` and this process can swap (`rl_sync.rank.swap`)."""
        names_in: dict[int, list[str]] = {}
        for name, endpoint in endpoints.items():
            if name not in keep:
                names_in.setdefault(endpoint.tensor.untyped_storage().data_ptr(), []).append(name)
        shadows = cls(dict(endpoints), {}, {})
        for names in names_in.values():
            live = endpoints[names[0]].tensor.untyped_storage()
            if all(n in swappable for n in names) and can_swap():
                shadows.storages.append(Swapped(live, live.clone(), names))
                for name in names:
                    view = endpoints[name].tensor
                    shadows._shadow(name, shadows.swapped, view, _spare_view(view, shadows.storages[-1].spare))
                continue
            for name in names:
                view = endpoints[name].tensor
                shadows._shadow(name, shadows.copied, view, view.detach().clone(memory_format=torch.contiguous_format))
        return shadows

    def _shadow(self, name: str, pairs: dict, view: torch.Tensor, spare: torch.Tensor) -> None:
        pairs[name] = (view, spare)
        self.endpoints[name] = Endpoint(spare, self.endpoints[name].origin)

    def spare_of(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """`tensor`'s elements as the next commit will make them: its view in the spare of its
        storage, when that storage commits by swap (None otherwise)."""
        for swapped in self.storages:
            if tensor.untyped_storage().data_ptr() == swapped.live.data_ptr():
                return _spare_view(tensor, swapped.spare)
        return None

    def alternate(self, views: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`views` (where rounds write now: `endpoints`' tensors) as rounds write them after an odd
        number of commits that swap: each swapped name's live view, the rest as they are. What a
        colocated worker exports as its alternate face (`rl_sync.transport.cuda_ipc`)."""
        return {name: self.swapped[name][0] if name in self.swapped else view for name, view in views.items()}

    def settle(self) -> None:
        """Before anything writes the spares: the kernels queued before the last swap, which may
        read what is now the spares, have run. (Waited for here, by the next round, rather than at
        the commit, which an engine's steps wait for.)"""
        for device in self.retiring:
            torch.cuda.synchronize(device)
        self.retiring.clear()

    def prepare(self, writes_all: bool) -> None:
        """Before a round: stale spares catch up with the live round, unless the round writes every
        element of them (`writes_all`: a dense round of every tensor)."""
        self.settle()
        if self.stale and not writes_all:
            _copy([spare for _, spare in self.swapped.values()], [live for live, _ in self.swapped.values()])
        self.stale = False

    def check_rebound(self, names: Collection[str], what: str) -> None:
        """`ValueError`, naming the tensor, when `rebound` of `names` could not catch a stale spare
        up: its live storage was resized in place (`what`: the worker, in the message)."""
        if not self.stale:
            return
        for swapped in self.storages:
            name = next((n for n in swapped.names if n in names), None)
            if name is not None and swapped.live.nbytes() != swapped.spare.nbytes():
                raise ValueError(
                    f"{what}: {name!r} was laid out anew in place after a commit swapped its storage, whose "
                    "spare holds the round before, so nothing was written; repair() binds it anew (the next "
                    "push does, with auto_repair)"
                )

    def rebound(self, endpoints: Mapping[str, Endpoint], what: str) -> bool:
        """The engine's tensors for these names were bound anew (`rl_sync.rank.watch`): the next
        commit writes each spare into its new live view. A storage committed by swap with any of
        them in it commits by copy from now on (its spare, caught up first when stale, from the
        old live storage), as the storages no longer match. A name received as it is (`keep`) is
        received in its new endpoint: returns True when `endpoints` changed so (a new dict).
        `ValueError` as `check_rebound` says, before anything changed."""
        self.check_rebound(endpoints, what)
        self.settle()
        for swapped in [s for s in self.storages if any(n in endpoints for n in s.names)]:
            pairs = {n: self.swapped.pop(n) for n in swapped.names}
            if self.stale:
                _copy([spare for _, spare in pairs.values()], [live for live, _ in pairs.values()])
            self.copied.update(pairs)
            self.storages.remove(swapped)
        kept = {}
        for name, endpoint in endpoints.items():
            if name in self.copied:
                self.copied[name] = (endpoint.tensor, self.copied[name][1])
            else:
                kept[name] = endpoint
        if kept:
            self.endpoints = {**self.endpoints, **kept}
        return bool(kept)

    def commit(self, swap: bool) -> bool:
        """Make the spares live: swapped storages by swap when `swap` (else by copy: memory another
        process maps without the alternate face, `alternate`), first, all or none (a storage that
        no longer matches its spare refuses the commit before any live tensor changed); then
        copied views by copy, on this thread's stream. Kernels queued before a swap read the
        memory they were given, now the spares (`settle`). Returns whether any storage swapped
        (its tensors' addresses changed)."""
        swapping = swap and bool(self.storages)
        if swapping:
            swap_memories([s.live for s in self.storages], [s.spare for s in self.storages])
            self.retiring.update(s.live.device for s in self.storages if s.live.device.type == "cuda")
        by_copy = list(self.copied.values()) + ([] if swap else list(self.swapped.values()))
        _copy([live for live, _ in by_copy], [spare for _, spare in by_copy])
        if swapping:
            self.swaps += 1
            self.stale = True
            self.endpoints = dict(self.endpoints)
        return swapping

    def swapped_bytes(self) -> int:
        """Bytes of the bound views in storages committed by swap."""
        return sum(live.numel() * live.element_size() for live, _ in self.swapped.values())

    def swapped_storages(self) -> set[int]:
        """The live storages committed by swap (`UntypedStorage._cdata`): what a swap moves."""
        return {s.live._cdata for s in self.storages}
