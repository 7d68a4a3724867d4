"""vLLM models of a TP2 group without an engine, for binding tests that need no generation.

Two spawned processes form vLLM's tensor-parallel group over Gloo (`join`); each
builds models the way vLLM's worker does (`build`: random weights with the `dummy`
load format, or a checkpoint from disk with `auto`), binds a checkpoint
(`rl_sync.vllm.binding.VllmBinding`), writes what a round would write into its
destinations (`write_round`), and compares every parameter, buffer and derived
tensor with a fresh model loading the checkpoint through vLLM's own loader
(`snapshot`). `run_ranks` starts the two processes and collects what they report.

Typical use (in a test)::

    results = run_ranks(_rank, (root,), expected=2 * len(models), timeout_s=420)
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable

import torch
import torch.multiprocessing as mp

SMALL = dict(
    vocab_size=1000,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    torch_dtype="bfloat16",
)
"""What every tiny model here shares: a vocabulary vLLM pads (to 1024), two layers of width 64."""
KV_CACHE_SCALES = ("_k_scale", "_v_scale", "_q_scale", "_prob_scale")
"""Attention buffers no checkpoint tensor feeds and only an fp8 KV cache reads: vLLM's dummy
loader randomizes them and its MLA processing resets them to 1.0, except on a CPU with AMX,
where it returns before that; left out of the comparison."""


def random_model(config):
    """A transformers causal LM of `config` in fp32, seeded, every parameter moved off the value it
    was initialized to (so a norm bound to the wrong slot would show)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_config(directory: str, load_format: str, ep: bool = False):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=directory,
        skip_tokenizer_init=True,
        tensor_parallel_size=2,
        enforce_eager=True,
        load_format=load_format,
        dtype="bfloat16",
        max_model_len=256,
        distributed_executor_backend="mp",
        enable_expert_parallel=ep,
    ).create_engine_config()


def build(directory: str, load_format: str, ep: bool = False):
    """A model of the TP2 group this process is a rank of: random (`dummy`) or from disk (`auto`)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model

    config = engine_config(directory, load_format, ep)
    with set_current_vllm_config(config):
        return config, get_model(vllm_config=config)


def join(rank: int, port: int, moe_directory: str) -> None:
    """Make this process rank `rank` of a TP2 vLLM group (under the config of the model in
    `moe_directory`, a MoE, so vLLM also forms the expert group MoE models need)."""
    # VLLM_DIST_IDENT names the CPU shared-memory group; vLLM's CPU worker sets it from the init port
    os.environ.update(OMP_NUM_THREADS="1", VLLM_LOGGING_LEVEL="WARNING", VLLM_DIST_IDENT=str(port))
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop

    _set_torch_accelerator_to_noop()  # what vLLM's CPU model runner does before it loads a model
    with set_current_vllm_config(engine_config(moe_directory, "dummy")):
        init_distributed_environment(
            world_size=2, rank=rank, local_rank=rank, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
        )
        initialize_model_parallel(2, 1)


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, and the state MLA derives from `kv_b_proj`: `W_UV` and
    `W_UK_T`, or, on a CPU with AMX, its packed copies on the attention's implementation."""
    out = {f"param {n}": p.detach().clone() for n, p in model.named_parameters()}
    out |= {f"buffer {n}": b.clone() for n, b in model.named_buffers() if not n.endswith(KV_CACHE_SCALES)}
    for n, m in model.named_modules():
        for owner, names in ((m, ("W_UV", "W_UK_T")), (getattr(m, "impl", None), ("_w_uk_packed", "_w_uv_packed"))):
            out |= {f"derived {n}.{a}": getattr(owner, a).clone() for a in names if _is_tensor(getattr(owner, a, None))}
    return out


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names in `want` that `got` lacks or holds other values for, sorted."""
    return sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))


def write_round(binding, state: dict[str, torch.Tensor], rank: int, moved: dict | None = None) -> None:
    """Write into `binding`'s destinations on TP rank `rank` what a dense round would (its box of
    each tensor or part; into `moved[name]` for a name bound anew), hand the fallbacks to vLLM's
    loader, and run the post-round processing."""
    from rl_sync.planning.parts import parse_part

    for name, dest in binding.destinations.items():
        if dest.fallback or dest.local is None:
            continue
        part = parse_part(name)
        whole = state[name] if part is None else state[part[0]].narrow(part[1], part[2], part[3] - part[2])
        box = dest.layout.local_box(dest.shape, rank)
        assert box is not None, f"{name}: rank {rank} holds a tensor but no box"
        (moved or {}).get(name, dest.local).copy_(whole[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))])
    if binding.fallbacks:
        binding.processor.load_fallbacks([(n, state[n].to(torch.bfloat16)) for n in binding.fallbacks])
    binding.processor.after_update(None)


def run_ranks(target: Callable, args: tuple, expected: int, timeout_s: float) -> list[tuple]:
    """Run `target(rank, port, queue, *args)` in two spawned processes and collect `expected`
    reports from `queue` (each a tuple whose second item is not `"error"`); a rank that raises
    reports `(rank, "error", traceback)`, which fails at once (AssertionError with it)."""
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_guarded, args=(target, r, port, queue, args)) for r in range(2)]
    for proc in procs:
        proc.start()
    results: list[tuple] = []
    try:
        while len(results) < expected and not any(r[1] == "error" for r in results):
            results.append(queue.get(timeout=timeout_s))
    finally:
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
    errors = [r[2] for r in results if r[1] == "error"]
    assert not errors, errors[0]
    return results


def _guarded(target: Callable, rank: int, port: int, queue, args: tuple) -> None:
    try:
        target(rank, port, queue, *args)
    except Exception:
        queue.put((rank, "error", traceback.format_exc()[-3000:]))
