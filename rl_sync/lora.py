"""PEFT LoRA adapter tensors by the names PEFT saves them under: what a LoRA group carries.

PEFT names a parameter of adapter `default` `...q_proj.lora_A.default.weight` in the model
and saves it as `base_model.model.<module>.lora_A.weight` (`save_pretrained`); rl-sync's
checkpoint names are the saved ones, so a vLLM rank maps them exactly as vLLM maps a
saved adapter. Trainers expose the adapter only: the frozen base is never sent.

Typical use (a trainer actor with a PEFT model under FSDP2)::

    def rl_sync_sources(self):
        return adapter_sources(self.peft_model)          # {saved name: DTensor}

    parse_adapter_name("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")
    # AdapterTensor(module='model.layers.0.mlp.up_proj', matrix='B')
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

PREFIX = "base_model.model."
"""What PEFT puts before the base model's module names."""
_SAVED = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight$")


class AdapterTensor(NamedTuple):
    """One adapter tensor: the base model's module it adapts, and which of its two matrices."""

    module: str
    matrix: Literal["A", "B"]


def parse_adapter_name(name: str) -> AdapterTensor:
    """The module and matrix of a saved adapter tensor name; `ValueError` for anything else."""
    found = _SAVED.match(name)
    if found is None:
        raise ValueError(
            f"tensor {name!r} is no LoRA adapter tensor: a LoRA group carries PEFT's saved names only, "
            f"'{PREFIX}<module>.lora_A.weight' and '{PREFIX}<module>.lora_B.weight' (expose the "
            "adapter with rl_sync.lora.adapter_sources, never the base weights)"
        )
    matrix: Literal["A", "B"] = "A" if found["matrix"] == "A" else "B"
    return AdapterTensor(found["module"], matrix)


WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")
"""What wrappers put into parameter names (activation checkpointing, `torch.compile`, FSDP1) and
`save_pretrained` leaves out of the names it saves."""


def saved_name(parameter: str, adapter: str) -> str | None:
    """The saved name of model parameter `parameter` if it belongs to `adapter`'s lora_A or
    lora_B, else None (base weights, other adapters); wrappers' parts of the name left out."""
    for wrapper in WRAPPERS:
        parameter = parameter.replace(wrapper, "")
    for matrix in ("lora_A", "lora_B"):
        infix = f".{matrix}.{adapter}."
        if infix in parameter and parameter.endswith(".weight"):
            saved = parameter.replace(infix, f".{matrix}.")
            return saved if saved.startswith(PREFIX) else PREFIX + saved
    return None


class AdapterSources(dict):
    """`{saved name: parameter}` of one adapter, with its PEFT `LoraConfig` (`config`): a trainer
    of a LoRA group checks the group's `LoraSpec` against it (`LoraSpec.check_matches`)."""

    config: Any = None


def adapter_sources(model: Any, adapter: str = "default") -> AdapterSources:
    """`{saved name: parameter}` of `adapter`'s matrices in a PEFT model (DTensors under FSDP2),
    with the adapter's config; `ValueError` naming the model's adapters when it has no `adapter`."""
    configs: Mapping[str, Any] = getattr(model, "peft_config", {})
    if adapter not in configs:
        raise ValueError(f"unknown adapter {adapter!r}: the PEFT model has {sorted(configs) or 'none'}")
    out = AdapterSources()
    out.config = configs[adapter]
    for parameter, tensor in model.named_parameters():
        if f".lora_embedding_A.{adapter}" in parameter or f".lora_embedding_B.{adapter}" in parameter:
            raise ValueError(
                f"adapter {adapter!r} adapts an embedding ({parameter!r}): LoRA groups carry linear layers' "
                "lora_A / lora_B only; leave embeddings out of the adapter's target_modules"
            )
        saved = saved_name(parameter, adapter)
        if saved is not None:
            out[saved] = tensor
    if not out:
        raise ValueError(f"adapter {adapter!r} has no lora_A / lora_B weights in the model")
    return out
