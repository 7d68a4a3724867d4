"""Commits that swap on a GPU: the memory behind two CUDA storages exchanged in O(1), with
whichever swap this PyTorch has (`rl_sync.rank.swap`: its own, or rl-sync's C++ module on
releases without one, such as 2.11)."""

from __future__ import annotations

import torch

from rl_sync.engine.endpoint import Endpoint
from rl_sync.rank.shadow import Shadows
from rl_sync.rank.swap import can_swap, swap_memory

MIB = 1 << 20


def test_cuda_storages_swap_their_memory_and_each_block_is_freed_once():
    assert can_swap(), "a swap is had here (PyTorch's or the C++ module, which must build)"
    live = torch.arange(MIB, dtype=torch.float32, device="cuda")
    spare = torch.full((MIB,), 7.0, device="cuda")
    view, addresses = live[1:3], (live.data_ptr(), spare.data_ptr())
    before = torch.cuda.memory_allocated()
    swap_memory(live.untyped_storage(), spare.untyped_storage())
    assert (spare.data_ptr(), live.data_ptr()) == addresses
    assert torch.equal(view, torch.full((2,), 7.0, device="cuda")) and spare[5].item() == 5.0
    assert torch.cuda.memory_allocated() == before, "nothing allocated or freed by a swap"
    del spare, view
    assert torch.cuda.memory_allocated() == before - 4 * MIB, "the old live block freed, once"
    assert torch.equal(live + 0, torch.full((MIB,), 7.0, device="cuda")), "the new live block kept"


def test_a_double_buffered_commit_on_a_gpu_swaps_and_the_next_partial_round_catches_up():
    fused = torch.zeros(64, 96, dtype=torch.bfloat16, device="cuda")
    endpoints = {"q": Endpoint(fused[:, :32], (0, 0)), "kv": Endpoint(fused[:, 32:], (0, 0))}
    shadows = Shadows.of(endpoints, keep=(), swappable={"q", "kv"})
    assert shadows.swapped_bytes() == fused.numel() * 2
    for name in ("q", "kv"):
        shadows.endpoints[name].tensor.fill_(3.0)
    address = shadows.endpoints["q"].tensor.data_ptr()
    assert shadows.commit(swap=True) is True
    assert fused.data_ptr() == address and torch.equal(fused, torch.full_like(fused, 3.0))
    shadows.prepare(writes_all=False)
    shadows.endpoints["q"].tensor[0, 0] = 5.0
    shadows.commit(swap=True)
    expected = torch.full_like(fused, 3.0)
    expected[0, 0] = 5.0
    assert torch.equal(fused, expected), "the spare caught up from the live round before the partial one"
