"""A worker rank follows what its engine replaced or moved, and refuses the rounds that could not
fill it (no Ray, no process group: the rank's own calls)."""

from __future__ import annotations

import pytest
import torch

from rl_sync.bind.binder import Binder
from rl_sync.models.config import ModelConfig, Parallel
from rl_sync.models.tp_model import TPModel
from rl_sync.planning.layout import Layout, Mesh
from rl_sync.planning.quant import scale_name
from rl_sync.rank import WorkerRank
from rl_sync.rank.kept import KeptDestinations
from rl_sync.rank.side import DescribeOptions
from rl_sync.rank.worker import _unfilled
from rl_sync.storage import Destination
from rl_sync.wire.messages import RoundInfo

WHOLE = Layout.replicated(Mesh((1,)))

pytestmark = pytest.mark.usefixtures("each_scan")


class Held(WorkerRank):
    """A worker whose destinations are a dict it keeps (as `actors.ready.InferenceWorker`)."""

    def __init__(self, held: dict):
        self.held = held

    def rl_sync_destinations(self, checkpoint):
        return self.held


def _worker(double_buffer: bool) -> Held:
    worker = Held({n: Destination(torch.zeros(4, 3), WHOLE, (4, 3), torch.float32) for n in ("w", "v")})
    checkpoint = {"w": ("float32", (4, 3)), "v": ("float32", (4, 3))}
    worker._rl_sync_describe("worker", 0, 1, DescribeOptions(checkpoint=checkpoint, double_buffer=double_buffer))
    return worker


def _round(version: int, mode: str = "m2n", names: tuple[str, ...] | None = None) -> RoundInfo:
    return RoundInfo(version, mode, names, 10.0, False)  # type: ignore[arg-type]  # a Mode literal


def _replace(worker: Held, name: str) -> torch.Tensor:
    new = torch.full((4, 3), float("nan"))
    worker.held[name] = Destination(new, WHOLE, (4, 3), torch.float32)
    return new


def test_a_rebound_weight_is_written_by_a_dense_round_of_it_and_refused_by_the_others():
    worker = _worker(double_buffer=False)
    worker._rl_sync_version = 1
    new = _replace(worker, "w")
    assert worker._rl_sync_version_of() is None, "the new tensor holds what the engine put there"
    for info, why in [
        (_round(2, "sparse"), "a sparse round writes only what changed"),
        (_round(2, "auto"), "a auto round writes only what changed"),
        (_round(2, "m2n", ("v",)), "this round carries other tensors, not ['w']"),
    ]:
        worker.held["w"] = Destination(new, WHOLE, (4, 3), torch.float32)  # replaced again: seen again
        with pytest.raises(ValueError) as raised:
            worker._rl_sync_before_round(info)
        assert str(raised.value) == (
            "worker rank 0: 'w' changed since the last round (replaced under its name) and was bound anew, so it "
            f"holds what the engine put there; {why}, so nothing was written; the next push runs every tensor "
            "dense (with auto_repair) or call repair()"
        )
    worker.held["w"] = Destination(new, WHOLE, (4, 3), torch.float32)
    worker._rl_sync_before_round(_round(2, "m2n", ("w", "v")))
    endpoint = worker._rl_sync_entries("worker").endpoints["w"]
    assert endpoint.tensor.data_ptr() == new.data_ptr() and endpoint.tensor._version == 0
    endpoint.tensor.fill_(2.0)
    assert new._version == 0, "the round writes through an alias: the engine's version counter stays"


def test_double_buffering_commits_into_the_rebound_weight_whatever_the_round_carried():
    worker = _worker(double_buffer=True)
    entries = worker._rl_sync_entries("worker")
    entries.endpoints["w"].tensor.fill_(5.0)  # the shadow, as a round leaves it
    new = _replace(worker, "w")
    worker._rl_sync_before_round(_round(2, "sparse", ("v",)))
    assert worker._rl_sync_entries("worker") is entries, "the shadows did not move: the compiled round replays"
    worker._rl_sync_commit(2)
    assert worker._rl_sync_record(2), "the coordinator records the version the commit wrote"
    assert torch.equal(new, torch.full((4, 3), 5.0)) and worker._rl_sync_version_of() == 2
    worker.held["w"].local.data = torch.zeros(4, 3)  # moved again, between the round and its commit
    worker._rl_sync_commit(3)
    assert torch.equal(worker.held["w"].local, torch.full((4, 3), 5.0))


