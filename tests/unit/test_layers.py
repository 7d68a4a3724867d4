"""Every layer of `rl_sync` imports with the layers above it blocked: its arrows point down only.

`LAYERS` is the one list of the layer order, bottom first, mirroring DESIGN.md's "Layers"
section; packages that share a tier are peers and may import each other. Each layer is
imported whole (every module of it) in a fresh process whose meta-path finder refuses any
layer above it, `actors/` and `ray`, and whose `rl_sync` package is bare: the face,
`rl_sync/__init__.py`, imports several layers, so it is imported in a process of its own with
every module of the core, refusing `actors/` and `ray` only. The processes fork from one that
has loaded torch and nothing of rl-sync, so torch is imported once.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import rl_sync

PACKAGE = Path(rl_sync.__file__).parent

LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("rendezvous",),
    ("wire", "planning"),
    ("sparse",),
    ("storage",),
    ("transport",),
    ("bind", "models", "lora"),
    ("engine",),
    ("rank",),
    ("vllm", "lead"),
)
"""Bottom first. `wire` and `planning` are DESIGN.md's pure layer (the plan message encodes a
schedule; the planner's agreement check reads the ranks' reports); `models` holds the model
shapes the binder reads and the synthetic models the binder lays out, `lora` the names and
sources of a PEFT adapter (`rl_sync/lora.py`); `lead` leads vLLM's ranks
through the engine-service protocol of `vllm`, whose trainer-side engine is a `lead` leader."""

OUTSIDE_THE_CORE = ("actors", "ray")
"""Refused to every layer: the core imports without Ray (DESIGN.md)."""

FACE = ""
"""The target that stands for `rl_sync/__init__.py` and everything under it."""

IMPORT_EACH_IN_A_FORK = """
import importlib, importlib.abc, json, os, pkgutil, sys, traceback, types

import torch

root, jobs = sys.argv[1], json.loads(sys.argv[2])


class Refuse(importlib.abc.MetaPathFinder):
    def __init__(self, target, blocked):
        self.target, self.blocked = target, set(blocked)

    def find_spec(self, fullname, path=None, spec_target=None):
        parts = fullname.split(".")
        layer = parts[1] if parts[0] == "rl_sync" and len(parts) > 1 else parts[0]
        if layer in self.blocked:
            raise ImportError(f"layer {self.target!r} imports {fullname}, which it may not")
        return None


def import_whole(target, blocked):
    sys.meta_path.insert(0, Refuse(target, blocked))
    if target:
        bare = types.ModuleType("rl_sync")
        bare.__path__ = [root]
        sys.modules["rl_sync"] = bare
    layer = importlib.import_module(f"rl_sync.{target}" if target else "rl_sync")
    for found in pkgutil.walk_packages(getattr(layer, "__path__", []), f"{layer.__name__}."):
        importlib.import_module(found.name)


def in_a_fork(target, blocked):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            import_whole(target, blocked)
            failure = ""
        except BaseException:
            failure = traceback.format_exc()
        os.write(write, failure.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        failure = pipe.read()
    os.waitpid(pid, 0)
    return failure


print(json.dumps({job: in_a_fork(target, blocked) for job, (target, blocked) in jobs.items()}))
"""
"""Run with the package directory and `{job: [target, blocked layers]}`; prints `{job: traceback
or ''}`."""


def _above(tier: int) -> list[str]:
    return [name for higher in LAYERS[tier + 1 :] for name in higher] + list(OUTSIDE_THE_CORE)


JOBS = {
    **{name: [name, _above(tier)] for tier, names in enumerate(LAYERS) for name in names},
    "face": [FACE, list(OUTSIDE_THE_CORE)],
    "models without planning": ["models", ["planning"]],
}
"""Each layer with those above it refused, the face, and one import that must be refused."""


@pytest.fixture(scope="module")
def failures() -> dict[str, str]:
    """Each of `JOBS`'s traceback, or '' where it imported."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE.parent), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH_IN_A_FORK, str(PACKAGE), json.dumps(JOBS)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=True,
    )
    return json.loads(result.stdout.splitlines()[-1])


def test_the_list_names_every_package_of_the_core_once():
    listed = [name for tier in LAYERS for name in tier]
    present = {p.stem for p in PACKAGE.iterdir() if any(p.glob("*.py")) or p.suffix == ".py"} - {"__init__"}
    assert sorted(listed) == sorted(present)


@pytest.mark.parametrize("layer", [name for tier in LAYERS for name in tier])
def test_a_layer_imports_without_the_layers_above_it(failures, layer):
    assert failures[layer] == ""


def test_the_face_and_all_it_holds_import_without_ray_or_actors(failures):
    assert failures["face"] == ""


def test_a_layer_that_reaches_down_is_refused_when_what_it_reaches_is_blocked(failures):
    """The finder bites: `models` imports `planning`, so refusing `planning` must fail it."""
    assert "ImportError: layer 'models' imports rl_sync.planning" in failures["models without planning"]


SPARSE_CODEC = ("sparse_table", "sparse_triton", "sparse_cuda", "sparse_launch", "sparse_fused", "sparse_receiver")
"""The GPU sparse codec's modules in `rl_sync/engine/`, bottom first: the table layout, the two kernel
sets, the launches, the sender, the receiver; `sparse_codec` drives them from above."""


def _engine_imports(module: str) -> set[str]:
    """The `rl_sync/engine` modules `module` names in any import of it (lazy and type-only ones too)."""
    tree = ast.parse((PACKAGE / "engine" / f"{module}.py").read_text())
    named = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            named |= {node.module} if node.module else {alias.name for alias in node.names}
    return named


@pytest.mark.parametrize("position", range(len(SPARSE_CODEC)))
def test_each_module_of_the_sparse_codec_imports_only_those_below_it(position):
    module, below = SPARSE_CODEC[position], set(SPARSE_CODEC[:position])
    assert _engine_imports(module) & set(SPARSE_CODEC) <= below, module
