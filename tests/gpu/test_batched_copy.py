"""The one-launch batched copy moves every byte of thousands of regions exactly."""

from __future__ import annotations

import torch

from rl_sync.engine.batched_copy import BatchedCopy
from rl_sync.engine.runner import Copies


def test_thousands_of_regions_copy_exactly_and_nothing_else():
    gen = torch.Generator(device="cuda").manual_seed(0)
    sizes = (torch.randint(1, 40_000, (3000,), generator=gen, device="cuda") * 8).tolist()
    src = [torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda", generator=gen) for n in sizes]
    pool = torch.zeros(sum(sizes) + 8 * len(sizes), dtype=torch.uint8, device="cuda")
    dst, cursor = [], 0
    for n in sizes:
        dst.append(pool[cursor : cursor + n])
        cursor += n + 8
    copier = BatchedCopy.build(dst, src)
    assert copier is not None
    copier.run()
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    gaps = torch.ones_like(pool, dtype=torch.bool)
    cursor = 0
    for n in sizes:
        gaps[cursor : cursor + n] = False
        cursor += n + 8
    assert (pool[gaps] == 0).all()


def test_copies_mix_big_small_and_strided():
    a = [torch.randn(n, device="cuda") for n in (3, 1 << 21, 1001)]
    b = [torch.zeros_like(t) for t in a]
    m = torch.randn(64, 64, device="cuda")
    out = torch.zeros(64, 64, device="cuda")
    copies = Copies()
    for d, s in zip(b, a):
        copies.add(d, s)
    copies.add(out.t(), m)
    copies.run()
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and torch.equal(out.t(), m)
