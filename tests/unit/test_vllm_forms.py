"""The loader form the vLLM binding receives a parameter in, the post-round reprocessing of a
weight that a later step released (what vLLM does on a CPU with AMX, shown on stand-in modules),
and what the probe records of a loader's copies."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from rl_sync.bind.infer import Geometry, Piece
from rl_sync.planning.layout import Box
from rl_sync.vllm.binding import _loader_buffers, _module_forms
from rl_sync.vllm.indices import index_tensor
from rl_sync.vllm.probe import ParamForm, Probe, _load, _Recorder, storage_key
from rl_sync.vllm.reload import Processor, _adopt


class _Linear(torch.nn.Module):
    """A linear layer as vLLM makes one: weight and bias in `params_dtype`."""

    def __init__(self, bias_dtype: torch.dtype):
        super().__init__()
        self.params_dtype = torch.bfloat16
        self.weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(6, dtype=bias_dtype), requires_grad=False)


def test_a_bias_vllm_widened_after_loading_is_received_in_the_dtype_its_loader_fills():
    """vLLM's reload metadata leaves a linear bias out; on a CPU with AMX its processing widens it
    to fp32, so its form is its shape in `params_dtype`, contiguous. A bias still in that dtype is
    written in place (no form), as are the weights vLLM's metadata does not name."""
    assert _module_forms(_Linear(torch.float32)) == {"bias": ParamForm((6,), (1,), torch.bfloat16)}
    assert _module_forms(_Linear(torch.bfloat16)) == {}


def test_a_buffer_the_next_round_writes_whole_is_not_seeded_but_keeps_the_loaders_fills(monkeypatch):
    """A joining engine's loader-form buffers are written whole by its catch-up or the full round
    after (`DescribeOptions.next_writes_all`): nothing is copied or zeroed into them first."""
    layer = _Linear(torch.float32)
    fills = Probe(fills={"bias": [(Geometry(4, (2,), (1,)), 7.0)]})
    seeded: list[torch.Tensor] = []
    zero = torch.Tensor.zero_
    monkeypatch.setattr(torch.Tensor, "zero_", lambda t: seeded.append(t) or zero(t))
    buffers, _ = _loader_buffers([layer], fills, {"bias": layer.bias})
    assert torch.equal(buffers[layer]["bias"], torch.tensor([0, 0, 0, 0, 7, 7], dtype=torch.bfloat16))
    assert len(seeded) == 1
    buffers, _ = _loader_buffers([layer], fills, {"bias": layer.bias}, unseeded={id(layer.bias)})
    assert torch.equal(buffers[layer]["bias"][4:], torch.tensor([7, 7], dtype=torch.bfloat16))
    assert len(seeded) == 1, "the buffer was zeroed"


class _Method:
    """A `quant_method` that keeps what it is given (the weight as loaded)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        pass


class _Attention(torch.nn.Module):
    """An attention layer deriving its state from `kv_b_proj`'s weight, then freeing it (vLLM's
    MLA on a CPU with AMX)."""

    def __init__(self, kv_b_proj: _Linear):
        super().__init__()
        self.kv_b_proj = kv_b_proj
        self.derived: torch.Tensor | None = None

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        weight = self.kv_b_proj.weight
        assert isinstance(weight, torch.Tensor)
        self.derived = weight.t().to(dtype).clone()
        self.kv_b_proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)


def test_a_weight_the_attention_freed_is_processed_again_for_it_every_round():
    """After each round, even one that changed nothing of it, the module the attention layer
    derives from is processed from its loader-form buffer, the attention derives from the new
    values, and frees the weight again."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    kv_b_proj = _Linear(torch.bfloat16)
    kv_b_proj.quant_method = _Method()
    attention = _Attention(kv_b_proj)
    model = torch.nn.ModuleDict({"attn": attention})
    record_metadata_for_reloading(model)
    attention.process_weights_after_loading(torch.bfloat16)  # as at load: derived, then freed
    assert kv_b_proj.weight.numel() == 0
    buffers = {kv_b_proj: {"weight": torch.arange(24, dtype=torch.bfloat16).view(6, 4)}}
    processor = Processor(model, torch.bfloat16, None, buffers, {"w": [kv_b_proj]}, [], [attention])
    for names in (None, ["another tensor"]):
        buffers[kv_b_proj]["weight"] += 1
        assert processor.after_update(names) == 1
        assert torch.equal(attention.derived, buffers[kv_b_proj]["weight"].t())
        assert kv_b_proj.weight.numel() == 0


