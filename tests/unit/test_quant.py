"""Block-quantized FP8 destinations: trainers quantize their shards, and what the plan delivers
equals quantizing the whole tensor, bit for bit, for every layout pair the planner supports.

The reference is the block formula from its definition (`reference`); the trainer ranks run
the real `QuantStage` in threads over an in-process transport (`Hub`), then every planned
transfer is applied from their endpoints."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rl_sync.engine.endpoint import Endpoint
from rl_sync.engine.quantize import QuantStage
from rl_sync.planning.layout import Box, Layout, Mesh, Replicate, Shard
from rl_sync.planning.plan import SideSpec, join_specs, plan_model
from rl_sync.planning.quant import amax_exchange, dest_scale_layout, grid_shape, scale_name
from rl_sync.transport.base import Pending, Transport


def reference(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the whole tensor: per block of the last two dims, amax = max |x| (fp32, at least
    1e-4), scale = amax / 448, value = x * (1 / scale) cast to float8_e4m3fn."""
    *lead, n, k = x.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    padded = torch.zeros(*lead, rows * bn, cols * bk, dtype=torch.float32)
    padded[..., :n, :k] = x.float()
    blocks = padded.view(*lead, rows, bn, cols, bk)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-4) / 448.0
    q = (blocks * (1.0 / scale)[..., :, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(*lead, rows * bn, cols * bk)[..., :n, :k], scale


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit patterns (NaN payloads and -0.0 compare exactly)."""
    return t.contiguous().view(torch.uint8)


class _Arrival(Pending):
    def __init__(self, hub: Hub, rank: int, recvs):
        self.hub, self.rank, self.recvs = hub, rank, recvs

    def wait(self, deadline: float) -> None:
        for peer, buf in self.recvs:
            buf.copy_(self.hub.take(peer, self.rank, deadline))


class Hub:
    """Mailboxes between in-process ranks (threads)."""

    def __init__(self) -> None:
        self.boxes: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.cond = threading.Condition()

    def take(self, src: int, dst: int, deadline: float) -> torch.Tensor:
        with self.cond:
            while not self.boxes.get((src, dst)):
                if not self.cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"rank {dst}: nothing from rank {src}")
            return self.boxes[(src, dst)].pop(0)


class ThreadTransport(Transport):
    def __init__(self, hub: Hub, rank: int, world_size: int, device: torch.device):
        self.hub, self.rank, self.world_size, self.device = hub, rank, world_size, device
        self.posts = 0

    def post(self, sends, recvs, label: str = "") -> Pending:
        self.posts += 1
        with self.hub.cond:
            for peer, buf in sends:
                self.hub.boxes.setdefault((self.rank, peer), []).append(buf.clone())
            self.hub.cond.notify_all()
        return _Arrival(self.hub, self.rank, recvs)

    def broadcast(self, buf, root, deadline):
        raise NotImplementedError

    def barrier(self, deadline):
        raise NotImplementedError

    def close(self):
        pass

    def abort(self):
        pass


def _plan(shape, src: Layout, dst: Layout, block, dtype="bfloat16"):
    scales = SideSpec(scale_name("w"), "float32", grid_shape(shape, block), dest_scale_layout(dst, shape, block, "w"))
    specs = join_specs([SideSpec("w", dtype, shape, src)], [SideSpec("w", "float8_e4m3fn", shape, dst, block), scales])
    return plan_model(specs)


def _box(t: torch.Tensor, box: Box) -> torch.Tensor:
    return t[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]


def push(x: torch.Tensor, src: Layout, dst: Layout, block, wanted=None):
    """Quantize on every trainer (threads), deliver every planned transfer; returns what the
    destination ranks hold, assembled whole, and the trainers' transports."""
    shape = tuple(x.shape)
    plan = _plan(shape, src, dst, block, str(x.dtype).removeprefix("torch."))
    hub, ranks = Hub(), src.mesh.ranks
    stages = {r: QuantStage(plan, plan.blocks, r) for r in ranks}
    transports = {r: ThreadTransport(hub, r, len(ranks), x.device) for r in ranks}
    shards = {
        r: {"w": Endpoint(_box(x, b).clone(), b.offsets)}
        for r, b in zip(ranks, src.all_boxes(shape))
        if not b.is_empty()
    }
    endpoints = {r: stages[r].endpoints(shards[r]) for r in shards}
    errors = []

    def run(r):
        try:
            stages[r].run(shards[r], transports[r], time.monotonic() + 30, wanted)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in shards]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    out = {
        "w": torch.full(shape, float("nan"), device=x.device).to(torch.float8_e4m3fn),
        scale_name("w"): torch.full(grid_shape(shape, block), float("nan"), device=x.device),
    }
    for i, spec in enumerate(plan.specs):
        tensor_plan = plan.tensor_plan(i)
        for t in tensor_plan.transfers + tensor_plan.local_copies:
            _box(out[spec.name], t.box).copy_(endpoints[t.src_rank][spec.name].view(t.offsets, t.sizes))
    return out, transports


def _random(shape, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])
    return x.to(dtype)


