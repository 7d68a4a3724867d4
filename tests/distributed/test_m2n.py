"""M2N over real Ray actors and Gloo: resharding cases, modes, subsets, dtypes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import ray
import torch

from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

from .harness import Group
from .recipes import Recipe

FSDP4 = Layout(Mesh((4,)), (Shard(0),))
TP_COL = Layout(Mesh((2, 2)), (Replicate(), Shard(0)))
TP_ROW = Layout(Mesh((2, 2)), (Replicate(), Shard(1)))


def _model(src_col, src_row, dst_col, dst_row):
    return [
        Recipe("embed", torch.bfloat16, (96, 40), src_col, dst_col),
        Recipe("layers.0.qkv", torch.bfloat16, (120, 40), src_col, dst_col),
        Recipe("layers.0.o", torch.bfloat16, (40, 40), src_row, dst_row),
        Recipe(
            "layers.0.norm",
            torch.float32,
            (40,),
            Layout(src_col.mesh, (Shard(0),) * src_col.mesh.ndim),
            Layout.replicated(dst_col.mesh),
        ),
        Recipe("step", torch.int64, (3,), Layout.replicated(src_col.mesh), Layout.replicated(dst_col.mesh)),
    ]


@pytest.mark.parametrize("mode", ["m2n", "broadcast"])
def test_fsdp_to_tensor_parallel_bit_exact_over_rounds(ray_session, mode):
    recipes = _model(FSDP4, FSDP4, TP_COL, TP_ROW)
    with Group(recipes, 4, 4) as g:
        sync = g.connect()
        for version in (1, 2, 3):
            g.step(version)
            stats = sync.push(mode=mode)
            assert stats.version == version and stats.mode == mode
            g.check(version)
        if mode == "m2n":
            per_worker = sum(r.received_bytes for r in stats.ranks if r.role == "worker")
            assert per_worker == sync.summary.plan_bytes


HSDP = Layout(Mesh((2, 2)), (Replicate(), Shard(0)))


def test_hsdp_to_two_engines_of_tp2(ray_session):
    recipes = _model(HSDP, HSDP, TP_COL, TP_ROW)
    with Group(recipes, 4, 4) as g:
        sync = g.connect()
        g.step(1)
        stats = sync.push()
        g.check(1)
        sent = [r.sent_bytes for r in stats.ranks if r.role == "trainer"]
        assert max(sent) - min(sent) <= max(sent) // 4, f"replicas should share the load: {sent}"


@pytest.mark.slow
def test_one_d_to_two_d_and_back(ray_session):
    two_d = Layout(Mesh((2, 3)), (Shard(1), Shard(0)))
    one_d = Layout(Mesh((3,)), (Shard(1),))
    forward = [
        Recipe("w", torch.float32, (13, 11), one_d, two_d),
        Recipe("v", torch.float32, (7,), Layout(Mesh((3,)), (Shard(0),)), Layout(Mesh((2, 3)), (Shard(0), Shard(0)))),
    ]
    with Group(forward, 3, 6) as g:
        g.connect()
        g.step(1)
        g.sync.push()
        g.check(1)
    backward = [Recipe("w", torch.float32, (13, 11), two_d, one_d)]
    with Group(backward, 6, 3) as g:
        g.connect()
        g.step(2)
        g.sync.push(version=2)
        g.check(2)


def test_uneven_shapes_and_empty_shards(ray_session):
    fsdp5 = Layout(Mesh((5,)), (Shard(0),))
    tp3 = Layout(Mesh((3,)), (Shard(1),))
    recipes = [
        Recipe("odd", torch.bfloat16, (7, 5), fsdp5, tp3),
        Recipe("tiny", torch.float32, (3, 2), fsdp5, tp3),
        Recipe("prime", torch.int32, (11,), fsdp5, Layout(Mesh((3,)), (Shard(0),))),
    ]
    with Group(recipes, 5, 3) as g:
        g.connect()
        g.step(1)
        g.sync.push()
        g.check(1)


def test_rounds_that_carry_a_subset_of_names(ray_session):
    recipes = _model(FSDP4, FSDP4, TP_COL, TP_ROW)
    with Group(recipes, 4, 4) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        g.step(2)
        stats = sync.push(names=["layers.0.o"])
        g.check(2, names={"layers.0.o"})
        g.check(1, names={"embed", "layers.0.qkv", "layers.0.norm", "step"})
        assert sum(r.received_bytes for r in stats.ranks) == 40 * 40 * 2 * 2


def test_all_dtypes_travel_as_bytes(ray_session):
    fsdp2 = Layout(Mesh((2,)), (Shard(0),))
    tp2 = Layout(Mesh((2,)), (Shard(1),))
    recipes = [
        Recipe(f"t_{d}".replace("torch.", ""), d, (6, 4), fsdp2, tp2)
        for d in (
            torch.bfloat16,
            torch.float16,
            torch.float32,
            torch.float64,
            torch.int8,
            torch.int64,
            torch.uint8,
            torch.bool,
            torch.float8_e4m3fn,
        )
    ]
    with Group(recipes, 2, 2) as g:
        g.connect()
        g.step(1)
        g.sync.push()
        g.check(1)


def test_repeated_rounds_replay_one_compiled_program(ray_session):
    recipes = _model(FSDP4, FSDP4, TP_COL, TP_ROW)
    with Group(recipes, 4, 4) as g:
        sync = g.connect()
        for version in (1, 2, 3):
            g.step(version)
            sync.push()
        g.step(4)
        sync.push()
        g.check(4)
        compiles = ray.get([a.call.remote(lambda self: self._rl_sync_session.compiles) for a in g.trainers + g.workers])
        assert compiles == [1] * 8, f"ranks recompiled rounds whose endpoints did not change: {compiles}"


def _as_parameters(actor) -> None:
    """Run in a worker: hold every destination as an `nn.Parameter` requiring grad (as models do)."""
    actor.held = {n: replace(d, local=torch.nn.Parameter(d.local)) for n, d in actor.held.items()}


def test_parameters_that_require_grad_take_every_mode(ray_session):
    with Group(_model(FSDP4, FSDP4, TP_COL, TP_ROW)[:3], 4, 4) as g:
        ray.get([w.call.remote(_as_parameters) for w in g.workers])
        sync = g.connect()
        asked = ["m2n", "sparse", "sparse", "auto", "broadcast"]
        ran = ["m2n", "m2n", "sparse", "auto", "broadcast"]  # the first sparse push fills the baselines, dense
        for version, (mode, expected) in enumerate(zip(asked, ran), start=1):
            g.step(version)
            assert sync.push(mode=mode).mode == expected
            g.check(version)
