"""Where users run it: the RL loops learn (our engine in this process's Ray session, vLLM as a
Ray job), the notebook executes headless."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from rl_sync.config.load import load_config

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

import rl_loop  # noqa: E402


@pytest.mark.slow
def test_the_rl_loop_learns_and_logs_the_weight_version(ray_session):
    cfg = load_config(ROOT / "configs" / "rl_loop.yaml", rl_loop.LoopConfig, ["iterations=30"])
    lines = []
    history = rl_loop.train(cfg, log=lines.append)
    first = sum(r["reward"] for r in history[:6]) / 6
    last = sum(r["reward"] for r in history[-6:]) / 6
    assert last > first + 0.2, f"mean reward went from {first:.3f} to {last:.3f}"
    assert all(r["rollout_version"] == r["iteration"] and r["learner_version"] == r["iteration"] + 1 for r in history)
    assert len(lines) == 30 and '"rollout_version": 1' in lines[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s:.0f} s")


@pytest.fixture
def ray_head(tmp_path):
    """A second Ray cluster (`ray start --head --block`) in its own process group, so that
    stopping it (the whole group, bounded in time) leaves the session's Ray alone; `ray stop`
    would stop every Ray on the machine."""
    ray = str(Path(sys.executable).parent / "ray")
    gcs, dashboard = _free_port(), _free_port()
    env = dict(os.environ, RAY_ADDRESS="", RAY_AUTH_MODE="token")
    head = subprocess.Popen(
        [
            ray,
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={gcs}",
            "--num-cpus=4",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard}",
            # own ports for every agent, so the head never collides with the session's local Ray
            f"--dashboard-agent-listen-port={_free_port()}",
            f"--dashboard-agent-grpc-port={_free_port()}",
            f"--metrics-export-port={_free_port()}",
            f"--runtime-env-agent-port={_free_port()}",
            f"--ray-client-server-port={_free_port()}",
            "--disable-usage-stats",
        ],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_for_port(dashboard, 120)
        yield ray, f"http://127.0.0.1:{dashboard}"
    finally:
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
            try:
                os.killpg(head.pid, sig)
                head.wait(grace)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"  # else ray.init() joins the dead head
        if current.exists() and current.read_text().strip() == f"127.0.0.1:{gcs}":
            current.unlink()


@pytest.mark.slow
def test_the_vllm_rl_loop_learns_when_submitted_as_a_ray_job(ray_head):
    """`ray job submit` of the vLLM GRPO loop (rollouts from a vLLM engine at TP2, a push every
    step): the job succeeds and its reward rises over 12 iterations."""
    ray, address = ray_head
    command = [
        ray,
        "job",
        "submit",
        "--address",
        address,
        "--working-dir",
        str(ROOT),
        "--",
        sys.executable,
        "examples/rl_loop_vllm.py",
        "--config",
        "configs/rl_loop_vllm.yaml",
        "iterations=12",
        "env.GLOO_SOCKET_IFNAME=lo",
    ]
    env = dict(os.environ, RAY_ADDRESS="", RAY_AUTH_MODE="token")
    for _ in range(20):  # the head's job agent comes up a few seconds after `ray start` returns
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if "No available agent to submit job" not in done.stderr:
            break
        time.sleep(2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"iteration"')]
    assert [r["iteration"] for r in history] == list(range(1, 13)), done.stdout[-3000:]
    first = sum(r["reward"] for r in history[:4]) / 4
    last = sum(r["reward"] for r in history[-4:]) / 4
    assert last > first + 0.2, f"mean reward went from {first:.3f} to {last:.3f}"
    assert all(r["rollout_version"] == r["iteration"] and r["learner_version"] == r["iteration"] + 1 for r in history)
    assert "mean reward: first" in done.stdout


@pytest.mark.slow
def test_the_notebook_executes_headless(tmp_path):
    notebook = nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), "the plot cell drew no figure"