class _NewBias(_Method):
    """A `quant_method` whose processing replaces the bias (vLLM's Marlin FP8 makes it contiguous)."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        bias = layer.bias
        assert isinstance(bias, torch.Tensor)
        layer.bias = torch.nn.Parameter(bias.detach() + 1, requires_grad=False)


@pytest.mark.parametrize("swap", [True, False])
def test_a_blocking_round_swaps_the_processed_weight_in_where_the_engine_allows(swap, each_swap):
    """Processing after a blocking round makes a new weight from the loader-form buffer; where the
    engine's addresses are free (`swap`), its memory is swapped in behind the live weight, which
    stays the same tensor, else copied into it. A tensor no buffer feeds (the bias, written in
    place, whose address the watch follows) is copied into, whatever processing made of it."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    layer = _Linear(torch.bfloat16)
    layer.quant_method = _NewBias()
    record_metadata_for_reloading(torch.nn.ModuleDict({"proj": layer}))
    live, address, bias = layer.weight, layer.weight.data_ptr(), layer.bias.data_ptr()
    buffers = {layer: {"weight": torch.arange(24, dtype=torch.bfloat16).view(6, 4)}}
    processor = Processor(layer, torch.bfloat16, None, buffers, {"w": [layer]}, [], [])
    assert processor.after_update(None, swap=swap) == 1
    assert layer.weight is live and torch.equal(live, buffers[layer]["weight"])
    assert (live.data_ptr() != address) == swap
    assert layer.bias.data_ptr() == bias and torch.equal(layer.bias, torch.ones(6, dtype=torch.bfloat16))


class _Counted(torch.nn.Module):
    """An attention layer counting its processing; `k_scale` its own tensor, `inner` a module
    inside it (MLA's `kv_b_proj`)."""

    def __init__(self, inner: torch.nn.Module | None = None):
        super().__init__()
        self.k_scale = torch.nn.Parameter(torch.ones(()), requires_grad=False)
        self.inner, self.processed = inner, 0

    def process_weights_after_loading(self, dtype: torch.dtype) -> None:
        self.processed += 1


def test_an_attention_layer_is_processed_after_a_round_that_wrote_into_it_and_only_then():
    """vLLM's reload processes every attention layer; a round processes those holding a tensor it
    wrote (their own scales, or a module inside them), whatever the write mode."""
    q_proj, kv_b_proj = _Linear(torch.bfloat16), _Linear(torch.bfloat16)
    plain, mla = _Counted(), _Counted(kv_b_proj)
    model = torch.nn.ModuleDict({"q_proj": q_proj, "plain": plain, "mla": mla})
    owners = {"q": [q_proj], "plain.k_scale": [plain], "kv_b": [kv_b_proj]}
    processor = Processor(model, torch.bfloat16, None, {}, {}, [], [plain, mla], owners)
    rounds = [(["q"], 0, 0), (["q", "plain.k_scale"], 1, 0), (["kv_b"], 0, 1), (None, 1, 1)]
    for names, plain_then, mla_then in rounds:
        before = plain.processed, mla.processed
        processor.after_update(names)
        assert (plain.processed - before[0], mla.processed - before[1]) == (plain_then, mla_then), names
    unknown = Processor(model, torch.bfloat16, None, {}, {}, [], [plain, mla])
    before = plain.processed + mla.processed
    unknown.after_update(["q"])
    assert plain.processed + mla.processed == before + 2, "owners unknown: every layer, as vLLM's reload"


def test_an_attention_layer_whose_implementation_reads_another_modules_parameter_is_its_reader(monkeypatch):
    """GPT-OSS keeps the attention sinks on the enclosing block and hands them to the attention
    layer's implementation, which derives a float32 copy when processed: a round writing the
    sinks must process that layer, so the binding lists it among the sinks' owners."""
    from types import SimpleNamespace

    from rl_sync.vllm import binding

    block = torch.nn.Module()
    block.sinks = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16), requires_grad=False)
    block.attn = _Counted()
    block.attn.impl = SimpleNamespace(sinks=block.sinks, scale=0.5)
    block.other = _Counted()
    monkeypatch.setattr(binding.compat, "deferred_attention", lambda m: isinstance(m, _Counted))
    readers = binding._impl_readers(binding._attention_layers(block))
    assert readers == {block.sinks.untyped_storage().data_ptr(): [block.attn]}
    processor = Processor(
        block, torch.bfloat16, None, {}, {}, [], [block.attn, block.other], {"s": [block, block.attn]}
    )
    processor.after_update(["s"])
    assert (block.attn.processed, block.other.processed) == (1, 0)


