"""One local Ray instance per test session, on loopback only."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import ray

from rl_sync.config.sync import SyncConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_session():
    ray.init(
        _node_ip_address="127.0.0.1",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        configure_logging=False,
        runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}},
    )
    yield
    ray.shutdown()


def loopback_config(**overrides) -> SyncConfig:
    """A SyncConfig bound to 127.0.0.1 with short timeouts."""
    loopback = SyncConfig(
        rendezvous_host="127.0.0.1",
        bind_host="127.0.0.1",
        init_timeout_s=60.0,
        round_timeout_s=60.0,
        bucket_bytes=1 << 16,
        coalesce_bytes=1 << 12,
    )
    return replace(loopback, **overrides)
