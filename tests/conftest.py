"""Test-session settings that must precede any `import ray`.

Ray 2.60 replaces `_node_ip_address="127.0.0.1"` with the host's routable
address and lets its servers listen on every interface unless it is told the
cluster is this one node (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, read when
`ray` is imported). With it, Ray's servers, and every address rl-sync takes
from `ray.util.get_node_ip_address()`, stay on loopback; subprocesses (`ray
start`, examples, jobs) inherit it.
"""

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
