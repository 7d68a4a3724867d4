"""Run by `test_sparse_interpreted.py` in a fresh process under `TRITON_INTERPRET=1`: the fused
sparse codec's Triton kernels on CPU tensors against the torch codec. Prints "ok" or raises."""

from __future__ import annotations

import os

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402

from rl_sync.engine import sparse_codec  # noqa: E402
from rl_sync.sparse.encodings import BITMAP, BLOCKED, DENSE, INDICES, encoded_nbytes, message_layout  # noqa: E402

sparse_codec._on_kernel_device = lambda t: True  # the interpreter runs the kernels on CPU tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _pair(shape, dtype, density, seed):
    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(shape, generator=gen) * 10).to(dtype)
    cur = torch.where(
        torch.rand(shape, generator=gen) < density, (torch.randn(shape, generator=gen) * 10).to(dtype), base
    )
    if dtype == torch.bfloat16:
        cur.view(-1)[0], base.view(-1)[0] = -0.0, 0.0  # changed by its bits
    return cur, base


def _strided(t: torch.Tensor) -> torch.Tensor:
    holder = torch.zeros(t.shape[1] + 2, t.shape[0], dtype=t.dtype)
    view = holder[1:-1].t()
    view.copy_(t)
    return view


def main() -> None:
    cases = [
        ((3, 70_000), torch.bfloat16, 0.01, BLOCKED, False),
        ((300, 70), torch.bfloat16, 0.3, BITMAP, True),  # busier
        ((50, 400), torch.bfloat16, 0.1, BITMAP, False),  # busy
        ((5000,), torch.float32, 0.001, INDICES, False),
        ((40, 90), torch.uint8, 0.5, DENSE, True),
        ((130_000,), torch.float64, 0.004, BLOCKED, False),
        ((2, 40_000), torch.bfloat16, 0.03, BLOCKED, False),  # sparse launch, words of more than 4 marks
    ]
    pairs = [_pair(shape, dtype, density, seed) for seed, (shape, dtype, density, _, _) in enumerate(cases)]
    sources = [
        (_strided(c), _strided(b)) if strided else (c.clone(), b.clone()) for (c, b), (*_, strided) in zip(pairs, cases)
    ]
    found = sparse_codec.BucketChanges(sources, [(i, (0,) * c.ndim, tuple(c.shape)) for i, (c, _) in enumerate(pairs)])
    payloads = []
    for i, ((cur, base), (_, _, _, code, _)) in enumerate(zip(pairs, cases)):
        reference = sparse_codec.Changes(cur, base.clone())
        assert found.counts[i] == reference.count, (i, found.counts[i], reference.count)
        expected = torch.zeros(
            encoded_nbytes(code, cur.numel(), reference.count, cur.element_size()), dtype=torch.uint8
        )
        sparse_codec.encode(code, reference, expected)
        payloads.append((torch.zeros_like(expected), expected))
        found.encode(i, code, payloads[-1][0])
    found.finish()
    for i, ((payload, expected), (cur, _), (_, baseline)) in enumerate(zip(payloads, pairs, sources)):
        assert torch.equal(payload, expected), f"payload {i}"
        assert torch.equal(_bits(baseline), _bits(cur)), f"baseline {i}"
    received = sparse_codec.BucketReceiver(torch.device("cpu"), len(cases))
    lives = [_strided(base) if strided else base.clone() for (_, base), (*_, strided) in zip(pairs, cases)]
    codes = [code for *_, code, _ in cases]
    counts = [c.numel() if code == DENSE else k for (c, _), code, k in zip(pairs, codes, found.counts)]  # (dense: all)
    header = [v for code, k in zip(codes, counts) for v in (code, k)]
    layout = message_layout(header, [c.numel() for c, _ in pairs], [c.element_size() for c, _ in pairs], "m")
    arriving = torch.zeros(layout.nbytes, dtype=torch.uint8)  # one message, added and prepared before it arrives
    received.add_message(0, layout, [dtype for _, dtype, *_ in cases], arriving, lives)
    received.prepare()
    arriving.copy_(torch.cat([payload for payload, _ in payloads]))
    assert received.commit() == []
    assert all(torch.equal(_bits(live), _bits(cur)) for live, (cur, _) in zip(lives, pairs))
    blocked = payloads[0][0].clone()
    blocked[16 : 16 + 4].view(torch.int16)[:] = torch.tensor([7, 5], dtype=torch.int16)  # out of order
    indices = payloads[3][0].clone()
    indices[:8].view(torch.int32)[:] = indices[:8].view(torch.int32).flip(0)  # out of order
    for bad, corrupt in ((0, blocked), (3, indices)):  # fused, or on the torch path; beside good fused boxes
        good = [(2, payloads[2][0]), (6, payloads[6][0])]  # bitmap, blocked
        malformed_boxes_write_nothing(cases, pairs, found.counts, [(bad, corrupt), *good])
    rounds_over_overlapping_boxes()
    rounds_with_kept_tables()
    print("ok")


