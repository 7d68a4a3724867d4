"""A Ray cluster of several nodes on one machine: one network namespace per node.

Node i lives in namespace `<prefix>n<i>` with one interface, `eth0`, holding
`10.231.<subnet>.<i+1>/24`; each is joined by a veth pair to a bridge in the
namespace `<prefix>br`. Nothing outside these namespaces is ever addressed.
`ray start` runs inside each namespace (node 0 is the head) with a temp dir
of the cluster's own and a custom resource `node<i>`, so placement puts
actors on a chosen node. Drivers run inside node 0's namespace
(`run_driver`). Faults: a node's link down or up (`link`), a rate limit on
it (`shape`), every process of a node killed (`kill_node`).
Teardown kills every process in the namespaces and deletes them, bounded in
time; `NetnsCluster.usable()` says why a machine cannot run this.

Typical use::

    with NetnsCluster(nodes=3) as cluster:
        result = cluster.run_driver(["tests.multihost.scenarios", "two_node"], timeout_s=120)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PORT = 6380
ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "PYTHONPATH": str(ROOT),
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
}
"""Inside the namespaces Ray may listen on every interface: they are the namespace's own
(`tests/conftest.py` keeps the single-node session Ray on loopback with "0")."""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=check)


class NetnsCluster:
    """`nodes` Ray nodes in their own network namespaces (see the module docstring)."""

    def __init__(
        self, nodes: int, *, cpus_per_node: int = 4, subnet: int = 0, prefix: str | None = None, temp: str | None = None
    ):
        """A new cluster; with `prefix` and `temp`, a handle on a running one (a driver's view)."""
        self.nodes, self.cpus = nodes, cpus_per_node
        self.prefix = prefix or f"rls{os.getpid() % 10000}s{subnet}"
        self.subnet = subnet
        self.temp = Path(temp) if temp else Path(tempfile.mkdtemp(prefix="rl-sync-mh-"))
        self.address = f"{self.ip(0)}:{PORT}"

    @staticmethod
    def usable() -> str | None:
        """None when namespaces can be made here, else why not."""
        if os.geteuid() != 0:
            return "needs root for network namespaces"
        if shutil.which("ip") is None:
            return "needs iproute2 ('ip')"
        probe = f"rlsprobe{os.getpid() % 100000}"
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if made.returncode:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
        return None

    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def ip(self, node: int) -> str:
        return f"10.231.{self.subnet}.{node + 1}"

    def __enter__(self) -> NetnsCluster:
        try:
            self._network()
            for node in range(self.nodes):
                self.start_node(node)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _network(self) -> None:
        bridge = f"{self.prefix}br"
        _ip("ip", "netns", "add", bridge)
        _ip("ip", "link", "add", "br0", "type", "bridge", ns=bridge)
        _ip("ip", "link", "set", "br0", "up", ns=bridge)
        for node in range(self.nodes):
            self._plug(node)

    def _plug(self, node: int) -> None:
        ns, bridge, veth, port = self.ns(node), f"{self.prefix}br", f"{self.prefix}v{node}", f"{self.prefix}p{node}"
        _ip("ip", "netns", "add", ns)
        _ip("ip", "link", "set", "lo", "up", ns=ns)
        _ip("ip", "link", "add", veth, "type", "veth", "peer", "name", port)
        _ip("ip", "link", "set", veth, "netns", ns)
        _ip("ip", "link", "set", port, "netns", bridge)
        _ip("ip", "link", "set", veth, "name", "eth0", ns=ns)
        _ip("ip", "addr", "add", f"{self.ip(node)}/24", "dev", "eth0", ns=ns)
        _ip("ip", "link", "set", "eth0", "up", ns=ns)
        _ip("ip", "link", "set", port, "master", "br0", ns=bridge)
        _ip("ip", "link", "set", port, "up", ns=bridge)

    def start_node(self, node: int) -> None:
        """`ray start` in the node's namespace (the head for node 0), bounded in time."""
        where = (
            ["--head", f"--port={PORT}", "--include-dashboard=false"] if node == 0 else [f"--address={self.address}"]
        )
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns(node),
            str(Path(sys.executable).with_name("ray")),
            "start",
            *where,
            f"--node-ip-address={self.ip(node)}",
            f"--num-cpus={self.cpus}",
            f'--resources={{"node{node}": 100}}',
            "--disable-usage-stats",
            f"--temp-dir={self.temp}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
        if done.returncode:
            raise RuntimeError(f"ray start on node {node} failed: {done.stderr[-2000:]}")

    def run_driver(self, args: list[str], timeout_s: float) -> dict:
        """`python -m args...` inside node 0's namespace, connected to this cluster; the last line
        it prints, as JSON."""
        cmd = [
            "ip",
            "netns",
            "exec",
            self.ns(0),
            sys.executable,
            "-m",
            *args,
            "--address",
            self.address,
            "--prefix",
            self.prefix,
            "--nodes",
            str(self.nodes),
            "--temp",
            str(self.temp),
            "--subnet",
            str(self.subnet),
        ]
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **ENV}, cwd=ROOT
        )
        if done.returncode:
            raise RuntimeError(
                f"driver {args} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
            )
        return json.loads(done.stdout.strip().splitlines()[-1])

    def link(self, node: int, up: bool) -> None:
        """Take node's link to the bridge down, or bring it back."""
        _ip("ip", "link", "set", f"{self.prefix}p{node}", "up" if up else "down", ns=f"{self.prefix}br")

    def shape(self, node: int, rate: str) -> None:
        """Rate-limit what flows into node, on its bridge port (`tc tbf`; this kernel has no
        `netem` for added delay), e.g. rate='1gbit'."""
        _ip(
            "tc",
            "qdisc",
            "replace",
            "dev",
            f"{self.prefix}p{node}",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            "64kb",
            "latency",
            "500ms",
            ns=f"{self.prefix}br",
        )

    def kill_node(self, node: int) -> None:
        """Kill every process in node's namespace (a node that stops dead)."""
        pids = _ip("ip", "netns", "pids", self.ns(node), check=False).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)

    def close(self) -> None:
        """Kill every process in the namespaces, delete them and the temp dir (bounded)."""
        deadline = time.monotonic() + 30
        for node in range(self.nodes):
            self.kill_node(node)
        for node in range(self.nodes):
            while _ip("ip", "netns", "pids", self.ns(node), check=False).stdout.strip() and time.monotonic() < deadline:
                self.kill_node(node)
                time.sleep(0.1)
        for ns in [self.ns(n) for n in range(self.nodes)] + [f"{self.prefix}br"]:
            _ip("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.temp, ignore_errors=True)