def test_a_replacement_the_plan_cannot_take_names_what_changed():
    worker = _worker(double_buffer=False)
    worker.held["w"] = Destination(torch.zeros(4, 3, dtype=torch.bfloat16), WHOLE, (4, 3), torch.bfloat16)
    with pytest.raises(ValueError) as raised:
        worker._rl_sync_before_round(_round(2))
    assert str(raised.value) == (
        "worker rank 0: tensor 'w' is now bfloat16 of shape (4, 3) laid out Mesh((1,), start_rank=0)[R]; the "
        "group planned it as float32 of shape (4, 3) laid out Mesh((1,), start_rank=0)[R]; repair() plans it "
        "anew (the next push does, with auto_repair)"
    )
    worker.held["w"] = Destination(torch.zeros(4, 3), WHOLE, (4, 3), torch.float32, fallback=True)
    with pytest.raises(ValueError, match=r"^worker rank 0: destination 'w' is now a fallback; repair\(\) binds"):
        worker._rl_sync_before_round(_round(2))
    del worker.held["w"]
    with pytest.raises(ValueError, match=r"^worker rank 0: the destinations mapping now names \['v'\], the group"):
        worker._rl_sync_before_round(_round(2))


def test_a_replacement_sharing_memory_with_another_weight_is_refused_and_forgets_the_version():
    worker = _worker(double_buffer=False)
    worker._rl_sync_version = 1
    worker.held["w"] = Destination(worker.held["v"].local, WHOLE, (4, 3), torch.float32)
    with pytest.raises(ValueError, match=r"^worker rank 0: destinations '[wv]' and '[wv]' share memory"):
        worker._rl_sync_before_round(_round(2))
    assert worker._rl_sync_version_of() is None


def test_patches_refuse_a_rebound_weight():
    worker = _worker(double_buffer=False)
    worker.held["v"].local.set_(torch.ones(4, 3))  # the engine reallocated it: same object, new storage
    with pytest.raises(ValueError, match=r"'v' changed since the last round \(moved: new storage, or laid out"):
        worker._rl_sync_apply_patches(2, {"v": (torch.tensor([0]), torch.tensor([1.0]))})


def test_a_scale_travels_with_its_values():
    assert _unfilled(_round(2, "m2n", ("w",)), {scale_name("w"): "moved"}) is None
    assert _unfilled(_round(2, "m2n", (scale_name("w"),)), {"w": "moved"}) is None
    assert _unfilled(_round(2, "broadcast"), {"w": "moved"}) is None


QWEN3 = ModelConfig(
    family="qwen3", vocab=64, hidden=16, layers=1, heads=4, kv_heads=2, head_dim=4, intermediate=24, qk_norm=True
)


def test_a_binder_parameter_the_engine_replaces_is_cut_again_without_binding_anew():
    par = Parallel(tp=2)
    model = TPModel(QWEN3, par, 1)
    binder = Binder(QWEN3, par)
    checkpoint = {n: (torch.float32, s) for n, s in _shapes().items()}
    worker = Held(binder.bind(checkpoint, model.params, 1).destinations)
    options = {n: ("float32", s) for n, s in _shapes().items()}
    worker._rl_sync_describe("worker", 1, 2, DescribeOptions(checkpoint=options))
    target = "model.layers.0.self_attn.qkv_proj.weight"
    model.params[target] = torch.zeros_like(model.params[target])  # the engine reallocated qkv_proj
    worker._rl_sync_before_round(_round(2))
    endpoints = worker._rl_sync_entries("worker").endpoints
    for i, name in enumerate(("q_proj", "k_proj", "v_proj")):
        endpoints[f"model.layers.0.self_attn.{name}.weight"].tensor.fill_(i + 1)
    rows = [8, 4, 4]  # this rank's q, k and v rows of the fused parameter (4 and 2 heads of 4 over TP2)
    want = torch.cat([torch.full((r, 16), float(i + 1)) for i, r in enumerate(rows)])
    assert torch.equal(model.params[target], want), "the slots were cut again from the new parameter"


