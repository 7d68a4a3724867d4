"""M2N over real Ray actors and Gloo: resharding cases, modes, subsets, dtypes."""

from __future__ import annotations

import pytest
import torch

from rl_sync.layout import Layout, Mesh, Replicate, Shard

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
        Recipe("layers.0.norm", torch.float32, (40,), Layout(src_col.mesh, (Shard(0),) * src_col.mesh.ndim),
               Layout.replicated(dst_col.mesh)),
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
            assert per_worker == sync.summary["plan_bytes"]

