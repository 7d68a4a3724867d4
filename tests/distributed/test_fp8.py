"""bf16 FSDP2 `transformers` trainers into the project's FP8 engine: trainers quantize on the
way, every FP8 value and block scale a worker keeps is bit-exact against quantizing the full
tensor, bytes are the FP8 count, and logits stay within what FP8 weights imply, through
AdamW steps, sparse rounds (a moved block amax included) and broadcast rounds."""

from __future__ import annotations

import pytest
import ray
import torch

transformers = pytest.importorskip("transformers")

from actors import WeightSync  # noqa: E402
from actors.cluster import free_init_url  # noqa: E402
from rl_sync.models.config import Parallel  # noqa: E402
from rl_sync.planning.quant import is_scale_name, scale_name, scaled_name  # noqa: E402
from rl_sync.sparse.patches import SparseWeightPatch  # noqa: E402

from ..unit.test_quant import bits, reference  # noqa: E402
from .conftest import loopback_config  # noqa: E402
from .harness import POOL  # noqa: E402
from .test_models import SMALL, Trainer, Worker  # noqa: E402  (the same classes: pooled actors are reused)

BLOCK = (4, 8)
"""Blocks small enough that 3 FSDP trainers cut them (32 rows: 11 + 11 + 10) and every TP2 slot
holds whole ones (q 16 rows, k and v 4, gate and up 24, down and o inputs 24 and 16)."""
TOLERANCE = 0.1
"""Relative error of the logits (norm of the difference over the norm of the trainer's): an
e4m3 value rounds with at most 2^-4 relative error (3 mantissa bits), about 3.6% rms over
uniformly spread rounding; independent errors add in quadrature through each projection, so
a two-layer model's logits move a few percent, and 10% bounds it with room for the bf16
trainer's own rounding (2^-8)."""


def _bound(actor) -> dict:
    """Bound views by name (FP8 as its bytes: Ray's pickling of torch cannot rebuild float8 storage)."""
    out = {}
    for name, e in actor._rl_sync_endpoints("worker").items():
        value = e.tensor.detach().clone()
        out[name] = (e.origin, value.view(torch.uint8) if value.dtype == torch.float8_e4m3fn else value)
    return out


def _check(full: dict, bound: dict) -> int:
    """Every bound tensor equals the reference; returns the bytes the worker keeps."""
    kept = 0
    for name, (origin, value) in bound.items():
        base = scaled_name(name)
        if value.dtype == torch.uint8:
            value = value.view(torch.float8_e4m3fn)
        if value.dtype == torch.float8_e4m3fn or is_scale_name(name):
            want = reference(full[base], BLOCK)[1 if is_scale_name(name) else 0]
        else:
            want = full[name]
        want = want[tuple(slice(o, o + s) for o, s in zip(origin, value.shape))]
        assert torch.equal(bits(value), bits(want)), f"{name} is not bit-exact"
        kept += value.numel() * value.element_size()
    return kept


def _logits_error(trainers, workers, tokens) -> float:
    reference_logits = ray.get([t.logits.remote(tokens) for t in trainers])[0].float()
    logits = ray.get([w.forward.remote(tokens) for w in workers])[0].float()
    return ((logits - reference_logits).norm() / reference_logits.norm()).item()


def _sync_and_check(sync, trainers, workers, mode: str, modes: list) -> tuple[list, object]:
    stats = sync.push(mode=mode)
    modes.append(stats.mode)
    full = ray.get([t.full_state.remote() for t in trainers])[0]
    kept = [_check(full, bound) for bound in ray.get([w.call.remote(_bound) for w in workers])]
    return kept, stats


def _raise_one_amax(actor) -> None:
    """Make one element of `q_proj` the largest of its block by far (its block's scale moves)."""
    param = dict(actor.model.named_parameters())["model.layers.0.self_attn.q_proj.weight"]
    with torch.no_grad():
        local = param.to_local()
        if local.numel():
            local[0, 0] = 4.0


