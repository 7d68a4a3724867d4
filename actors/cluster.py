"""Connect to Ray the way every entry point does.

`connect(None)` joins the cluster named by `RAY_ADDRESS` (set inside `ray job
submit`) or, without one, starts a local Ray bound to loopback; any other
address (`"auto"`, `"ray://host:10001"`, `"127.0.0.1:6379"`) is passed to
`ray.init`.
"""

from __future__ import annotations

import os
import socket

import ray


def connect(address: str | None = None) -> None:
    if ray.is_initialized():
        return
    if address is None and not os.environ.get("RAY_ADDRESS"):
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
    else:
        ray.init(address=address)


def free_init_url(host: str) -> str:
    """A `tcp://host:port` rendezvous URL on a free port of `host`, for a model's own
    process group (the trainers' FSDP group, the engines' TP groups)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return f"tcp://{host}:{sock.getsockname()[1]}"
