"""The watch's per-round pass in C (`scan.cpp`), built once per machine and torch version.

Each round a rank compares what it reads and writes with what it recorded
(`rl_sync.rank.watch`). In Python that is a call per tensor, twice (data
pointer, version counter): about 50 ms at 140,000 tensors on a loaded 2-core
host. `scan.cpp` walks the tensors in one C loop, reading each one's data
pointer, shape, strides, dtype and device straight off its TensorImpl (and
loading a few tensors ahead, so the memory of one is fetched while another is
compared), and compares object identities in C loops: about 10 ms at 140,000.
It needs no version counter, so values written in place cost nothing either.

It is compiled with the host's C++ compiler (`c++`, against torch's headers and
its c10 library) the first time a process asks for it, into
`~/.cache/rl_sync/native/`, under a name that holds a digest of its source, the
torch version and the Python it is for; later processes load what was built
(10 to 20 s to build on a loaded 2-core host, a millisecond to load; several
processes building at once each write their own file and rename it in place).
Where it cannot be built, or does not read tensors as torch lays them out here
(checked on sample tensors each time it loads), `scan()` answers None, says why
in the log once, and the watch uses its Python pass.

    scan = native.scan()             # the module, or None
    if scan is not None:
        scan.record(tensors, rows, slots)      # rows: torch.empty(n, ROW, dtype=torch.int64)
        moved = scan.moved(tensors, rows)      # positions whose layout differs from its row
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
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

CACHE = Path.home() / ".cache" / "rl_sync" / "native"
"""Where built modules are kept."""

_loaded: dict[str, ModuleType | None] = {}


def scan() -> ModuleType | None:
    """The built scan module, or None where it cannot be had here (see the module docstring)."""
    if "scan" not in _loaded:
        _loaded["scan"] = _load()
    return _loaded["scan"]


def module_name() -> str:
    """The module's name: a digest of its source, the torch version and the Python it is built
    for, so that no other build (other checkouts, releases, environments) takes its place."""
    key = SOURCE.read_bytes() + f"{torch.__version__} {sys.version} {sysconfig.get_platform()}".encode()
    return f"rl_sync_scan_{hashlib.sha256(key).hexdigest()[:16]}"


def _load() -> ModuleType | None:
    name = module_name()
    path = CACHE / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    try:
        if not path.exists():
            _build(name, path)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None  # an extension module's path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
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


def _build(name: str, path: Path) -> None:
    """Compile `scan.cpp` into `path` (through a file of this process's own, renamed in place)."""
    from torch.utils import cpp_extension

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler (c++ or g++) on PATH")
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f"{path.name}.{os.getpid()}.part")
    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    libraries = cpp_extension.library_paths()
    command = [
        compiler,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-DTORCH_EXTENSION_NAME={name}",
        f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
        *(f"-isystem{p}" for p in includes),
        str(SOURCE),
        "-o",
        str(part),
        *(f"-L{p}" for p in libraries),
        *(f"-Wl,-rpath,{p}" for p in libraries),
        "-lc10",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