@pytest.mark.parametrize(
    "family, par",
    [
        # dense FP8 at TP2 (2 min on a 2-core machine); the MoE case covers the same writes, relayed
        pytest.param("llama", Parallel(tp=2), marks=pytest.mark.slow),
        ("qwen3_moe", Parallel(engines=2, tp=2, ep=True)),
    ],
)
def test_fsdp2_bf16_trainers_into_the_fp8_engine(ray_session, family, par):
    """qwen3_moe: two engine replicas, relayed (`SyncConfig.relay`): FP8 values and scales are
    forwarded by the first replica's workers, dense and sparse."""
    extra = {
        "llama": {},
        "qwen3_moe": dict(head_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    }[family]
    config = transformers.AutoConfig.for_model(family, **SMALL, **extra).to_dict()
    url, wurl = free_init_url("127.0.0.1"), free_init_url("127.0.0.1")
    trainers = POOL.take(Trainer, [(i, 3, config, url, 0, 0.1, "bfloat16") for i in range(3)])
    workers = POOL.take(Worker, [(r, par, config, wurl, (), None, BLOCK, "bfloat16") for r in range(par.size)])
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(1))
    modes = []
    try:
        sync = WeightSync.create(trainers, workers, loopback_config(relay="on" if par.engines > 1 else "off"))
        kept, stats = _sync_and_check(sync, trainers, workers, "sparse", modes)  # dense: the first round
        if par.engines > 1:
            assert [r.sent_bytes > 0 for r in stats.ranks if r.role == "worker"] == [True] * par.tp + [False] * par.tp
        bf16 = [
            sum(v.numel() * 2 for n, (_, v) in b.items() if not is_scale_name(n))
            for b in ray.get([w.call.remote(_bound) for w in workers])
        ]
        received = [next(r.received_bytes for r in stats.ranks if r.rank == 3 + j) for j in range(par.size)]
        print(
            f"{family}: bytes into each worker {received} (FP8 values + scales + unquantized) against "
            f"{bf16} for a bf16 engine: {[round(r / b, 3) for r, b in zip(received, bf16)]}"
        )
        assert received == kept
        first_error = _logits_error(trainers, workers, tokens)
        for step in range(3):
            ray.get(
                [
                    t.train_step.remote(torch.randint(0, 120, (2, 12), generator=torch.Generator().manual_seed(step)))
                    for t in trainers
                ]
            )
        _sync_and_check(sync, trainers, workers, "sparse", modes)
        error = _logits_error(trainers, workers, tokens)
        print(f"{family}: logits relative error {first_error:.4f} at init, {error:.4f} after 3 AdamW steps")
        assert first_error < TOLERANCE and error < TOLERANCE
        q = "model.layers.0.self_attn.q_proj.weight"
        before = reference(ray.get([t.full_state.remote() for t in trainers])[0][q], BLOCK)
        ray.get([t.call.remote(_raise_one_amax) for t in trainers])
        _, stats = _sync_and_check(sync, trainers, workers, "sparse", modes)
        after = reference(ray.get([t.full_state.remote() for t in trainers])[0][q], BLOCK)
        moved = [int((bits(a) != bits(b)).view(a.numel(), -1).any(dim=1).sum()) for a, b in zip(after, before)]
        assert moved[1] == 3 and moved[0] > 3  # three block scales moved, and with them their blocks' values
        assert sum(r.changed_elements for r in stats.ranks) == sum(moved)  # exactly those, and nothing else
        ray.get([t.train_step.remote(tokens) for t in trainers])
        _sync_and_check(sync, trainers, workers, "broadcast", modes)
        assert modes == ["m2n", "sparse", "sparse", "broadcast"]
        if family == "llama":  # a subset naming one tensor's scales and an unquantized tensor
            ray.get([t.train_step.remote(tokens) for t in trainers])
            sync.push(names=[scale_name(q), "model.norm.weight"])  # the values travel with their scales
            full = ray.get([t.full_state.remote() for t in trainers])[0]
            for bound in ray.get([w.call.remote(_bound) for w in workers]):
                _check(full, {n: v for n, v in bound.items() if scaled_name(n) in (q, "model.norm.weight")})
            with pytest.raises(
                ValueError,
                match=rf"push_patches: \['{q}'\] are kept block-quantized \(FP8\) on the "
                r"workers; patches carry unquantized values",
            ):
                sync.push_patches([SparseWeightPatch(q, torch.tensor([0]), torch.tensor([1.0]))])
        sync.close()
    finally:
        POOL.give_back(Trainer, trainers)
        POOL.give_back(Worker, workers)


def test_a_block_that_cuts_a_tp_shard_fails_init_and_writes_nothing(ray_session):
    config = transformers.AutoConfig.for_model("llama", **SMALL).to_dict()
    url, wurl = free_init_url("127.0.0.1"), free_init_url("127.0.0.1")
    par = Parallel(tp=2)
    trainers = POOL.take(Trainer, [(i, 2, config, url) for i in range(2)])
    workers = POOL.take(Worker, [(r, par, config, wurl, (), None, (5, 8)) for r in range(par.size)])
    try:
        with pytest.raises(
            ValueError,
            match=r"worker rank 0: 'model.layers.0.self_attn.q_proj.weight': the destination "
            r"splits dim 0 \(size 32\) into shards of 16 over 2 ranks, which is not a "
            r"multiple of the quantization block 5",
        ):
            WeightSync.create(trainers, workers, loopback_config())
        weights = ray.get(
            workers[0].call.remote(
                lambda self: self.model.params["model.layers.0.mlp.down_proj.weight"].view(torch.uint8)
            )
        )
        assert not weights.any()
    finally:
        POOL.give_back(Trainer, trainers)
        POOL.give_back(Worker, workers)
