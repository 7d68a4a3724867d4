"""The watch's per-round pass in C (`scan.cpp`), built once per machine and torch version.

Each round a rank compares what it reads and writes with what it recorded
(`rl_sync.rank.watch`). In Python that is a call per tensor, twice (data
pointer, version counter): about 50 ms at 140,000 tensors on a loaded 2-core
host. `scan.cpp` walks the tensors in one C loop, reading each one's data
pointer, shape, strides, dtype and device straight off its TensorImpl (and
loading a few tensors ahead, so the memory of one is fetched while another is
compared), and compares object identities in C loops: about 10 ms at 140,000.
It needs no version counter, so values written in place cost nothing either.

It is built with `torch.utils.cpp_extension` (a C++ compiler and ninja) the
first time a process asks for it, under a name that holds a digest of its
source, in torch's extension directory; later processes load what was built
(about 10 s to build on a loaded 2-core host, milliseconds to load). Where it
cannot be built, or does not read tensors as torch lays them out here (checked
on sample tensors each time it loads), `scan()` answers None, says why in the
log once, and the watch uses its Python pass.

    scan = native.scan()             # the module, or None
    if scan is not None:
        scan.record(tensors, rows, slots)      # rows: torch.empty(n, ROW, dtype=torch.int64)
        moved = scan.moved(tensors, rows)      # positions whose layout differs from its row
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("rl_sync")

SOURCE = Path(__file__).with_name("scan.cpp")
ROW = 10
"""int64 words per recorded layout: data pointer, (dim, dtype, device), four sizes, four strides."""
UNRECORDED = -1
"""The second word of a row whose layout the scan does not compare (more than four dims, or no
storage): the caller compares those itself."""

_loaded: dict[str, ModuleType | None] = {}


def scan() -> ModuleType | None:
    """The built scan module, or None where it cannot be had here (see the module docstring)."""
    if "scan" not in _loaded:
        _loaded["scan"] = _load()
    return _loaded["scan"]


def module_name() -> str:
    """The extension's name: a digest of its source, so that builds of other versions of it
    (other checkouts, other releases) never take each other's place."""
    return f"rl_sync_scan_{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}"


def _load() -> ModuleType | None:
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(name=module_name(), sources=[str(SOURCE)], extra_cflags=["-O2"], verbose=False)
    except (OSError, RuntimeError, ImportError) as exc:
        log.warning("rl-sync: the C scan of tensors cannot be built here (%s); the watch uses its Python pass", exc)
        return None
    module.bind(torch.Tensor)
    samples = (torch.empty(3), torch.nn.Parameter(torch.empty(2)), torch.empty(4)[1:])
    if any(module.impl_address(t) != t._cdata for t in samples):
        log.warning(
            "rl-sync: the C scan does not read tensors as torch %s lays them out; the watch uses its Python pass",
            torch.__version__,
        )
        return None
    return module
