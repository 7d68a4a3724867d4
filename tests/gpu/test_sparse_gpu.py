"""Sparse codec on CUDA: exact round trips into strided live views; malformed input raises, no device assert."""

from __future__ import annotations

import pytest
import torch

from rl_sync.engine import sparse_codec
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, encoded_nbytes


@pytest.mark.parametrize("code", [INDICES, BLOCKED, BITMAP, DENSE])
def test_round_trip_on_cuda(code):
    gen = torch.Generator(device="cuda").manual_seed(code)
    base = torch.randn(300, 70_000, generator=gen, device="cuda").to(torch.bfloat16)
    cur = base.clone()
    flat = cur.view(-1)
    idx = torch.randperm(flat.numel(), generator=gen, device="cuda")[: flat.numel() // 100]
    flat[idx] = (flat[idx].float() + 1).to(torch.bfloat16)
    holder = torch.zeros(70_002, 300, dtype=torch.bfloat16, device="cuda")
    live = holder[1:70_001].t()
    live.copy_(base)
    changes = sparse_codec.Changes(cur, base)
    k = changes.count
    block = torch.empty(encoded_nbytes(code, cur.numel(), k, 2), dtype=torch.uint8, device="cuda")
    sparse_codec.encode(code, changes, block)
    index, values, ok = sparse_codec.decode(code, k, cur.numel(), torch.bfloat16, block)
    assert bool(ok)
    sparse_codec.apply(code, live, index, values)
    assert torch.equal(live.contiguous().view(torch.int16), cur.view(torch.int16))
    assert (holder[0] == 0).all() and (holder[-1] == 0).all()


def test_out_of_range_indices_are_refused_without_a_device_assert():
    block = torch.zeros(encoded_nbytes(INDICES, 10, 2, 4), dtype=torch.uint8, device="cuda")
    block[:8].view(torch.int32).copy_(torch.tensor([3, 10**6], dtype=torch.int32))
    _, _, ok = sparse_codec.decode(INDICES, 2, 10, torch.float32, block)
    assert not bool(ok)
    torch.cuda.synchronize()  # the context is healthy
    assert torch.ones(1, device="cuda").item() == 1.0
