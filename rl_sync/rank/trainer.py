"""The sending side of a rank: a trainer's shards as sources.

Define `rl_sync_sources()` returning `{checkpoint name: DTensor | Sharded | Tensor}`
(a plain tensor is replicated on every trainer). It is called every round; a
`rl_sync.rank.watch.Watch` notices what changed since the last one (a new
object under a name, a DTensor given another local shard or layout, a shard
given new storage or laid out anew in place) at a cost that follows what
changed, and only those names are resolved again: the compiled round is
replayed when nothing changed. A shard whose dtype, shape or layout no longer
matches the plan fails the round, naming tensor and rank, before this rank
sends anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..engine.sources import Entries, local_tensor, trainer_entries, trainer_entry
from .participant import Participant
from .side import DescribeOptions
from .watch import Bound, Link, Watch, bound


class SourcesSeen(NamedTuple):
    """What this trainer's sources resolved to, as of the last round."""

    side: tuple[int, int]
    """(trainer rank, number of trainers)."""
    watch: Watch
    entries: Entries
    where: dict[str, int]
    """`entries.where()`."""


def source_bound(name: str, value: object) -> Bound:
    """A trainer's `value` resolved to its local shard; a DTensor is watched through the local
    shard and layout it holds."""
    local = local_tensor(value, name)
    if hasattr(value, "_spec"):
        links = tuple(Link(value, key, getattr(value, key), False) for key in ("_local_tensor", "_spec"))
        return bound(value, local, links)
    return bound(value, local)


def _shard(local: torch.Tensor | None) -> torch.Tensor:
    assert local is not None  # a trainer's value always resolves to a tensor
    return local


class TrainerRank(Participant):
    """Inherit and define `rl_sync_sources()`."""

    _rl_sync_seen: SourcesSeen | None = None

    def _rl_sync_sources_now(self) -> Mapping:
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
        return tensors

    def _rl_sync_trainer_entries(self, rank: int, size: int, options: DescribeOptions) -> Entries:
        tensors, seen = self._rl_sync_sources_now(), self._rl_sync_seen
        changed = None if seen is None or seen.side != (rank, size) else seen.watch.changed(tensors)
        if changed == []:
            assert seen is not None  # changed is a list only for what was seen
            return seen.entries
        if changed is None:  # (bound anew: the group forms or was repaired, not every round)
            config = getattr(tensors, "config", None)  # (`rl_sync.lora.adapter_sources`: the adapter's)
            if options.lora is not None and config is not None:
                options.lora.check_matches(config, f"trainer rank {rank}")
            entries = trainer_entries(tensors, rank, size)
            watch = Watch(tensors, source_bound, f"trainer rank {rank}")
            self._rl_sync_seen = SourcesSeen((rank, size), watch, entries, entries.where())
            return entries
        assert seen is not None  # as above
        again = seen.watch.resolve(tensors, changed)
        resolved = {name: trainer_entry(name, b.value, _shard(b.local), rank, size) for name, (b, _) in again.items()}
        entries = seen.entries.updated(resolved, f"trainer rank {rank}", seen.where)
        seen.watch.record(again)
        self._rl_sync_seen = seen._replace(entries=entries)
        return entries

    def _rl_sync_leave(self, abort: bool) -> None:
        super()._rl_sync_leave(abort)
        self._rl_sync_seen = None
