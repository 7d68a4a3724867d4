"""Every decoder architecture vLLM registers, bound from FSDP2 trainers' names into TP2.

The candidates are vLLM's text-generation architectures (native, and those it
serves through its transformers backend) whose transformers model type builds
a causal LM (`candidates`). Each gets a tiny random model (`tiny_config`: a
few layers of width 64, a vocabulary of 1000 padded by vLLM to 1024, 4 experts
where it has experts) built offline; on a TP2 group (`vllm_group`, no engine),
each rank binds the names an FSDP2 trainer's `named_parameters()` gives (or,
where vLLM's loader refuses those, the names `save_pretrained` writes: the
checkpoint names a trainer's state-dict adapter sends), writes a round into
its destinations, and compares every parameter with a fresh model loading the
checkpoint through vLLM's own loader (`sweep`). An architecture is *supported*
when it binds with no fallback and every parameter matches on both ranks.

Run it (92 candidates took 19 minutes on the shared 2-core machine, 3 to 12 s
an architecture once its checkpoint is written) and regenerate the support
table in `docs/architectures.md` from what it recorded::

    python -m tests.distributed.arch_sweep --run docs/architectures.json
    python -m tests.distributed.arch_sweep --table docs/architectures.json docs/architectures.md

`tests/distributed/test_arch_sweep.py` runs a representative subset in the
default run and every architecture recorded as supported under `slow`;
`test_vllm.py` pushes from FSDP2 trainers into a real TP2 engine of each
(`generating_config`) and compares generations, under `slow`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field

import torch

from .arch_table import write_table
from .vllm_group import SMALL, build, differing, join, random_model, run_ranks, snapshot, write_round

TINY = dict(SMALL, intermediate_size=128, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
"""Every architecture's config gets these (token ids inside the vocabulary)."""
IF_TAKEN = dict(
    head_dim=16,
    num_experts=4,
    n_routed_experts=4,
    num_local_experts=4,
    moe_num_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=32,
    intermediate_size_mlp=128,
)
"""And these where their config class takes them (the defaults are a full-size model's)."""
GENERATING = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    max_position_embeddings=128,
    head_dim=32,
    moe_intermediate_size=64,
)
"""A model an engine of the CPU build generates with: head size 32 (its attention kernels take no
smaller), positions up to the engines' `max_model_len`."""
OVERRIDES: dict[str, dict[str, object]] = {
    "GPTJForCausalLM": dict(rotary_dim=8),  # its default (64) is past the tiny head size
    "Glm4MoeLiteForCausalLM": dict(first_k_dense_replace=1),  # vLLM reads it; transformers' config lacks it
}
MAX_PARAMETERS = 30_000_000
"""A tiny config past this (a default no override reaches) is not built: the machine is shared."""
REFUSED = ("refused by vLLM's loader", "There is no module or parameter named")
"""vLLM's loader refusing a name (rl-sync's probe, or vLLM loading the engine's first checkpoint)."""
START = "start"
"""The folder of a checkpoint of other values the engine starts from, as a running engine would."""
MOE = "Qwen3MoeForCausalLM"
"""The group is formed under this architecture's config, so vLLM also forms its expert group."""
SUBSET = (
    "BloomForCausalLM",
    "Gemma2ForCausalLM",
    "Olmo2ForCausalLM",
    "VaultGemmaForCausalLM",
    "Qwen2MoeForCausalLM",
    "DeepseekV2ForCausalLM",
)
"""The default run's architectures: heads regrouped through a copy (Bloom), tied (Gemma-2), vLLM's
transformers backend (OLMo-2; VaultGemma, whose embedding keeps a buffer no checkpoint tensor
feeds), shared experts (Qwen2-MoE), MLA with per-expert checkpoint names (DeepSeek-V2). Fused
along FSDP's dim (Phi-3) and transposed (GPT-2) are `tests/distributed/test_vllm.py`'s, which
generates with them; the rest of the sweep is `pytest -m slow`'s."""


