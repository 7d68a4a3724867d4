"""Destinations read off vLLM's loader, checked parameter by parameter against vLLM's loader.

Two processes form a TP2 vLLM model group (no engine, no Ray). For each
model, each rank binds a checkpoint (`VllmBinding`), writes the trainers'
values into its destinations exactly as a round would (its box of each
tensor), runs the post-round processing, and must then hold, in every
parameter, buffer and derived tensor (MLA's `W_UV` / `W_UK_T`), exactly what
a fresh model loading the same checkpoint from disk through vLLM's loader
holds. Covers Llama, Qwen2 and Qwen3, tied embeddings, KV heads replicated past TP, transformers-5
fused MoE experts cut into parts, Mixtral, DeepSeek-V3 (MLA, shared experts,
per-expert checkpoint names), and Qwen3-MoE and DeepSeek-V3 under expert
parallelism. For Qwen3-MoE, the engine then replaces every parameter a
destination is cut from (`module.weight = Parameter(...)`) before the round:
the rank's watch must find each one through its `Slot` and cut the
destination again from the new parameter, without binding anew. Each rank also
checks that the binder's rules (`rl_sync.bind`, the layouts synthetic models
get) give every checkpoint name the boxes vLLM's
loader keeps; a vocabulary of 1030 (padded to 64 x 17) tells vLLM's padding
rule apart from one padding to 64 x TP."""

from __future__ import annotations

import json
import os

import pytest
import torch

from .vllm_group import SMALL, build, differing, join, random_model, run_ranks, snapshot, write_round

MODELS: dict[str, tuple[str, str, dict[str, object], str]] = {
    "qwen3-tied": (
        "Qwen3ForCausalLM",
        "qwen3",
        dict(intermediate_size=128, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
        "params",
    ),
    "qwen2-kv1": (
        "Qwen2ForCausalLM",
        "qwen2",
        dict(intermediate_size=128, num_key_value_heads=1, tie_word_embeddings=False),
        "params",
    ),
    "llama-kv2": (
        "LlamaForCausalLM",
        "llama",
        dict(intermediate_size=128, num_key_value_heads=2, vocab_size=1030, tie_word_embeddings=False),
        "params",
    ),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=False,
        ),
        "params",
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "mixtral",
        dict(
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            num_key_value_heads=2,
            tie_word_embeddings=False,
        ),
        "saved",
    ),
    "deepseek-v3": (
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        dict(
            intermediate_size=128,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            topk_method="noaux_tc",
            first_k_dense_replace=1,
            num_key_value_heads=4,
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=32,  # (vLLM's AMX MLA packs W_UK: 16 input features are refused)
            qk_rope_head_dim=16,
            v_head_dim=16,
            tie_word_embeddings=False,
        ),
        "saved",
    ),
}
EXPERT_PARALLEL = {"qwen3-moe-ep": "qwen3-moe", "deepseek-v3-ep": "deepseek-v3"}
"""The same checkpoints into an engine with `enable_expert_parallel`: whole experts per rank."""
RUNS = [*MODELS, *EXPERT_PARALLEL]
REPLACED = "qwen3-moe"
"""The model whose live parameters the engine replaces after binding."""


