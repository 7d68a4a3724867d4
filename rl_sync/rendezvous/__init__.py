"""The group's rendezvous store, open only to members that hold the group's secret.

The coordinator hosts a `StoreServer`; ranks (and vLLM service ranks, which
Ray does not reach) use it through `MemberStore`, a `torch.distributed.Store`
that Gloo builds its group on. Every connection proves knowledge of the
per-group secret (handed out through Ray calls, or vLLM's weight-transfer
init call) before it may list, read or write anything, and every frame after
that carries a keyed digest, so records cannot be forged, replayed or altered
in flight. See `auth` for the protocol.

Typical use::

    secret = new_secret()
    server = StoreServer("127.0.0.1", 0, secret)          # coordinator
    store = MemberStore("127.0.0.1", server.port, secret, timeout_s=60)   # a rank
    store.set("key", b"value"); store.get("key")
    server.close()
"""

from .auth import AuthError, derive, new_secret
from .client import MemberStore
from .server import StoreServer

__all__ = ["AuthError", "MemberStore", "StoreServer", "derive", "new_secret"]