def _recorded(load, checkpoint: torch.Tensor, param: torch.Tensor) -> Probe:
    """What the probe records of `load(param, checkpoint)` (the loader's copies, not run)."""
    probe = Probe()
    sources = {storage_key(checkpoint): ("w", tuple(checkpoint.shape))}
    with _Recorder(sources, {storage_key(param): "p"}, probe):
        load(param, checkpoint)
    return probe


def test_a_copy_from_a_transposed_checkpoint_tensor_is_a_box_in_a_transposed_view():
    """GPT-2's loader copies a Conv1D weight `(in, out)` from its transpose, each TP rank a block of
    output rows: the probe records the checkpoint's box and the parameter's view in the
    checkpoint's dims, so writing the box into that view is what the loader's copy writes."""
    checkpoint = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)  # (in, out) as transformers keeps it
    param = torch.zeros(4, 6)  # rank 1's output rows [4, 8) as vLLM keeps them

    def load(p: torch.Tensor, w: torch.Tensor) -> None:
        p.copy_(w.t().narrow(0, 4, 4))

    probe = _recorded(load, checkpoint, param)
    assert probe.unresolved == {}
    (piece,) = probe.pieces["w"]
    assert piece.src == Box((0, 4), (6, 4)) and piece.dst == Geometry(0, (6, 4), (1, 6))
    torch.as_strided(param, piece.dst.sizes, piece.dst.strides, piece.dst.offset).copy_(checkpoint[:, 4:8])
    expected = torch.zeros(4, 6)
    load(expected, checkpoint)
    assert torch.equal(param, expected)


def test_a_copy_from_a_tensor_derived_from_the_checkpoint_is_unresolved_with_its_reason():
    checkpoint, param = torch.ones(4, 6), torch.zeros(6, 4)
    probe = _recorded(lambda p, w: p.copy_(w.t().contiguous()), checkpoint, param)
    assert probe.pieces == {} and probe.unresolved == {"": Probe.DERIVED}


class _Loads(torch.nn.Module):
    """A model whose loader copies each checkpoint tensor into the parameter of its name, from a
    copy of it for the names in `derive`, and raises on the names in `refuse`."""

    def __init__(self, derive: tuple[str, ...] = (), refuse: tuple[str, ...] = ()):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.derive, self.refuse = derive, refuse
        self.calls: list[list[str]] = []

    def load_weights(self, weights) -> None:
        weights = list(weights)
        self.calls.append([name for name, _ in weights])
        for name, tensor in weights:
            if name in self.refuse:
                raise KeyError(f"no parameter {name}")
            getattr(self, name).copy_(tensor.clone() if name in self.derive else tensor)


def _probed(model: _Loads) -> Probe:
    probe = Probe()
    tensors = {"a": torch.empty(4, device="meta"), "b": torch.empty(2, 3, device="meta")}
    _load(model, tensors, {storage_key(p): n for n, p in model.named_parameters()}, probe)
    return probe


def test_the_probe_loads_every_name_in_one_call_when_each_copy_names_its_checkpoint_tensor():
    model = _Loads()
    probe = _probed(model)
    assert model.calls == [["a", "b"]]
    assert probe.pieces == {
        "a": [Piece("a", Box((0,), (4,)), Geometry(0, (4,), (1,)))],
        "b": [Piece("b", Box((0, 0), (2, 3)), Geometry(0, (2, 3), (3, 1)))],
    }
    assert (probe.errors, probe.unresolved) == ({}, {})


def test_the_probe_loads_one_name_at_a_time_when_a_copy_or_an_error_names_no_checkpoint_tensor():
    """A copy from a tensor derived from a checkpoint tensor, or a loader's error, belongs to a name
    only when one name loads at a time: the one call is given up, and each name loads alone."""
    model = _Loads(derive=("b",))
    probe = _probed(model)
    assert model.calls == [["a", "b"], ["a"], ["b"]]
    assert list(probe.pieces) == ["a"] and probe.unresolved == {"b": Probe.DERIVED}
    model = _Loads(refuse=("a",))
    probe = _probed(model)
    assert model.calls == [["a", "b"], ["a"], ["b"]]
    assert list(probe.pieces) == ["b"] and probe.errors == {"a": "KeyError: 'no parameter a'"}


