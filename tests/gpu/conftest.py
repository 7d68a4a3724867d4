"""GPU tests: marked `gpu`, skipped without CUDA; one Ray instance per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture(scope="session")
def gpu_ray():
    import ray

    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {
                "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                "NCCL_SOCKET_IFNAME": "lo",
            }
        },
    )  # NCCL's sockets on loopback too
    yield ray
    ray.shutdown()


@pytest.fixture(params=["cuda", "triton"])
def sparse_kernels(request, monkeypatch) -> str:
    """Each test once with `diff` and the busy launches on the CUDA kernels (`engine.sparse_cuda`,
    which needs CuPy) and once on Triton's, chosen through `RL_SYNC_SPARSE_KERNELS`."""
    monkeypatch.setenv("RL_SYNC_SPARSE_KERNELS", request.param)
    if request.param == "cuda":
        pytest.importorskip("cupy")
        from rl_sync.engine import sparse_cuda

        assert sparse_cuda.usable(torch.device("cuda")), "the CUDA kernels did not compile (see the warning)"
    return request.param
