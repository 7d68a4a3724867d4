"""The sending side of a rank: a trainer's shards as sources.

Define `rl_sync_sources()` returning `{checkpoint name: DTensor | Sharded | Tensor}`
(a plain tensor is replicated on every trainer). It is called every round;
when it returns the same mapping holding the same tensor objects as last
round, the compiled round is replayed as is (no per-tensor work), anything
else is resolved afresh. A trainer that swaps a tensor's storage in place
(`p.data = ...`) must return a new mapping so the change is seen.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

from ..engine.sources import trainer_entries
from .participant import Participant


class TrainerRank(Participant):
    """Inherit and define `rl_sync_sources()`."""

    _rl_sync_source_cache: tuple | None = None

    def _rl_sync_trainer_entries(self, rank: int, size: int, options: dict):
        sources = getattr(self, "rl_sync_sources", None)
        if sources is None:
            raise TypeError(f"{type(self).__name__} must define rl_sync_sources() -> {{name: DTensor | Sharded | Tensor}}")
        tensors: Mapping = sources()
        cache = self._rl_sync_source_cache
        if (cache is not None and cache[0] is tensors and cache[1] == (rank, size) and len(cache[2]) == len(tensors)
                and all(map(operator.is_, tensors.values(), cache[2]))):
            return cache[3]
        entries = trainer_entries(tensors, rank, size)
        self._rl_sync_source_cache = (tensors, (rank, size), list(tensors.values()), entries)
        return entries
