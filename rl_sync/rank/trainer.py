"""The sending side of a rank: a trainer's shards as sources.

Define `rl_sync_sources()` returning `{checkpoint name: DTensor | Sharded | Tensor}`
(a plain tensor is replicated on every trainer). It is called every round;
when it returns the same mapping holding the same tensor objects, each with
the storage address, shape, strides and dtype of last round, the compiled
round is replayed as is; anything else is resolved afresh (a storage swapped
in place, `p.data = ...`, is followed), and a shard whose geometry no longer
matches the plan fails the round, naming tensor and rank, before this rank
sends anything.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import NamedTuple

from ..engine.sources import Entries, local_tensor, trainer_entries
from ..storage import geometry
from .participant import Participant
from .side import DescribeOptions


class SourceCache(NamedTuple):
    """What the last round's sources resolved to, and what they looked like then."""

    sources: Mapping
    """The mapping `rl_sync_sources()` returned."""
    side: tuple[int, int]
    """(trainer rank, number of trainers)."""
    tensors: list
    """The objects it held (DTensors, `Sharded`s, tensors), in order."""
    geometry: list[tuple]
    """Each local shard's `_geometry` then."""
    entries: Entries


class TrainerRank(Participant):
    """Inherit and define `rl_sync_sources()`."""

    _rl_sync_source_cache: SourceCache | None = None

    def _rl_sync_trainer_entries(self, rank: int, size: int, options: DescribeOptions) -> Entries:
        sources = getattr(self, "rl_sync_sources", None)
        if sources is None:
            raise TypeError(
                f"{type(self).__name__} must define rl_sync_sources() -> {{name: DTensor | Sharded | Tensor}}"
            )
        tensors = sources()
        if not isinstance(tensors, Mapping):
            raise TypeError(
                f"{type(self).__name__}.rl_sync_sources() must return a mapping of name to tensor, got "
                f"{type(tensors).__name__}"
            )
        cache, shards = self._rl_sync_source_cache, _geometry(tensors)
        if (
            cache is not None
            and cache.sources is tensors
            and cache.side == (rank, size)
            and len(cache.tensors) == len(tensors)
            and all(map(operator.is_, tensors.values(), cache.tensors))
            and shards == cache.geometry
        ):
            return cache.entries
        entries = trainer_entries(tensors, rank, size)
        self._rl_sync_source_cache = SourceCache(tensors, (rank, size), list(tensors.values()), shards, entries)
        return entries

    def _rl_sync_leave(self, abort: bool) -> None:
        super()._rl_sync_leave(abort)
        self._rl_sync_source_cache = None


def _geometry(tensors: Mapping) -> list[tuple]:
    """Where each local shard lives and how it is laid out (storage address, shape, strides,
    dtype): a tensor resized, reshaped or moved in place since the last round differs here."""
    return [geometry(local_tensor(value, name)) for name, value in tensors.items()]