def test_copies_from_regrouped_heads_are_read_off_element_indices():
    """Bloom's loader regroups its fused `(heads x [q, k, v] x head_dim, hidden)` rows as
    `([q, k, v] x heads x head_dim, hidden)` with a `reshape` that copies: fed element indices,
    each TP rank's q, k and v rows are one box per head, landing where the loader's copy puts
    them; values the loader computes from the checkpoint's are no box."""
    heads, dim, hidden = 4, 2, 3
    checkpoint = index_tensor((heads * 3 * dim, hidden))
    param = torch.zeros(3 * heads * dim // 2, hidden, dtype=torch.int64)  # TP rank 1's q|k|v rows

    def load(p: torch.Tensor, w: torch.Tensor) -> None:
        regrouped = w.view(heads, 3, dim, hidden).transpose(0, 1).reshape(w.shape)
        for slot in range(3):
            rows = regrouped.narrow(0, slot * heads * dim + heads * dim // 2, heads * dim // 2)
            p.narrow(0, slot * heads * dim // 2, heads * dim // 2).copy_(rows)

    probe = Probe()
    recorder = _Recorder({storage_key(checkpoint): ("w", tuple(checkpoint.shape))}, {storage_key(param): "p"}, probe)
    with recorder:
        recorder.current, recorder.shape = "w", tuple(checkpoint.shape)
        load(param, checkpoint)
    assert probe.unresolved == {}
    pieces = probe.pieces["w"]
    assert sorted(p.src.offsets[0] for p in pieces) == [(h * 3 + s) * dim for h in (2, 3) for s in range(3)]
    assert all(p.src.sizes == (dim, hidden) for p in pieces)
    for p in pieces:
        torch.as_strided(param, p.dst.sizes, p.dst.strides, p.dst.offset).copy_(checkpoint[_rows(p.src)])
    expected = torch.zeros_like(param)
    load(expected, checkpoint)
    assert torch.equal(param, expected)
    computed = _recorded(lambda p, w: p.copy_(-torch.exp(w.float())), torch.ones(4, 6), torch.zeros(4, 6))
    assert computed.unresolved == {"": Probe.DERIVED}


def _rows(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def test_a_checkpoint_tensor_changed_in_place_is_copied_as_what_it_became():
    """gpt-oss's loader zeroes `w2_bias` in place on every TP rank past the first, then copies
    it: the probe records a fill of zeros (nothing of the checkpoint is kept there); any other
    change in place leaves the copy unresolved."""
    checkpoint, param = torch.ones(4, 6), torch.zeros(4, 6)
    zeroed = _recorded(lambda p, w: p.copy_(w.zero_()), checkpoint, param)
    assert zeroed.pieces == {} and zeroed.unresolved == {}
    assert zeroed.fills == {"p": [(Geometry(0, (4, 6), (6, 1)), 0.0)]}
    scaled = _recorded(lambda p, w: p.copy_(w.mul_(2)), checkpoint, param)
    assert scaled.pieces == {} and scaled.unresolved == {"w": Probe.DERIVED}
    assert torch.equal(checkpoint, torch.ones(4, 6)), "the probe changed the checkpoint tensor"


def _processed(value: float) -> torch.nn.Module:
    """A module as processing left it: its weight, a fresh tensor of the new values."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.full((4, 3), value), requires_grad=False)
    return module


def test_a_result_held_by_nothing_else_is_swapped_into_the_live_tensor(each_swap):
    live = torch.zeros(4, 3)
    processed = _processed(2.0)
    address = processed.weight.data_ptr()
    _adopt({"weight": live}, processed, swap={"weight"})
    assert live.data_ptr() == address and torch.equal(live, torch.full((4, 3), 2.0))


def test_a_result_a_kernel_kept_an_alias_of_is_copied_so_the_kernel_reads_the_new_values(each_swap):
    """vLLM's zentorch linear keeps `weight.detach()` in its closure: a swap would leave it on the
    old values."""
    live = torch.zeros(4, 3)
    address = live.data_ptr()
    processed = _processed(2.0)
    kernel_weight = processed.weight.detach()
    _adopt({"weight": live}, processed, swap={"weight"})
    assert live.data_ptr() == address and torch.equal(live, torch.full((4, 3), 2.0))
    assert torch.equal(kernel_weight, torch.full((4, 3), 2.0))


def test_without_swap_the_result_is_copied():
    live = torch.zeros(4, 3)
    address = live.data_ptr()
    _adopt({"weight": live}, _processed(3.0))
    assert live.data_ptr() == address and torch.equal(live, torch.full((4, 3), 3.0))


def test_a_pytorch_that_cannot_count_storage_holders_copies(monkeypatch):
    from rl_sync.vllm import reload

    monkeypatch.setattr(reload, "_USE_COUNT", None)
    monkeypatch.setattr(reload, "_LONE_HOLDERS", None)
    live = torch.zeros(4, 3)
    address = live.data_ptr()
    _adopt({"weight": live}, _processed(4.0), swap={"weight"})
    assert live.data_ptr() == address and torch.equal(live, torch.full((4, 3), 4.0))


def test_a_result_a_kernel_kept_itself_is_copied_so_the_kernel_reads_the_new_values():
    """vLLM's CPU MoE keeps `w13_bias` itself in its quantization config."""
    live = torch.zeros(4, 3)
    address = live.data_ptr()
    processed = _processed(5.0)
    config = {"bias": processed.weight}
    _adopt({"weight": live}, processed, swap={"weight"})
    assert live.data_ptr() == address and torch.equal(config["bias"], torch.full((4, 3), 5.0))


class _Kernel:
    """What processing leaves on a layer: a packed copy of its weight."""

    def __init__(self, weight: torch.Tensor):
        self.packed = weight.clone()


class _Packing:
    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        layer.__dict__["kernel"] = _Kernel(layer.get_parameter("weight"))


class _Loaded(torch.nn.Module):
    """A layer as vLLM makes one: its weight carries a loader bound to it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(6, 4, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = self.load
        self.quant_method = _Packing()

    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded)


def test_a_commit_leaves_nothing_holding_its_twin_or_the_kernels_it_replaced(each_swap):
    """A twin holds the previous round's memory after the swaps: once the release ran, neither it
    nor the kernel it replaced may live on (vLLM's reload binds its kept metadata to the layer it
    restores, here the twin), round after round, without the garbage collector."""
    import gc
    import weakref

    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    layer = _Loaded()
    model = torch.nn.ModuleDict({"layer": layer})
    record_metadata_for_reloading(model)
    layer.quant_method.process_weights_after_loading(layer)  # as at load
    buffers = {layer: {"weight": torch.zeros(6, 4, dtype=torch.bfloat16)}}
    processor = Processor(model, torch.bfloat16, None, buffers, {"w": [layer]}, [], [])
    gc.disable()
    try:
        for value in (1.0, 2.0, 3.0):
            assert processor.prepare(None, lambda buffer, v=value: torch.full_like(buffer, v)) == 1
            twin, replaced = weakref.ref(processor.prepared[id(layer)]), weakref.ref(layer.kernel)
            assert processor.after_update(None, swap=True) == 1
            processor.releaser.wait()
            assert twin() is None and replaced() is None
            assert torch.equal(layer.weight, torch.full((6, 4), value, dtype=torch.bfloat16))
            assert torch.equal(layer.kernel.packed, layer.weight)
            assert layer.weight.weight_loader.__self__ is layer
    finally:
        gc.enable()


def test_a_commit_that_fails_midway_keeps_no_twin_for_a_later_round(monkeypatch):
    """Twins installed by swap hold the previous round's memory: a later `after_update` must not
    install them again."""
    from vllm.model_executor.model_loader.reload.layerwise import record_metadata_for_reloading

    from rl_sync.vllm import reload

    layer = _Loaded()
    model = torch.nn.ModuleDict({"layer": layer})
    record_metadata_for_reloading(model)
    buffers = {layer: {"weight": torch.zeros(6, 4, dtype=torch.bfloat16)}}
    processor = Processor(model, torch.bfloat16, None, buffers, {"w": [layer]}, [], [])
    assert processor.prepare(None, lambda buffer: torch.ones_like(buffer)) == 1

    def failing(*args):
        raise RuntimeError("install failed")

    monkeypatch.setattr(reload, "install", failing)
    with pytest.raises(RuntimeError, match="install failed"):
        processor.after_update(None, swap=True)
    assert processor.prepared == {}
