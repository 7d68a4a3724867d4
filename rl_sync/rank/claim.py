"""Which sync group a rank belongs to: one group at a time, and nothing outlives it.

A coordinator names its group with a `GroupTag` (a fresh token, the config's
name and a handle on the coordinator itself) in every describe. A rank held
by another group refuses, naming it, unless that group's coordinator is gone
(closed without telling the rank, killed, or its driver died): then the new
group takes the rank over and everything the old one left (sides described,
bindings, session) is dropped first. Closing a group releases its ranks; a
close from any other group leaves the rank alone.

Typical use (inside a rank)::

    if self.claim.take(tag, alive=self._rl_sync_owner_alive):
        ...  # a new membership: forget the state of any earlier group
    ...
    if self.claim.release(tag.token):
        ...  # this group's close: drop its session
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GroupTag:
    """One sync group as its ranks know it; `owner` (a coordinator handle) answers while the
    group lives (the rank's `alive` callable decides how to ask)."""

    token: str
    name: str
    owner: Any = None

    def __str__(self) -> str:
        return f"sync group {self.name!r} ({self.token})"


class Claim:
    """The group holding a rank, if any."""

    def __init__(self) -> None:
        self.tag: GroupTag | None = None

    def take(self, tag: GroupTag, alive: Callable[[Any], bool]) -> bool:
        """Join `tag`'s group; True when this starts a new membership. Raises `ValueError` while
        another group whose coordinator is alive holds the rank."""
        if not isinstance(tag, GroupTag):
            raise TypeError(f"a rank is described for a group tagged with a GroupTag, got {type(tag).__name__}")
        held = self.tag
        if held is not None and held.token == tag.token:
            return False
        if held is not None and alive(held.owner):
            raise ValueError(
                f"this actor is already in {held}, which is still open: an actor belongs to one sync "
                f"group at a time; close that group first (WeightSync.close), or put every worker in "
                f"one group ({tag} was refused)"
            )
        self.tag = tag
        return True

    def holds(self, token: str | None) -> bool:
        """Whether the group with `token` holds the rank (`None`: a caller that names no group)."""
        return token is None or (self.tag is not None and self.tag.token == token)

    def release(self, token: str | None) -> bool:
        """Leave the group with `token` (`None`: whichever holds the rank); False if another holds it."""
        if not self.holds(token):
            return False
        self.tag = None
        return True