def candidates() -> dict[str, str]:
    """`{vLLM architecture: transformers model type}` of every text-generation architecture vLLM
    registers whose model type transformers builds as a causal LM."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS, _TRANSFORMERS_SUPPORTED_MODELS

    model_types: dict[str, str] = {}
    for model_type, names in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        for name in (names,) if isinstance(names, str) else names:
            if name not in model_types or _named_after(model_type, name):  # gpt2, not gpt-sw3
                model_types[name] = model_type
    native = [a for a in _TEXT_GENERATION_MODELS if a.endswith(("ForCausalLM", "LMHeadModel"))]
    backend = [a for a in _TRANSFORMERS_SUPPORTED_MODELS if a.endswith("ForCausalLM")]
    return {a: model_types[a] for a in sorted(set(native + backend)) if a in model_types}


def _named_after(model_type: str, architecture: str) -> bool:
    return architecture.lower().startswith(model_type.replace("_", "").replace("-", ""))


def tiny_config(architecture: str, model_type: str, generating: bool = False):
    """A transformers config of a tiny model of `architecture`; `generating`: wide enough for the
    CPU build's attention kernels (`GENERATING`)."""
    from transformers import CONFIG_MAPPING, AutoConfig

    config_class = CONFIG_MAPPING[model_type]
    taken = set(inspect.signature(config_class.__init__).parameters) | set(getattr(config_class, "attribute_map", {}))
    wanted = {**TINY, **IF_TAKEN, **(GENERATING if generating else {})}
    values = {k: v for k, v in wanted.items() if k in TINY or k in taken}
    return AutoConfig.for_model(model_type, **values, **OVERRIDES.get(architecture, {}))


def generating_config(architecture: str) -> dict:
    """`tiny_config(..., generating=True)` of `architecture` as the dict trainers and checkpoints take."""
    config = tiny_config(architecture, candidates()[architecture], generating=True).to_dict()
    return {**config, "architectures": [architecture], "torch_dtype": "bfloat16"}


@dataclass
class Outcome:
    """What binding one architecture gave on one rank."""

    architecture: str
    model_type: str
    status: str = "excluded"
    """`supported`, `fallbacks` (bound, some names whole), `differs` (a parameter differs from
    vLLM's own load) or `excluded` (no tiny model of it builds or loads here: see `error`)."""
    stage: str = "config"
    """Where an excluded architecture stopped: config, model (transformers), engine model (vLLM
    building or binding it), fresh load (vLLM loading the checkpoint from disk)."""
    error: str = ""
    names: str = "parameters"
    """`parameters` (FSDP2's `named_parameters()`) or `checkpoint` (`save_pretrained`'s names)."""
    tensors: int = 0
    parts: int = 0
    """Destinations that are parts of a fused checkpoint tensor."""
    transposed: int = 0
    """Destinations that are transposed views of a live parameter (or of its loader form)."""
    fallbacks: dict[str, list[str]] = field(default_factory=dict)
    differ: list[str] = field(default_factory=list)
    seconds: float = 0.0


def _write_checkpoint(architecture: str, model_type: str, directory: str, outcome: Outcome) -> None:
    """config.json and model.safetensors (bf16, the names an FSDP2 trainer's `named_parameters()`
    gives) of a random tiny model in `directory`, and what `save_pretrained` writes in its `saved`
    folder. Runs before the process joins its group (transformers saves on rank 0 only)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(architecture, model_type)
    outcome.stage = "model"
    with torch.device("meta"):
        count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if count > MAX_PARAMETERS:
        raise ValueError(f"its tiny config still holds {count} parameters (a default no override reaches)")
    model = random_model(config)
    os.makedirs(directory, exist_ok=True)
    model.save_pretrained(os.path.join(directory, "saved"))
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.named_parameters()}
    for where in (directory, os.path.join(directory, START)):
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "config.json"), "w") as f:
            json.dump({**config.to_dict(), "architectures": [architecture]}, f)
    _write_states(directory, state)


def _write_states(directory: str, state: dict[str, torch.Tensor]) -> None:
    """`state` as `directory`'s checkpoint, and other values of the same shapes as the one the
    engine starts from (in its `START` folder)."""
    from safetensors.torch import save_file

    save_file(state, os.path.join(directory, "model.safetensors"))
    generator = torch.Generator().manual_seed(7)
    start = {k: torch.randn(v.shape, generator=generator).to(v.dtype) for k, v in state.items()}
    save_file(start, os.path.join(directory, START, "model.safetensors"))


def _state(directory: str) -> dict[str, torch.Tensor]:
    """The tensors of every safetensors file in `directory`."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out |= load_file(os.path.join(directory, name))
    return out


def _checkpoint_names(directory: str) -> dict[str, torch.Tensor]:
    """Switch `directory`'s checkpoints to the names `save_pretrained` wrote; returns its tensors."""
    state = _state(os.path.join(directory, "saved"))
    _write_states(directory, state)
    return state


def _bind(directory: str, state: dict, rank: int):
    from vllm.config import set_current_vllm_config

    from rl_sync.vllm.binding import VllmBinding
    from rl_sync.vllm.rank import engine_rank

    config, model = build(os.path.join(directory, START), "auto")
    checkpoint = {n: (t.dtype, tuple(t.shape)) for n, t in state.items()}
    with set_current_vllm_config(config):
        binding = VllmBinding.build(model, config.model_config, checkpoint, engine_rank())
        write_round(binding, state, rank)
    return binding, snapshot(model)