def _checkpoint(directory: str, name: str) -> dict[str, torch.Tensor]:
    """A random model of `name`'s family: config.json and model.safetensors in `directory`
    (bf16), and the tensors the trainers would send (their names and fp32 values)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    architecture, family, extra, names = MODELS[EXPERT_PARALLEL.get(name, name)]
    config = AutoConfig.for_model(family, **{**SMALL, **extra})
    model = random_model(config)
    os.makedirs(directory, exist_ok=True)
    if names == "saved":  # the names a checkpoint file holds (per-expert for DeepSeek)
        model.save_pretrained(directory)
        state = load_file(os.path.join(directory, "model.safetensors"))
    else:  # the names an FSDP2 trainer's named_parameters() gives (fused experts in transformers 5)
        state = {k: v.detach().clone() for k, v in model.named_parameters()}
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, os.path.join(directory, "model.safetensors")
    )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump({**config.to_dict(), "architectures": [architecture]}, f)
    return {k: v.float() for k, v in state.items()}


def _binder_disagrees(directory: str, checkpoint: dict, destinations: dict, ep: bool) -> list[str]:
    """Checkpoint names whose boxes on the two ranks differ between vLLM's resolution
    (`destinations`, parts put back at their offsets) and the binder's rules for the same config
    at TP2 (`ep`: expert parallel). The binder falls back only on transformers 5's stacked gate|up experts without
    expert parallelism, which vLLM cuts into parts: those must be parts."""
    from transformers import AutoConfig

    from rl_sync.bind.binder import Binder
    from rl_sync.models.config import ModelConfig, Parallel
    from rl_sync.planning.parts import parse_part

    seen: dict[str, dict[int, set]] = {}
    for name, dest in destinations.items():
        part = parse_part(name)
        for rank in range(2):
            box = dest.layout.local_box(dest.shape, rank)
            if dest.fallback or box is None or box.numel == 0:
                continue
            if part is not None:
                offsets = list(box.offsets)
                offsets[part[1]] += part[2]
                box = type(box)(tuple(offsets), box.sizes)
            seen.setdefault(name if part is None else part[0], {}).setdefault(rank, set()).add(box)
    binder = Binder(ModelConfig.from_hf(AutoConfig.from_pretrained(directory)), Parallel(tp=2, ep=ep))
    differ = []
    for name, (_, shape) in checkpoint.items():
        found = binder.match(name)
        layout = None if found is None else binder.layout(found[0], found[1], shape)
        if layout is None:
            if not (
                name.endswith(".mlp.experts.gate_up_proj")
                and any(parse_part(n) for n in destinations if n.startswith(name + "@"))
            ):
                differ.append(f"{name}: the binder falls back")
            continue
        ours = {r: {b} for r in range(2) if (b := layout.local_box(shape, r)) is not None and b.numel}
        if ours != seen.get(name, {}):
            differ.append(f"{name}: binder {ours}, vLLM {seen.get(name)}")
    return differ


def _replace_live_parameters(destinations: dict, rank: int) -> dict[str, torch.Tensor]:
    """The engine puts a new parameter (same shape, strides, dtype and attributes, zeros) in place
    of every one a destination is cut from; the worker's kept destinations follow each. Returns
    what a round now writes for each rebound name."""
    from rl_sync.rank.kept import KeptDestinations

    kept = KeptDestinations(destinations, rank, double_buffer=False)
    slots = {(id(d.slot.holder), d.slot.key): d.slot for d in destinations.values() if d.slot is not None}
    for holder, key in slots.values():
        old = holder[key]
        new = torch.nn.Parameter(torch.empty_strided(old.shape, old.stride(), dtype=old.dtype), requires_grad=False)
        new.data.zero_()
        new.__dict__.update(old.__dict__)
        holder[key] = new
    rebound = kept.follow()
    assert slots and set(rebound) == {n for n, d in destinations.items() if d.slot is not None}, "every one is found"
    return {name: kept.entries.endpoints[name].tensor for name in rebound}


def _bind_and_write(
    directory: str, state: dict[str, torch.Tensor], rank: int, ep: bool, replace_live: bool
) -> tuple[dict, list[str], list[str]]:
    from vllm.config import set_current_vllm_config

    from rl_sync.vllm.binding import VllmBinding
    from rl_sync.vllm.rank import engine_rank

    config, model = build(directory, "dummy", ep)
    checkpoint = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    with set_current_vllm_config(config):
        binding = VllmBinding.build(model, config.model_config, checkpoint, engine_rank(), sharded={})
        disagree = _binder_disagrees(directory, checkpoint, binding.destinations, ep)
        moved = _replace_live_parameters(binding.destinations, rank) if replace_live else {}
        write_round(binding, state, rank, moved)
    return snapshot(model), list(binding.fallbacks), disagree


def _rank(rank: int, port: int, queue, root: str) -> None:
    root = os.path.join(root, f"rank{rank}")  # each rank writes its own copy of the checkpoints
    states = {name: _checkpoint(os.path.join(root, name), name) for name in RUNS}
    join(rank, port, os.path.join(root, "qwen3-moe"))
    for name, state in states.items():
        ep = name in EXPERT_PARALLEL
        got, fallbacks, disagree = _bind_and_write(os.path.join(root, name), state, rank, ep, name == REPLACED)
        want = snapshot(build(os.path.join(root, name), "auto", ep)[1])
        queue.put((rank, name, differing(got, want), fallbacks, len(want), disagree))


@pytest.mark.slow  # 80 s; test_arch_sweep.py checks its subset parameter by parameter against vLLM's load
def test_every_parameter_equals_what_vllms_loader_loads(tmp_path):
    results = run_ranks(_rank, (str(tmp_path),), expected=2 * len(RUNS), timeout_s=420)
    for rank, name, differ, fallbacks, checked, disagree in results:
        assert fallbacks == [], f"rank {rank}, {name}: fell back {fallbacks}"
        assert checked > 0 and differ == [], f"rank {rank}, {name}: {len(differ)} of {checked} differ: {differ[:6]}"
        assert disagree == [], f"rank {rank}, {name}: the binder's rules and vLLM disagree on {disagree[:4]}"
