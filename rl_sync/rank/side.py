"""What a rank is told when it is asked to play a side, and what it keeps of it.

The coordinator asks each rank to describe the side (trainer or worker) it
plays with `DescribeOptions`; the rank records them with its side rank and
size as a `Side`. The options travel through Ray calls, never on rl-sync's
own wire (the group's `GroupTag` holds the coordinator's actor handle; a vLLM
engine service gets their worker part as a `DescribeRequest`).

Typical use (inside the coordinator)::

    options = DescribeOptions(group=tag, checkpoint={"w": ("float32", (8, 8))}, sharded={"w": (0,)})
    member.describe("worker", first_rank, num_workers, options)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..config.lora import LoraSpec
from .claim import GroupTag


@dataclass(frozen=True, kw_only=True)
class DescribeOptions:
    """The coordinator's options to `_rl_sync_describe` (see `rl_sync.rank.protocol`)."""

    group: GroupTag | None = None
    """The group asking: a rank another live group holds refuses (`rl_sync.rank.claim`). None:
    no membership check (a vLLM service's rank, which its engine holds)."""
    checkpoint: Mapping[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    """Worker side: the trainers' checkpoint, `{name: (dtype name, global shape)}`."""
    sharded: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Worker side: the dims the trainers shard each tensor along in a way no part can be cut
    from (several mesh axes on one dim, a scale grid: `rl_sync.planning.parts.uncuttable_dims`);
    a binding never cuts those into parts."""
    double_buffer: bool = False
    """Worker side: receive into shadow copies and switch the live weights once the whole round
    succeeded (`SyncConfig.double_buffer`)."""
    lora: LoraSpec | None = None
    """Worker side: the checkpoint is this LoRA adapter, bound to a LoRA slot of each engine
    (`WeightSync.create(..., lora=...)`); None: model weights."""
    next_writes_all: bool = False
    """Worker side: what comes next writes every element this rank binds (a joining engine's
    catch-up by relay, or the full round after it), so buffers the binding allocates need not
    start from the live values (vLLM's loader-form buffers: `rl_sync.vllm.binding`); the rank
    reports no version until then (it may not be the source of another engine's catch-up)."""

    def __post_init__(self) -> None:
        if self.group is not None and not isinstance(self.group, GroupTag):
            raise TypeError(f"DescribeOptions.group must be a GroupTag or None, got {type(self.group).__name__}")
        if self.lora is not None and not isinstance(self.lora, LoraSpec):
            raise TypeError(f"DescribeOptions.lora must be a LoraSpec or None, got {type(self.lora).__name__}")
        for flag in ("double_buffer", "next_writes_all"):
            if not isinstance(getattr(self, flag), bool):
                raise TypeError(f"DescribeOptions.{flag} must be True or False, got {getattr(self, flag)!r}")
        for name, entry in self.checkpoint.items():
            if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str) and _dims(entry[1])):
                raise TypeError(
                    f"DescribeOptions.checkpoint[{name!r}] must be (dtype name, shape tuple), got {entry!r}"
                )
        for name, dims in self.sharded.items():
            if not _dims(dims):
                raise TypeError(f"DescribeOptions.sharded[{name!r}] must be a tuple of dims, got {dims!r}")


def _dims(value: object) -> bool:
    return isinstance(value, tuple) and all(isinstance(d, int) and not isinstance(d, bool) for d in value)


class Side(NamedTuple):
    """One side a rank plays in its group, as it was described."""

    rank: int
    """The rank within its side (trainer rank, or worker-side rank)."""
    size: int
    """How many ranks play that side."""
    options: DescribeOptions
