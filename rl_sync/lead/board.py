"""The leader's calls to ranks in other processes, posted in the group's rendezvous store.

The ranks of a led group (`rl_sync.lead`) that run in processes of their own
are reached the way a vLLM engine service is (`rl_sync.vllm.driver`): each
call carries one `rl_sync.vllm.service` message and each rank answers under
`reply_key`. Here a call is a post: `BoardControl` is the `EngineControl`
that posts, in order under `post_key(prefix, n)`, and `Posts` reads them in
that order on a follower. The store authenticates every frame but does not
encrypt it, so a post never carries the group's secret: `BoardControl` blanks
it (in a request's reply address and in every rank's `InitInfo`) and
`Posts` puts back the one its follower holds.

Typical use::

    driver = ServiceDriver(BoardControl(store, prefix), ranks=3)   # the leader
    posts = Posts(store, prefix, secret)                           # a follower
    op, message = posts.next(timeout_s=60)
"""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta

from ..rendezvous import MemberStore
from ..vllm.service import CloseRequest, ConnectRequest, DescribeRequest, Op, RoundRequest, pack, unpack
from ..wire.codec import decode, encode
from ..wire.messages import InitInfo

BLANK = bytes(32)
"""Stands for the group's secret in a post."""
Request = DescribeRequest | ConnectRequest | RoundRequest | CloseRequest
REQUESTS: dict[Op, type[Request]] = {
    "describe": DescribeRequest,
    "connect": ConnectRequest,
    "run": RoundRequest,
    "commit": RoundRequest,
    "close": CloseRequest,
}
"""The message type of each operation."""


def post_key(prefix: str, n: int) -> str:
    return f"{prefix}/post/{n}"


def _with_secret(op: Op, message: bytes, secret: bytes) -> bytes:
    """`message` with every secret it carries set to `secret`: the reply address of each
    request, and each `InitInfo` of a connect."""
    request: Request = decode(REQUESTS[op], message)
    request = replace(request, reply=replace(request.reply, secret=secret))
    if isinstance(request, ConnectRequest):
        inits = tuple(encode(replace(decode(InitInfo, i), secret=secret)) for i in request.inits)
        request = replace(request, inits=inits)
    return encode(request)


class BoardControl:
    """Posts each call for the followers (see the module docstring); the leader's calls are
    sequential, so once a call is answered its post is read by all and goes with the next."""

    def __init__(self, store: MemberStore, prefix: str):
        self.store, self.prefix, self.posted = store, prefix, 0

    def _post(self, info: dict) -> None:
        op, message = unpack(info)
        if self.posted:
            self.store.delete_key(post_key(self.prefix, self.posted - 1))
        self.store.set(
            post_key(self.prefix, self.posted), json.dumps(pack(op, _with_secret(op, message, BLANK))).encode()
        )
        self.posted += 1

    init = update = _post

    def reset_prefix_cache(self) -> None:
        """Followers keep no generated text to invalidate."""


class Posts:
    """A follower's reading of the leader's posts, in order."""

    def __init__(self, store: MemberStore, prefix: str, secret: bytes):
        self.store, self.prefix, self.secret, self.read = store, prefix, secret, 0

    def next(self, timeout_s: float) -> tuple[Op, bytes]:
        """The next call: its operation and its message (holding this follower's secret); waits
        at most `timeout_s` seconds for the leader to post it."""
        key = post_key(self.prefix, self.read)
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except Exception as exc:  # the store's timeout, or a leader gone
            raise RuntimeError(
                f"rl-sync: trainer rank 0 posted no call within {timeout_s:g} s ({type(exc).__name__}: {exc}); "
                "every rank must make the same weight-transfer calls, and trainer rank 0 must be alive"
            ) from None
        op, message = unpack(json.loads(self.store.get(key)))
        self.read += 1
        return op, _with_secret(op, message, self.secret)