def _transposed(view: torch.Tensor) -> bool:
    """Whether `view`'s dims (of more than one element) are not in the order of its strides."""
    strides = [t for n, t in zip(view.shape, view.stride()) if n > 1]
    return strides != sorted(strides, reverse=True)


def _describe(outcome: Outcome, binding) -> None:
    from rl_sync.planning.parts import parse_part

    kept = [d.local for d in binding.destinations.values() if d.local is not None and not d.fallback]
    outcome.parts = sum(parse_part(n) is not None for n in binding.destinations)
    outcome.transposed = sum(_transposed(v) for v in kept)
    for report in binding.reports:
        if report.mode == "fallback":
            outcome.fallbacks.setdefault(report.reason, []).append(report.name)


def prepare(architectures: dict[str, str], root: str) -> dict[str, Outcome]:
    """Write a checkpoint of every architecture under `root`; outcomes so far (an architecture
    whose tiny model does not build is excluded here)."""
    outcomes = {}
    for architecture, model_type in architectures.items():
        outcome = outcomes[architecture] = Outcome(architecture, model_type)
        try:
            _write_checkpoint(architecture, model_type, os.path.join(root, architecture), outcome)
            outcome.stage = "engine model"
        except Exception as exc:  # an architecture that does not build here is recorded, not fatal
            outcome.error = _message(exc)
    return outcomes


def _message(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:300]


def sweep_one(outcome: Outcome, root: str, rank: int) -> Outcome:
    """Bind one architecture whose checkpoint `prepare` wrote, on this rank of a TP2 group (see
    the module docstring)."""
    start, directory = time.perf_counter(), os.path.join(root, outcome.architecture)
    try:
        state = _state(directory)
        try:
            binding, got = _bind(directory, state, rank)
        except (KeyError, ValueError) as exc:
            if not isinstance(exc, KeyError) and not any(m in str(exc) for m in REFUSED):
                raise
            outcome.names, state = "checkpoint", _checkpoint_names(directory)
            binding, got = _bind(directory, state, rank)
        outcome.stage, outcome.tensors = "fresh load", len(state)
        _describe(outcome, binding)
        outcome.differ = differing(got, snapshot(build(directory, "auto")[1]))
        outcome.status = "differs" if outcome.differ else "fallbacks" if outcome.fallbacks else "supported"
    except Exception as exc:  # an architecture that does not load here is recorded, not fatal
        outcome.error = _message(exc)
    outcome.seconds = round(time.perf_counter() - start, 1)
    return outcome


def _rank(rank: int, port: int, queue, root: str, architectures: dict[str, str]) -> None:
    from rl_sync.vllm.rank import engine_rank

    root = os.path.join(root, f"rank{rank}")  # each rank writes its own copy of the checkpoints
    outcomes = prepare({**architectures, MOE: "qwen3_moe"}, root)
    join(rank, port, os.path.join(root, MOE))
    for architecture in architectures:
        seen = engine_rank().exchange(architecture)
        assert seen == [architecture] * 2, f"the ranks bind different architectures: {seen}"
        outcome = outcomes[architecture]
        if not outcome.error:
            sweep_one(outcome, root, rank)
        queue.put((rank, architecture, asdict(outcome)))


def sweep(architectures: dict[str, str], root: str, timeout_s: float = 600) -> dict[str, dict]:
    """`{architecture: outcome}` of binding each on a TP2 group; an architecture's outcome is the
    worse of its two ranks' (an excluded or differing rank decides)."""
    results = run_ranks(_rank, (root, architectures), expected=2 * len(architectures), timeout_s=timeout_s)
    order = ("differs", "excluded", "fallbacks", "supported")
    out: dict[str, dict] = {}
    for _, architecture, outcome in results:
        seen = out.get(architecture)
        if seen is None or order.index(outcome["status"]) < order.index(seen["status"]):
            out[architecture] = outcome
    return out


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.distributed.arch_sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--run", metavar="RESULTS", help="sweep every candidate, writing the outcomes here (JSON)")
    parser.add_argument("--only", nargs="*", default=None, help="architectures to sweep (default: every candidate)")
    parser.add_argument("--table", nargs=2, metavar=("RESULTS", "PAGE"), help="regenerate the table in PAGE")
    args = parser.parse_args(argv)
    if args.run:
        import tempfile

        found = candidates()
        chosen = {a: found[a] for a in (args.only or found)}
        with tempfile.TemporaryDirectory() as root:
            results = sweep(chosen, root)
        with open(args.run, "w") as f:
            json.dump(dict(sorted(results.items())), f, indent=1)
    if args.table:
        write_table(*args.table)


if __name__ == "__main__":
    main(sys.argv[1:])
