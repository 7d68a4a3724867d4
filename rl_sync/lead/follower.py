"""A rank of a led group in a process of its own: it follows trainer rank 0's posts.

Every rank of a framework's group makes the same calls (vLLM's
`trainer_init` / `send_weights`, verl's `send_weights` / `receive_weights`);
on a rank other than trainer rank 0, each such call reads and answers the
leader's posts (`rl_sync.lead.board`) until the step it stands for is done:
`connect` ends forming the group, `run` (or `commit`, double buffered) ends a
round. A `close` posted before that means the leader gave up (its own error
says why); this rank leaves the group and raises `LeaderClosed`.

Typical use::

    follower = Follower(RankHandler(rank, "trainer", index=0), posts, timeout_s=60)
    follower.until("connect")       # inside trainer_init
    follower.until("run")           # inside each send_weights
"""

from __future__ import annotations

from ..vllm.service import Op
from .board import Posts
from .handler import RankHandler


class LeaderClosed(RuntimeError):
    """Trainer rank 0 closed the group while this rank waited for its next call."""


class Follower:
    """Handles posts in order on one rank (see the module docstring)."""

    def __init__(self, handler: RankHandler, posts: Posts, timeout_s: float):
        self.handler, self.posts, self.timeout_s = handler, posts, timeout_s

    def until(self, *last: Op) -> Op:
        """Handle posts up to and including the first whose operation is one of `last`; returns it."""
        while True:
            op, message = self.posts.next(self.timeout_s)
            self.handler.handle(op, message)
            if op in last:
                return op
            if op == "close":
                raise LeaderClosed(
                    "rl-sync: trainer rank 0 closed the group (its own error names why); this rank left it"
                )
