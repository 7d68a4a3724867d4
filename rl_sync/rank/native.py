"""rl-sync's C++ modules, built once per machine and torch version: the watch's per-round pass
(`scan.cpp`) and the memory swap of storages for PyTorch releases without one (`swap.cpp`,
`rl_sync.rank.swap`).

Each round a rank compares what it reads and writes with what it recorded
(`rl_sync.rank.watch`). In Python that is a call per tensor, twice (data
pointer, version counter): about 50 ms at 140,000 tensors on a loaded 2-core
host. `scan.cpp` walks the tensors in one C loop, reading each one's data
pointer, shape, strides, dtype and device straight off its TensorImpl (and
loading a few tensors ahead, so the memory of one is fetched while another is
compared), and compares object identities in C loops: about 10 ms at 140,000.
It needs no version counter, so values written in place cost nothing either.

Each module is compiled with the host's C++ compiler (`c++`, against torch's headers and
its c10 library) the first time a process asks for it, into
`~/.cache/rl_sync/native/`, under a name that holds a digest of its source, the
torch version and the Python it is for; later processes load what was built
(10 to 20 s to build on a loaded 2-core host, a millisecond to load; several
processes building at once each write their own file and rename it in place).
Where one cannot be built, or does not work on torch's objects as laid out here
(checked on sample tensors each time it loads), its function answers None, says why
in the log once, and the caller does without it (the watch uses its Python pass; commits copy).

    scan = native.scan()             # the module, or None
    if scan is not None:
        unrecorded = scan.record(tensors, rows, slots)  # rows: torch.empty(n, ROW, dtype=torch.int64)
        moved = scan.moved(tensors, rows)      # positions whose layout differs from its row
    swap = native.swap()             # the module, or None
    swap.swap([a.untyped_storage()._cdata], [b.untyped_storage()._cdata])  # pairs a[i], b[i]
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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("rl_sync")

HERE = Path(__file__).parent
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
        _loaded["scan"] = _load("scan", _scan_reads_tensors, "the watch uses its Python pass")
    return _loaded["scan"]


def swap() -> ModuleType | None:
    """The built swap module, or None where it cannot be had here (see the module docstring)."""
    if "swap" not in _loaded:
        _loaded["swap"] = _load("swap", _swap_exchanges_memory, "commits copy instead of swapping")
    return _loaded["swap"]


def module_name(stem: str) -> str:
    """The module's name: a digest of its sources (with `module.h`), the torch version and the Python it is built
    for, so that no other build (other checkouts, releases, environments) takes its place."""
    sources = (HERE / f"{stem}.cpp").read_bytes() + (HERE / "module.h").read_bytes()
    key = sources + f"{torch.__version__} {sys.version} {sysconfig.get_platform()}".encode()
    return f"rl_sync_{stem}_{hashlib.sha256(key).hexdigest()[:16]}"


def _load(stem: str, works: Callable[[ModuleType], str | None], otherwise: str) -> ModuleType | None:
    """`stem.cpp` built (once) and loaded, when `works` finds nothing wrong with it (else None,
    logged with what the caller does `otherwise`)."""
    name = module_name(stem)
    path = CACHE / f"{name}{sysconfig.get_config_var('EXT_SUFFIX')}"
    try:
        if not path.exists():
            _build(HERE / f"{stem}.cpp", name, path)
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None  # an extension module's path
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (OSError, ImportError, subprocess.SubprocessError) as exc:
        log.warning("rl-sync: the C++ module %s cannot be built here (%s); %s", stem, exc, otherwise)
        return None
    wrong = works(module)
    if wrong is not None:
        log.warning("rl-sync: the C++ module %s %s with torch %s; %s", stem, wrong, torch.__version__, otherwise)
        return None
    return module


def _scan_reads_tensors(module: ModuleType) -> str | None:
    module.bind(torch.Tensor)
    samples = (torch.empty(3), torch.nn.Parameter(torch.empty(2)), torch.empty(4)[1:])
    if any(module.impl_address(t) != t._cdata for t in samples):
        return "does not read tensors as torch lays them out"
    return None


def _swap_exchanges_memory(module: ModuleType) -> str | None:
    a, b = torch.arange(4, dtype=torch.int32), torch.arange(4, 8, dtype=torch.int32)
    view = a[1:]
    module.swap([a.untyped_storage()._cdata], [b.untyped_storage()._cdata])
    if a.tolist() != [4, 5, 6, 7] or b.tolist() != [0, 1, 2, 3] or view.tolist() != [5, 6, 7]:
        return "does not exchange storages' memory"
    return None


def _build(source: Path, name: str, path: Path) -> None:
    """Compile `source` into `path` (through a file of this process's own, renamed in place)."""
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
        str(source),
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
