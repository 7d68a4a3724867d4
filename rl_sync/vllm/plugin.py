"""The `vllm.general_plugins` entry point: every vLLM process registers the `rl_sync` backend.

Declared in `pyproject.toml` (`[project.entry-points."vllm.general_plugins"]`);
vLLM calls `register()` once per process (driver, engine core, each worker),
so the backend resolves wherever `weight_transfer_config={"backend":
"rl_sync"}` is read. Where vLLM has a trainer-side factory (0.29+), the
trainer engine (`rl_sync.vllm.trainer`) is registered too; a trainer process
registers it by building an `RlSyncTrainerInitInfo`. Engine classes are
imported lazily, on first use.
"""

from __future__ import annotations

BACKEND = "rl_sync"


def register() -> None:
    from vllm.distributed.weight_transfer import factory

    from .compat import trainer_factory

    _register(factory.WeightTransferEngineFactory, "rl_sync.vllm.backend", "RlSyncTransferEngine")
    trainers = trainer_factory()
    if trainers is not None:
        _register(trainers, "rl_sync.vllm.trainer", "RlSyncTrainerEngine")


def _register(registry, module: str, name: str) -> None:
    try:
        registry.register_engine(BACKEND, module, name)
    except ValueError as exc:  # registered once per process; a second call is harmless
        if "already registered" not in str(exc):
            raise