def fsdp(n):
    return Layout(Mesh((n,)), (Shard(0),))


def workers(shape, placements, start):
    return Layout(Mesh(shape, start_rank=start), placements)


LAYOUTS = [
    # (name, shape, trainer layout, worker layout, block)
    ("FSDP3 uneven rows into TP2 columns", (1024, 300), fsdp(3), workers((2,), (Shard(0),), 3), (128, 128)),
    ("FSDP3 into TP4 rows", (300, 1024), fsdp(3), workers((4,), (Shard(1),), 3), (128, 128)),
    (
        "FSDP2 x TP2 trainers into TP2 rows",
        (520, 256),
        Layout(Mesh((2, 2)), (Shard(0), Shard(1))),
        workers((2,), (Shard(1),), 4),
        (128, 128),
    ),
    (
        "HSDP (2 replicas x 2) into 2 engines x TP2",
        (700, 512),
        Layout(Mesh((2, 2)), (Replicate(), Shard(0))),
        workers((2, 2), (Replicate(), Shard(1)), 4),
        (128, 128),
    ),
    (
        "trainers cutting columns",
        (256, 1000),
        Layout(Mesh((3,)), (Shard(1),)),
        workers((2,), (Shard(0),), 3),
        (128, 128),
    ),
    ("shards smaller than a block: 3 ranks share one", (40, 32), fsdp(7), workers((2,), (Shard(1),), 7), (16, 8)),
    ("replicated trainers (DDP)", (300, 200), Layout.replicated(Mesh((2,))), workers((2,), (Shard(1),), 2), (128, 100)),
    ("GQA kv heads replicated over TP4", (256, 512), fsdp(3), workers((2, 2), (Shard(0), Replicate()), 3), (128, 128)),
    (
        "experts with EP, trainers sharding rows",
        (4, 256, 200),
        Layout(Mesh((2,)), (Shard(1),)),
        workers((2,), (Shard(0),), 2),
        (128, 128),
    ),
    (
        "experts TP-sharded, trainers sharding experts",
        (3, 256, 260),
        fsdp(2),
        workers((2,), (Shard(1),), 2),
        (128, 128),
    ),
]


@pytest.mark.parametrize("name, shape, src, dst, block", LAYOUTS, ids=[entry[0] for entry in LAYOUTS])
def test_delivered_fp8_values_and_scales_equal_quantizing_the_whole_tensor(name, shape, src, dst, block):
    x = _random(shape)
    got, _ = push(x, src, dst, block)
    want_q, want_scale = reference(x, block)
    assert torch.equal(bits(got[scale_name("w")]), bits(want_scale))
    assert torch.equal(bits(got["w"]), bits(want_q))


def test_fp32_sources_zero_blocks_nan_and_negative_zero_quantize_like_the_reference():
    x = _random((300, 256), seed=3, dtype=torch.float32)
    x[:128, :128] = 0.0
    x[130, 5] = -0.0
    x[200, 200] = float("nan")
    got, _ = push(x, fsdp(3), workers((2,), (Shard(1),), 3), (128, 128))
    want_q, want_scale = reference(x, (128, 128))
    assert torch.equal(bits(got[scale_name("w")]), bits(want_scale))
    assert torch.equal(bits(got["w"]), bits(want_q))
    assert got[scale_name("w")][0, 0].item() == pytest.approx(1e-4 / 448)


