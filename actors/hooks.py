"""The hooks a user's actor defines to take part in weight sync, and the check that it does.

A trainer actor inherits `SyncTrainerMixin` and defines `TrainerHooks`; a
worker actor inherits `SyncWorkerMixin` and defines `WorkerHooks`, plus those
of `EngineHooks` it needs. When a group forms (`WeightSync.create`,
`replace_worker`), `check_hooks` reads each actor's methods off its handle on
the driver, so an actor lacking its mixin or a required hook is refused
there, naming the actor and the hook, before any actor is reached.

Typical use::

    @ray.remote
    class Learner(SyncTrainerMixin):            # satisfies TrainerHooks
        def rl_sync_sources(self):
            return dict(self.model.named_parameters())
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from ray.actor import ActorHandle

if TYPE_CHECKING:
    import torch

    from rl_sync.storage import Destination


class TrainerHooks(Protocol):
    """What a trainer actor defines (`rl_sync.rank.trainer` says how it is called and cached)."""

    def rl_sync_sources(self) -> Mapping[str, Any]:
        """`{checkpoint name: DTensor | Sharded | Tensor}`, this rank's shards, every round (a
        plain tensor is replicated on every trainer)."""
        ...


class WorkerHooks(Protocol):
    """What a worker actor defines (`rl_sync.rank.worker` says when it is called)."""

    def rl_sync_destinations(
        self, checkpoint: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]
    ) -> Mapping[str, Destination]:
        """Given the trainers' checkpoint (`{name: (dtype, global shape)}`), this rank's live
        storage for each name (`rl_sync.bind.Binder` builds them from rules); called whenever
        the group forms or is repaired. The mapping returned is kept and watched each round: a
        `Destination` replaced in it, or a weight the engine moved, is bound anew
        (`rl_sync.rank.worker`)."""
        ...


class EngineHooks(Protocol):
    """Optional worker hooks: a worker defines those it needs."""

    def rl_sync_load_fallbacks(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Load whole tensors bound as fallbacks, after each round that carried them; required
        when `rl_sync_destinations` binds any."""
        ...

    def rl_sync_weights_updated(self, names: tuple[str, ...] | None) -> None:
        """The live weights hold a round (`names`: its tensors, None for all): rebuild state
        derived from them, before the worker reports the new version."""
        ...

    def rl_sync_write_modes(self) -> dict[str, Literal["direct", "reload"]]:
        """Per name, whether the engine uses it as stored (`direct`) or processes it after a
        round (`reload`); `direct` for names left out."""
        ...

    def rl_sync_prepare(
        self, names: tuple[str, ...] | None, spare: Callable[[torch.Tensor], torch.Tensor | None]
    ) -> None:
        """With double buffering, once a round reached the shadows (on a staged round's thread,
        beside the running engine): prepare what `rl_sync_weights_updated` will need at the
        commit without touching the live weights (`spare(t)`: the next values of a bound tensor
        `t` whose storage the commit swaps, else None), so that the commit waits for less."""
        ...

    def rl_sync_swappable(self) -> Collection[str]:
        """With double buffering, the names whose memory a commit may swap with its shadow's (O(1)
        per storage, `rl_sync.rank.shadow`) instead of copying into it: those the engine reads
        through its tensors at every use, with no address captured elsewhere (CUDA graphs) and
        no memory tracked by an allocator of its own (sleep mode). None without this hook."""
        ...


_SIDES: dict[str, tuple[str, str, str]] = {
    "trainer": (
        "_rl_sync_trainer_entries",
        "rl_sync_sources",
        "rl_sync_sources() -> {name: DTensor | Sharded | Tensor} (actors.hooks.TrainerHooks)",
    ),
    "worker": (
        "_rl_sync_worker_entries",
        "rl_sync_destinations",
        "rl_sync_destinations(checkpoint) -> {name: Destination} (actors.hooks.WorkerHooks)",
    ),
}
"""Per side: the method its mixin provides, the hook it needs, and how that hook reads."""


def check_hooks(handle: ActorHandle, side: Literal["trainer", "worker"], label: str) -> None:
    """`TypeError`, naming `label` (e.g. 'trainer 1'), the actor's class and what is missing,
    unless the actor behind `handle` inherits `side`'s mixin and defines its hooks. Reads the
    methods Ray records on the handle: no call reaches the actor."""
    mixin, hook, usage = _SIDES[side]
    methods, name = set(dir(handle)), handle._ray_actor_creation_function_descriptor.class_name
    if mixin not in methods:
        raise TypeError(
            f"{label}: {name} is asked to be a {side} but does not inherit the {side} mixin "
            f"(actors.Sync{side.title()}Mixin)"
        )
    if hook not in methods:
        raise TypeError(f"{label}: {name} must define {usage}")
