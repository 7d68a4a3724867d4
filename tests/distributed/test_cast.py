"""Trainers keeping another float precision than the workers: cast on the sending side."""

from __future__ import annotations

from dataclasses import replace

import pytest
import ray
import torch

from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

from .harness import Group
from .recipes import Recipe, as_bytes, expected, read_all

FSDP2 = Layout(Mesh((2,)), (Shard(0),))
SOURCES = [
    Recipe("w", torch.float32, (8, 6), FSDP2, Layout(Mesh((2,)), (Shard(1),))),
    Recipe("rows", torch.float32, (10, 4), FSDP2, Layout(Mesh((2,)), (Shard(0),))),
    Recipe("b", torch.float32, (6,), FSDP2, Layout(Mesh((2,)), (Replicate(),))),
]


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_fp32_trainers_cast_into_narrower_workers_in_every_mode(ray_session, wire):
    """What every worker holds equals `full_tensor.to(wire)` (round to nearest even, as
    vLLM's loader casts), through zero-copy-shaped, strided and replicated boxes."""
    with Group(SOURCES, 2, 2, worker_recipes=[replace(r, dtype=wire) for r in SOURCES]) as g:
        sync = g.connect()
        for version, mode in enumerate(["m2n", "broadcast", "auto", "sparse", "m2n"], start=1):
            g.step(version)
            sync.push(mode=mode)
            for j, tensors in enumerate(ray.get([w.call.remote(read_all) for w in g.workers])):
                for name, value in expected(SOURCES, j, version).items():
                    assert torch.equal(tensors[name], as_bytes(value.to(wire))), (
                        f"{mode}: worker {j} {name} at {version}"
                    )
