"""vLLM's CUDA build on one GPU, for the GPU tests: tiny checkpoints (bf16 and block-FP8), a
colocated FSDP2 trainer and engine, fresh engines to compare with, and engine parameters.

Everything shares the GPU through fractional Ray GPUs (trainer and engine colocated, so rounds go
through CUDA IPC). The oracle is the CPU tests' (`tests/distributed/vllm_oracle.py`): a fresh
engine started on the trainers' checkpoint with the same settings, here started in parallel for
every step of a test, compared on greedy tokens, their log-probabilities, and every live parameter
bit for bit."""

from __future__ import annotations

import ray
import torch

from actors.cluster import free_init_url
from actors.models import HFTrainer
from actors.service import VllmService
from actors.vllm import VllmEngine, VllmRankActor
from tests.distributed.vllm_oracle import PROMPTS, SAMPLING, hf_config

ENV = {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # (the carried CUDA build leaves flashinfer out)
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # `apply_model` sends a function to the engine's workers
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
}
SHAPES = dict(
    vocab_size=1024,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
"""head_dim 64 (FlashAttention 3's smallest), every projection a multiple of 128 (FP8 blocks)."""
MOE = dict(moe_intermediate_size=128, head_dim=64)
LLM_KWARGS = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    enforce_eager=True,
    gpu_memory_utilization=0.04,
    kv_cache_memory_bytes=128 << 20,
    max_model_len=256,
    max_num_seqs=8,
    seed=0,
    block_size=32,
    enable_prefix_caching=True,
)
"""A small engine (several share the GPU), prefix caching on with blocks the long prompt fills."""
CUDA_GRAPHS = dict(
    enforce_eager=False,
    compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 4]},
)
"""CUDA graphs (which capture the parameters' addresses) for every decode step, without
torch.compile: full graphs need no compilation."""
BLOCK = (128, 128)
BLOCK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
"""A block-FP8 checkpoint's `quantization_config` (DeepSeek-V3's format)."""
GPU_SHARE = 0.1


def config(family: str) -> dict:
    return hf_config(family, **SHAPES, **(MOE if family == "qwen3_moe" else {}))


def trainer(family: str, dtype: str, device: str = "cuda"):
    """One FSDP2 trainer (world size 1) on a share of the GPU."""
    Trainer = ray.remote(HFTrainer).options(num_gpus=GPU_SHARE, num_cpus=0.5)
    actor = Trainer.remote(0, 1, config(family), free_init_url("127.0.0.1"), dtype=dtype, device=device)
    ray.get(actor.call.remote(lambda self: None), timeout=300)
    return actor


def quantized_linear(name: str) -> bool:
    """Whether vLLM's FP8 method keeps checkpoint tensor `name` block-quantized (every linear
    layer's weight; embeddings, norms and the vocabulary head stay bf16)."""
    return name.endswith("_proj.weight") and ".layers." in name


def write_block_fp8(directory: str, hf: dict, state: dict[str, torch.Tensor]) -> str:
    """A block-FP8 checkpoint of `state` (bf16 values), quantized by vLLM's own
    `per_block_cast_to_fp8` on the CPU: each linear weight as float8_e4m3fn plus its
    `weight_scale_inv`, everything else bf16."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from rl_sync.vllm.checkpoint import write_checkpoint

    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        value = value.to(torch.bfloat16)
        if quantized_linear(name):
            out[name], out[name + "_scale_inv"] = per_block_cast_to_fp8(value, list(BLOCK))
        else:
            out[name] = value
    return write_checkpoint(directory, {**hf, "quantization_config": BLOCK_FP8}, out, dtype=None)


def engine_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every live parameter's bytes, on the CPU (runs in the engine's worker: `apply_model`)."""
    return {n: p.detach().cpu().contiguous().reshape(-1).view(torch.uint8) for n, p in model.named_parameters()}


def _params_of_llm(actor) -> dict[str, torch.Tensor]:
    return actor.llm.apply_model(engine_params)[0]


def launch(path: str, llm_kwargs: dict) -> VllmEngine:
    """The engine's one rank as a Ray actor (vLLM's external launcher), on a share of the GPU."""
    options = [{"num_gpus": GPU_SHARE, "num_cpus": 0.5}]
    return VllmEngine.launch(path, tp=1, llm_kwargs=llm_kwargs, env=ENV, actor_options=options)


def launch_service(path: str, llm_kwargs: dict) -> VllmService:
    """The engine as a service (vLLM's own worker process), on a share of the GPU."""
    options = {"num_gpus": GPU_SHARE, "num_cpus": 0.5}
    return VllmService.launch(path, tp=1, llm_kwargs=llm_kwargs, env=ENV, actor_options=options)


def outputs_and_params(engine) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """What an engine (rank actors or a service) generates, and its live parameters."""
    if isinstance(engine, VllmService):
        return engine.generate(PROMPTS, **SAMPLING), ray.get(engine.host.call.remote(_params_of_llm), timeout=120)
    return engine.generate(PROMPTS, **SAMPLING), ray.get(engine.ranks[0].call.remote(_params_of_llm), timeout=120)


def fresh(paths: list[str], llm_kwargs: dict, timeout_s: float = 600.0) -> list[tuple[list[dict], dict]]:
    """For each checkpoint, a fresh engine's outputs and parameters: the engines start in
    parallel, each in a new process, and are released afterwards."""
    Rank = ray.remote(VllmRankActor)
    ranks: list = [Rank.options(num_gpus=GPU_SHARE, num_cpus=0.5).remote(0, 1, None, ENV) for _ in paths]
    try:
        addresses = ray.get([r.rendezvous.remote() for r in ranks], timeout=timeout_s)
        starts = [r.start.remote(p, a, llm_kwargs) for r, p, a in zip(ranks, paths, addresses)]
        ray.get(starts, timeout=timeout_s)
        return [outputs_and_params(VllmEngine([r])) for r in ranks]
    finally:
        for r in ranks:
            ray.kill(r)


def differing(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Parameter names whose bytes differ (or that only one side has)."""
    names = sorted(set(got) | set(want))
    return [n for n in names if n not in got or n not in want or not torch.equal(got[n], want[n])]
