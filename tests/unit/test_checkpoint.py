"""`write_checkpoint` (what vLLM starts from) and `scratch_checkpoint` (a copy gone when its process exits)."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from rl_sync.vllm.checkpoint import scratch_checkpoint, write_checkpoint

CONFIG = {"model_type": "llama", "hidden_size": 4}


def test_write_checkpoint_casts_to_bf16_and_keeps_the_config(tmp_path):
    state = {"w": torch.tensor([1.0, 1.00390625, 2.0**-140]), "b": torch.arange(3, dtype=torch.int64)}
    path = write_checkpoint(str(tmp_path / "policy"), CONFIG, state)
    loaded = load_file(os.path.join(path, "model.safetensors"))
    assert loaded["w"].dtype == torch.bfloat16 and torch.equal(loaded["w"], state["w"].to(torch.bfloat16))
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f) == CONFIG


def test_write_checkpoint_keeps_each_dtype_when_asked(tmp_path):
    state = {"w": torch.ones(2, dtype=torch.float32), "s": torch.ones(1, dtype=torch.float64)}
    loaded = load_file(os.path.join(write_checkpoint(str(tmp_path), CONFIG, state, dtype=None), "model.safetensors"))
    assert {k: v.dtype for k, v in loaded.items()} == {"w": torch.float32, "s": torch.float64}


def test_scratch_checkpoint_is_removed_when_its_process_exits():
    script = (
        "import os, torch\n"
        "from rl_sync.vllm.checkpoint import scratch_checkpoint\n"
        "p = scratch_checkpoint('rl-sync-test-', {'a': 1}, {'w': torch.ones(2)})\n"
        "assert os.path.isfile(os.path.join(p, 'model.safetensors'))\n"
        "print(p)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    path = done.stdout.strip().splitlines()[-1]
    assert os.path.basename(path).startswith("rl-sync-test-")
    assert not os.path.exists(path)


def test_scratch_checkpoint_lives_while_its_process_runs():
    path = scratch_checkpoint("rl-sync-test-", CONFIG, {"w": torch.ones(2)})
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
