"""Joining an NCCL group is bounded: a rank whose peer never joins gives up, and the process
can form and use another communicator afterwards (one GPU: rank 0 of a two-rank group alone)."""

from __future__ import annotations

import time

import pytest
import torch


def test_a_rank_whose_peer_never_joins_gives_up_and_a_later_group_still_forms_and_moves_bytes():
    from rl_sync.transport.nccl import NcclTransport, nccl_available, new_unique_id

    if not nccl_available():
        pytest.skip("CuPy NCCL is not importable")
    device = torch.device("cuda", 0)
    start = time.monotonic()
    with pytest.raises(
        TimeoutError,
        match=r"^rank 0: forming the NCCL communicator of 2 ranks \(every rank must join\): not done within "
        r"[23]\.\d s; abandoned$",
    ):
        NcclTransport(0, 2, new_unique_id(), device, join_timeout_s=3.0)
    assert time.monotonic() - start < 10
    transport = NcclTransport(0, 1, new_unique_id(), device, join_timeout_s=60.0)
    sent = torch.arange(1 << 20, device=device, dtype=torch.int32).view(torch.uint8)
    received = torch.zeros_like(sent)
    transport.post([(0, sent)], [(0, received)]).wait(time.monotonic() + 60)
    transport.finish(time.monotonic() + 60)
    assert torch.equal(sent, received)
    transport.close()
