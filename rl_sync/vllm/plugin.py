"""The `vllm.general_plugins` entry point: every vLLM process registers the `rl_sync` backend.

Declared in `pyproject.toml` (`[project.entry-points."vllm.general_plugins"]`);
vLLM calls `register()` once per process (driver, engine core, each worker),
so the backend resolves wherever `weight_transfer_config={"backend":
"rl_sync"}` is read. The engine class is imported lazily, on first use.
"""

from __future__ import annotations

BACKEND = "rl_sync"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, "rl_sync.vllm.backend", "RlSyncTransferEngine")
    except ValueError as exc:  # registered once per process; a second call is harmless
        if "already registered" not in str(exc):
            raise
