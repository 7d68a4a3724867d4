"""A Hugging Face checkpoint directory from a config and a state dict: what vLLM starts from.

vLLM loads models from disk (`LLM(model=directory)`); an RL run that trains a
model from a config (or changed its shapes) writes its first weights once,
starts the engines on them, and from then on rl-sync moves the updates.

Typical use::

    write_checkpoint("/tmp/policy", hf_config_dict, trainer_full_state, dtype=torch.bfloat16)
    path = scratch_checkpoint("rl-sync-policy-", hf_config_dict, trainer_full_state)  # removed at exit
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Mapping

import torch


def write_checkpoint(
    directory: str, config: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = torch.bfloat16
) -> str:
    """`config.json` and every tensor of `state` cast to `dtype` (round to nearest even, as
    rl-sync casts on the wire; None keeps each tensor's own, e.g. FP8 weights beside their
    scales) in one safetensors file; returns `directory`."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(config), f)
    tensors = {k: (v if dtype is None else v.to(dtype)).detach().contiguous() for k, v in state.items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def scratch_checkpoint(
    prefix: str, config: Mapping, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = torch.bfloat16
) -> str:
    """`write_checkpoint` into a fresh temporary directory named `prefix...`, removed when this
    process exits normally (`atexit`: not when it is killed): the first weights a run or benchmark
    starts its engines on (engines load them at start, so the directory only has to outlive this
    process's engines, not the run's record)."""
    directory = tempfile.mkdtemp(prefix=prefix)
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return write_checkpoint(directory, config, state, dtype)
