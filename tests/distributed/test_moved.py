"""Tensors replaced or moved under a live group: every round writes the live weight or fails.

A worker that puts a new `Destination` in the mapping its hook returned, or
whose engine gives a weight new storage, is followed at the next round; a
trainer's source likewise. Relay on and off, double buffering on and off:
after every push that reports success, every worker holds the pushed
version in the tensors it serves now.
"""

from __future__ import annotations

import pytest
import ray
import torch

from actors import SyncError
from rl_sync.engine.sources import Sharded
from rl_sync.planning.layout import Layout, Mesh, Replicate, Shard

from .harness import Group
from .recipes import Recipe
from .test_failures import _replace_destination

FSDP2 = Layout(Mesh((2,)), (Shard(0),))
REPLICAS = Layout(Mesh((2, 1)), (Replicate(), Shard(0)))
RECIPES = [
    Recipe("w", torch.bfloat16, (16, 12), FSDP2, REPLICAS),
    Recipe("b", torch.float32, (12,), FSDP2, Layout.replicated(REPLICAS.mesh)),
]


def _reallocate(actor) -> None:
    """The engine gives 'b' new storage in place (`p.data = ...`)."""
    actor.held["b"].local.data = torch.full_like(actor.held["b"].local, float("nan"))


def _replace_source(actor) -> None:
    """The trainer's mapping gets a new shard object for 'w' (its values set by the next step)."""
    old = actor.held["w"]
    actor.held["w"] = Sharded(old.local.clone(), old.layout, old.shape)


@pytest.mark.parametrize("relay", ["off", "on"])
@pytest.mark.parametrize("double_buffer", [False, True])
def test_a_replaced_or_moved_tensor_is_written_at_the_next_round(ray_session, relay, double_buffer):
    with Group(RECIPES, 2, 2, relay=relay, double_buffer=double_buffer, round_timeout_s=8.0) as g:
        sync = g.connect()
        g.step(1)
        sync.push()
        ray.get([g.workers[1].call.remote(_replace_destination), g.workers[0].call.remote(_reallocate)])
        ray.get(g.trainers[0].call.remote(_replace_source))
        assert sync.versions() == [None, None], "the new tensors hold what the engine put there"
        g.step(2)
        stats = sync.push()
        assert stats.version == 2 and sync.versions() == [2, 2]
        g.check(2)
        g.step(3)
        sync.push(mode="sparse")  # the baselines came with the dense round 2: sparse from here
        g.check(3)
        ray.get(g.workers[1].call.remote(_replace_destination))
        g.step(4)
        if double_buffer:  # the shadow holds every tensor: the commit fills the new one whole
            assert sync.push(mode="sparse").mode == "sparse"
            g.check(4)
            return
        with pytest.raises(SyncError) as info:
            sync.push(mode="sparse")
        assert (
            "worker 1 (rank 3): ValueError: worker rank 1: 'w' changed since the last round (replaced under its "
            "name) and was bound anew, so it holds what the engine put there; a sparse round writes only what "
            "changed, so nothing was written; the next push runs every tensor dense (with auto_repair) or call "
            "repair()"
        ) in str(info.value)
        assert sync.versions()[1] is None
        assert sync.push(version=4).version == 4
        g.check(4)