def test_a_rank_holding_nothing_of_a_quantized_tensor_quantizes_nothing():
    x = _random((4, 32))
    got, _ = push(x, fsdp(7), workers((2,), (Shard(1),), 7), (2, 8))  # ranks 4 to 6 hold empty pieces
    want_q, want_scale = reference(x, (2, 8))
    assert torch.equal(bits(got["w"]), bits(want_q)) and torch.equal(bits(got[scale_name("w")]), bits(want_scale))
    plan = _plan((4, 32), fsdp(7), workers((2,), (Shard(1),), 7), (2, 8))
    idle = QuantStage(plan, plan.blocks, 6)
    assert idle.endpoints({}) == {}
    idle.run({}, ThreadTransport(Hub(), 6, 7, torch.device("cpu")), time.monotonic() + 5, None)


def test_the_exchange_is_only_between_ranks_sharing_a_cut_block():
    parts = amax_exchange((1000, 300), fsdp(3), (128, 128))
    assert [(p.sender, p.receiver, p.box) for p in parts] == [
        (1, 0, Box((2, 0), (1, 3))),
        (0, 1, Box((2, 0), (1, 3))),
        (2, 1, Box((5, 0), (1, 3))),
        (1, 2, Box((5, 0), (1, 3))),
    ]
    assert amax_exchange((1024, 300), fsdp(4), (128, 128)) == ()
    _, transports = push(_random((1024, 256)), fsdp(4), workers((2,), (Shard(0),), 4), (128, 128))
    assert [t.posts for t in transports.values()] == [0, 0, 0, 0]


def test_vllm_quantizer_gives_the_same_values_and_scales():
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm")
    x = _random((300, 260), seed=5)
    q, scale = deep_gemm.per_block_cast_to_fp8(x, [128, 128])
    want_q, want_scale = reference(x, (128, 128))
    assert torch.equal(bits(q), bits(want_q)) and torch.equal(bits(scale), bits(want_scale))


def test_destination_shards_that_cut_blocks_are_refused():
    with pytest.raises(
        ValueError,
        match=r"w: the destination splits dim 0 \(size 1000\) into shards of 500 over 2 "
        r"ranks, which is not a multiple of the quantization block 128",
    ):
        dest_scale_layout(Layout(Mesh((2,)), (Shard(0),)), (1000, 512), (128, 128), "w")


def test_fixed_size_destination_shards_must_be_whole_blocks():
    with pytest.raises(
        ValueError,
        match=r"w: the destination splits dim 0 \(size 150\) into shards of 160 over 2 "
        r"ranks, which is not a multiple of the quantization block 128",
    ):
        dest_scale_layout(Layout(Mesh((2,)), (Shard(0, 160),)), (150, 256), (128, 128), "w")
    scales = dest_scale_layout(Layout(Mesh((2,)), (Shard(0, 256),)), (300, 256), (128, 128), "w")
    assert scales.all_boxes((3, 2)) == [Box((0, 0), (2, 2)), Box((2, 0), (1, 2))]


def test_integer_sources_and_missing_scales_are_refused():
    shape, dst = (256, 256), workers((2,), (Shard(0),), 2)
    with pytest.raises(
        ValueError,
        match=r"tensor 'w': the destination keeps it as block-quantized float8_e4m3fn, "
        r"which needs a floating-point source .* the trainers hold int32",
    ):
        _plan(shape, fsdp(2), dst, (128, 128), dtype="int32")
    with pytest.raises(ValueError, match=r"so it must bind 'w::scale_inv' as float32 \(2, 2\); it binds nothing"):
        join_specs(
            [SideSpec("w", "bfloat16", shape, fsdp(2))], [SideSpec("w", "float8_e4m3fn", shape, dst, (128, 128))]
        )
    with pytest.raises(
        ValueError,
        match="tensor 'w@1:0:128': the destination binds a part of a tensor "
        "block-quantized; FP8 destinations take whole checkpoint tensors",
    ):
        join_specs(
            [SideSpec("w@1:0:128", "bfloat16", (256, 128), fsdp(2))],
            [SideSpec("w@1:0:128", "float8_e4m3fn", (256, 128), dst, (128, 128))],
        )