def malformed_boxes_write_nothing(cases, pairs, counts, boxes) -> None:
    """A bucket whose first box is malformed (the rest well formed) names only that box and writes
    none: the fused writes, queued behind the checks, see the bucket's guard raised."""
    received = sparse_codec.BucketReceiver(torch.device("cpu"), len(boxes))
    lives = []
    for slot, (i, payload) in enumerate(boxes):
        (cur, base), (_, dtype, _, code, _) = pairs[i], cases[i]
        lives.append((base.clone(), base))
        received.add(slot, code, counts[i], cur.numel(), dtype, payload, lives[-1][0])
    assert received.commit() == [0]
    assert all(torch.equal(_bits(live), _bits(base)) for live, base in lives)


def rounds_over_overlapping_boxes() -> None:
    """Two rounds over one bucket (the second reuses the first's geometry), whose two boxes of
    one tensor overlap: each round's payloads match the torch codec against the baseline as it
    was, and after each round the baseline is what was sent."""
    cur = torch.zeros(9000, dtype=torch.bfloat16)
    baseline = cur.clone()
    spans = [(0, 6000), (3000, 9000)]
    for seed, density in ((7, 0.01), (8, 0.3)):
        gen = torch.Generator().manual_seed(seed)
        changed = torch.rand(9000, generator=gen) < density
        cur[changed] = (cur[changed].float() + 1.0).to(torch.bfloat16)
        before = baseline.clone()
        pairs = [(cur[a:b], baseline[a:b]) for a, b in spans]
        found = sparse_codec.BucketChanges(pairs, [(0, (a,), (b - a,)) for a, b in spans])
        outs = []
        for i, (a, b) in enumerate(spans):
            reference = sparse_codec.Changes(cur[a:b], before[a:b])
            code = BLOCKED if density < 0.1 else BITMAP
            expected = torch.zeros(encoded_nbytes(code, b - a, reference.count, 2), dtype=torch.uint8)
            sparse_codec.encode(code, reference, expected)
            assert found.counts[i] == reference.count, (seed, i)
            outs.append((torch.zeros_like(expected), expected))
            found.encode(i, code, outs[-1][0])
        found.finish()
        assert all(torch.equal(out, expected) for out, expected in outs), seed
        assert torch.equal(_bits(baseline), _bits(cur)), seed


def rounds_with_kept_tables() -> None:
    """Four rounds into the same live views (one strided) through receivers that keep the bucket's
    tables (`sparse_codec.KeptTables`): the second and fourth with the first's shape (each box's
    encoding and density class) but other counts, the third with another; each writes the live
    views bit for bit, and the fourth finds the first's tables."""
    cases = [((40, 1000), BITMAP), ((3, 70_000), BLOCKED), ((300, 70), BITMAP)]
    bases = [
        (torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 10).to(torch.bfloat16)
        for i, (shape, _) in enumerate(cases)
    ]
    lives = [bases[0].clone(), bases[1].clone(), _strided(bases[2])]
    kept = sparse_codec.KeptTables()
    for seed, densities, codes in (
        (20, (0.05, 0.01, 0.1), (BITMAP, BLOCKED, BITMAP)),
        (21, (0.06, 0.02, 0.09), (BITMAP, BLOCKED, BITMAP)),
        (22, (0.3, 0.01, 0.01), (BITMAP, BITMAP, BLOCKED)),
        (23, (0.04, 0.015, 0.11), (BITMAP, BLOCKED, BITMAP)),
    ):
        shapes = len(kept.tables)
        gen = torch.Generator().manual_seed(seed)
        curs, header, payloads = [], [], []
        for base, density, code in zip(bases, densities, codes):
            cur = torch.where(torch.rand(base.shape, generator=gen) < density, base + 1, base)
            changes = sparse_codec.Changes(cur, base)
            payload = torch.zeros(encoded_nbytes(code, cur.numel(), changes.count, 2), dtype=torch.uint8)
            sparse_codec.encode(code, changes, payload)
            curs.append(cur)
            header += [code, changes.count]
            payloads.append(payload)
        layout = message_layout(header, [c.numel() for c in curs], [2] * len(curs), "m")
        received = sparse_codec.BucketReceiver(torch.device("cpu"), len(curs), kept)
        arriving = torch.zeros(layout.nbytes, dtype=torch.uint8)
        received.add_message(0, layout, [torch.bfloat16] * len(curs), arriving, lives)
        arriving.copy_(torch.cat(payloads))
        assert received.commit() == [], seed
        assert all(torch.equal(_bits(live), _bits(cur)) for live, cur in zip(lives, curs)), seed
        assert seed != 23 or len(kept.tables) == shapes == 2, (seed, shapes)
        bases = curs


if __name__ == "__main__":
    main()
