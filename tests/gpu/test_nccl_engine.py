"""The NCCL transport through the engine's sender/receiver path on a one-rank communicator."""

from __future__ import annotations

import pytest
import torch

from rl_sync.engine.endpoint import Endpoint
from rl_sync.engine.runner import (
    BucketIO,
    RankBucket,
    compile_bucket,
    complete_bucket,
    deadline_in,
    staging_need,
    start_bucket,
)
from rl_sync.planning.layout import Layout, Mesh, Shard
from rl_sync.planning.plan import TensorSpec, plan_model
from rl_sync.planning.schedule import Message, build_schedule


def _as_self(messages: tuple[Message, ...]) -> tuple[Message, ...]:
    return tuple(Message(0, m.nbytes, m.segments) for m in messages)


def test_bf16_parameters_move_bit_exact_through_grouped_self_send_recv():
    from rl_sync.transport.nccl import NcclTransport, nccl_available, new_unique_id

    if not nccl_available():
        pytest.skip("CuPy NCCL is not importable")
    device = torch.device("cuda", 0)
    src, dst = Layout(Mesh((1,)), (Shard(0),)), Layout(Mesh((1,), start_rank=1), (Shard(0),))
    shapes = {"big": (4096, 1024), "small.0": (64,), "small.1": (3, 5), "fused.k": (256, 128), "fp8": (128, 64)}
    dtypes = {"fp8": torch.float8_e4m3fn}
    specs = [
        TensorSpec(n, str(dtypes.get(n, torch.bfloat16)).removeprefix("torch."), s, src, dst) for n, s in shapes.items()
    ]
    schedule = build_schedule(plan_model(specs), bucket_bytes=1 << 30, coalesce_bytes=1 << 16)
    sends, recvs = schedule.rank_slice(0).buckets, schedule.rank_slice(1).buckets
    assert len(sends) == len(recvs) == 1
    bucket = RankBucket(0, _as_self(sends[0].sends), _as_self(recvs[0].recvs), ())
    gen = torch.Generator(device=device).manual_seed(0)
    sources = [torch.randn(s.shape, generator=gen, device=device).to(getattr(torch, s.dtype)) for s in specs]
    fused = torch.full((768, 128), float("nan"), dtype=torch.bfloat16, device=device)  # k slot of a fused kv
    dests = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype), device=device) for s in specs]
    dests[3] = fused[256:512]
    strided = torch.zeros(1024, 4096, dtype=torch.bfloat16, device=device).t()  # non-contiguous live view
    dests[0] = strided
    io = BucketIO(
        lambda _b, t: Endpoint(sources[t], (0,) * sources[t].ndim),
        lambda _b, t: Endpoint(dests[t], (0,) * dests[t].ndim),
        [getattr(torch, s.dtype) for s in specs],
    )
    transport = NcclTransport(0, 1, new_unique_id(), device)
    deadline = deadline_in(60)
    ops = compile_bucket(bucket, io, torch.empty(staging_need(bucket, io), dtype=torch.uint8, device=device))
    start_bucket(ops, transport)
    complete_bucket(ops, deadline)
    transport.finish(deadline)
    counters = ops.counters
    for s, a, b in zip(specs, sources, dests):
        assert torch.equal(a.view(torch.uint8), b.contiguous().view(torch.uint8)), s.name
    assert torch.isnan(fused[:256].float()).all() and torch.isnan(fused[512:].float()).all()
    assert counters.staged_bytes > 0 and counters.zero_copy_bytes > 0
    transport.close()