def _shapes() -> dict[str, tuple[int, ...]]:
    attn = "model.layers.0.self_attn"
    return {
        f"{attn}.q_proj.weight": (16, 16),
        f"{attn}.k_proj.weight": (8, 16),
        f"{attn}.v_proj.weight": (8, 16),
    }


class Swapping(Held):
    """A worker whose engine lets a commit swap the memory behind every weight."""

    def rl_sync_swappable(self):
        return self.held.keys()


def test_a_commit_that_swaps_is_no_rebinding_and_a_weight_replaced_after_it_gets_its_caught_up_spare():
    worker = Swapping({n: Destination(torch.zeros(4, 3), WHOLE, (4, 3), torch.float32) for n in ("w", "v")})
    options = DescribeOptions(checkpoint=dict.fromkeys(("w", "v"), ("float32", (4, 3))), double_buffer=True)
    worker._rl_sync_describe("worker", 0, 1, options)
    address = worker.held["w"].local.data_ptr()
    worker._rl_sync_before_round(_round(1))
    for endpoint in worker._rl_sync_entries("worker").endpoints.values():
        endpoint.tensor.fill_(1.0)
    worker._rl_sync_commit(1)
    assert worker.held["w"].local.data_ptr() != address, "the commit swapped the memory behind w"
    assert worker._rl_sync_record(1) and worker._rl_sync_version_of() == 1, "a swap is not a move"
    assert worker._rl_sync_kept is not None and worker._rl_sync_kept.follow() == {}
    new = _replace(worker, "w")  # w's spare holds the round before (zeros): caught up from the old w
    worker._rl_sync_before_round(_round(2, "sparse", ("v",)))
    worker._rl_sync_entries("worker").endpoints["v"].tensor.fill_(2.0)
    worker._rl_sync_commit(2)
    assert torch.equal(new, torch.ones(4, 3)) and torch.equal(worker.held["v"].local, torch.full((4, 3), 2.0))
    assert worker.held["v"].local.data_ptr() != new.data_ptr()
    worker._rl_sync_before_round(_round(3, "sparse", ("v",)))  # (the spares are stale after v's swap)
    worker._rl_sync_entries("worker").endpoints["v"].tensor.fill_(3.0)
    worker._rl_sync_commit(3)
    assert torch.equal(new, torch.ones(4, 3)), "w, rebound, commits by copy now: its spare stays its own"
    assert torch.equal(worker.held["v"].local, torch.full((4, 3), 3.0))


def test_a_worker_bound_for_a_round_that_writes_it_whole_reports_no_version_until_then():
    """An engine joining for the next push (or by relay) binds without seeding its buffers
    (`DescribeOptions.next_writes_all`): whatever version it held before, it holds none of it in
    them, so it reports none, and no later join takes it as the source of a catch-up."""
    worker = _worker(double_buffer=False)
    worker._rl_sync_version = 2
    checkpoint = {"w": ("float32", (4, 3)), "v": ("float32", (4, 3))}
    worker._rl_sync_describe("worker", 0, 1, DescribeOptions(checkpoint=checkpoint))
    assert worker._rl_sync_version_of() == 2, "bound anew, seeded: it still holds version 2"
    worker._rl_sync_describe("worker", 0, 1, DescribeOptions(checkpoint=checkpoint, next_writes_all=True))
    assert worker._rl_sync_version_of() is None


def test_a_rebinding_the_shadows_refuse_is_refused_again_until_a_repair(each_swap):
    """`n`, laid out anew in place after a commit swapped its storage (its spare holds the round
    before): the refusal records nothing, so every later follow refuses it again, and no commit
    swaps the resized storage."""
    n = torch.arange(5, dtype=torch.float32)
    mapping = {"n": Destination(n, WHOLE, (5,), torch.float32)}
    kept = KeptDestinations(mapping, 0, double_buffer=True, swappable={"n"})
    assert kept.shadow is not None
    kept.shadow.endpoints["n"].tensor.fill_(7.0)
    kept.commit(swap=True)
    n.untyped_storage().resize_(6 * 4)
    n.set_(n.untyped_storage(), 0, (5,), (1,))
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^worker rank 0: 'n' was laid out anew in place after a commit"):
            kept.follow()
    assert kept.moved()
