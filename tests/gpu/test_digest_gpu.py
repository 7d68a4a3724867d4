"""Digests on CUDA: the Triton NH kernel against the torch reference, and a tampered NCCL
transfer caught, on a one-rank communicator (grouped self send/recv)."""

from __future__ import annotations

import pytest
import torch

from rl_sync.engine.runner import deadline_in
from rl_sync.transport.digest import Digester, DigestTransport, IntegrityError
from rl_sync.transport.nh import BLOCK_WORDS, REDUCED_BYTES, _kernel, _nh_torch, nh_compress, nh_key, nh_keys, nh_reduce


@pytest.mark.parametrize("offset, length", [(0, 1024), (0, (64 << 20) + 4096 + 5), (2, 3 << 20), (4, 777)])
def test_the_triton_kernel_computes_nh_exactly(offset, length):
    if _kernel() is None:
        pytest.skip("Triton is not importable")
    device = torch.device("cuda", 0)
    gen = torch.Generator(device=device).manual_seed(length)
    data = torch.randint(0, 256, (offset + length,), dtype=torch.uint8, device=device, generator=gen)[offset:]
    key = nh_key(b"k" * 32, device)
    got = nh_compress(data, key)
    padded = torch.zeros(-(-length // 1024) * 1024, dtype=torch.uint8, device=device)
    padded[:length] = data
    want = _nh_torch(padded.view(torch.int32).view(-1, BLOCK_WORDS), key)
    assert torch.equal(got, want)


def test_the_levels_on_cuda_equal_the_torch_operations_on_the_host():
    if _kernel() is None:
        pytest.skip("Triton is not importable")
    device = torch.device("cuda", 0)
    data = torch.randint(0, 256, ((80 << 20) + 3,), dtype=torch.uint8, device=device)
    got = nh_reduce(data, nh_keys(b"k" * 32, device))
    assert got.numel() * 8 <= REDUCED_BYTES
    assert torch.equal(got.cpu(), nh_reduce(data.cpu(), nh_keys(b"k" * 32, torch.device("cpu"))))


def test_a_byte_flipped_in_an_nccl_transfer_is_caught():
    from rl_sync.transport.nccl import NcclTransport, nccl_available, new_unique_id

    if not nccl_available():
        pytest.skip("CuPy NCCL is not importable")
    device = torch.device("cuda", 0)
    transport = DigestTransport(NcclTransport(0, 1, new_unique_id(), device), Digester("keyed", b"s" * 32, label=b"g"))
    payload = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, device=device)
    for flip in (False, True):
        out = torch.zeros_like(payload)
        pending = transport.post([(0, payload)], [(0, out)], label="bucket 0")
        pending.inner.wait(deadline_in(30))
        if flip:
            out[12345] ^= 1
        pending.wait(deadline_in(30))
        if flip:
            with pytest.raises(IntegrityError, match=r"^rank 0: bucket 0 from rank 0 \(transfer 1\) failed its keyed"):
                transport.finish(deadline_in(30))
        else:
            transport.finish(deadline_in(30))
            assert torch.equal(out, payload)
    transport.close()
