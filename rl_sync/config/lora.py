"""`LoraSpec`: the adapter a LoRA group pushes into vLLM's LoRA slots, and the name it is served by.

A LoRA group carries the trainers' PEFT adapter tensors only (`rl_sync.lora.adapter_sources`);
every vLLM rank keeps the adapter in one LoRA slot of its engine, registered under `lora_id`,
and each round writes that slot in place. Requests name it with `request()`.

Typical use::

    spec = LoraSpec.of_peft(peft_model.peft_config["default"], name="policy", lora_id=1)
    sync = WeightSync.create(trainers, engine.ranks, config, lora=spec)
    sync.push()
    llm.generate(prompts, params, lora_request=spec.request())
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UNSUPPORTED_PEFT = (
    "rank_pattern",
    "alpha_pattern",
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "layer_replication",
    "alora_invocation_tokens",
)
"""PEFT options a `LoraSpec` does not carry: `of_peft` refuses an adapter config that sets them."""
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")
"""`init_lora_weights` methods that change the trainers' base weights, which the engine does not
hold: `of_peft` refuses them."""


def _unsupported(config: Any) -> list[str]:
    """What of a PEFT `LoraConfig` a `LoraSpec` cannot carry (see `UNSUPPORTED_PEFT`)."""
    found = [key for key in UNSUPPORTED_PEFT if getattr(config, key, None)]
    if getattr(config, "bias", "none") != "none":
        found.append(f"bias={config.bias!r}")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        found.append(f"init_lora_weights={init!r}")
    return found


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """One PEFT LoRA adapter as vLLM serves it."""

    name: str
    """The adapter's name in vLLM (`LoRARequest.lora_name`)."""
    lora_id: int
    """vLLM's integer id of the adapter (`LoRARequest.lora_int_id`), >= 1, unique in the engine."""
    rank: int
    """PEFT's `r`: the rows of every `lora_A` and the columns of every `lora_B`."""
    alpha: float
    """PEFT's `lora_alpha`; vLLM folds `alpha / rank` (rsLoRA: `alpha / sqrt(rank)`) into `lora_B`."""
    use_rslora: bool = False
    """PEFT's `use_rslora`."""
    path: str = "rl-sync://adapter"
    """`LoRARequest.lora_path`: vLLM reads nothing there (the slot is filled by rl-sync), but
    needs one, and its prefix cache keys include it."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"LoraSpec.name must be a non-empty str, got {self.name!r}")
        for field in ("lora_id", "rank"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LoraSpec.{field} must be an int >= 1, got {value!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not self.alpha > 0:
            raise ValueError(f"LoraSpec.alpha must be a number > 0, got {self.alpha!r}")
        if not isinstance(self.use_rslora, bool):
            raise TypeError(f"LoraSpec.use_rslora must be True or False, got {self.use_rslora!r}")
        if not isinstance(self.path, str) or not self.path:
            raise TypeError(f"LoraSpec.path must be a non-empty str, got {self.path!r}")

    @classmethod
    def of_peft(cls, config: Any, *, name: str, lora_id: int) -> LoraSpec:
        """From PEFT's `LoraConfig` of the adapter the trainers train (`peft_model.peft_config[adapter]`)."""
        unsupported = _unsupported(config)
        if unsupported:
            raise ValueError(
                f"LoraSpec.of_peft: adapter {name!r} sets {unsupported}; LoRA rounds take plain LoRA "
                "(one r and lora_alpha for every module, no DoRA, bias, modules_to_save, layer replication "
                "or aLoRA, and an initialisation that leaves the base weights as the engine holds them)"
            )
        return cls(name=name, lora_id=lora_id, rank=config.r, alpha=config.lora_alpha, use_rslora=config.use_rslora)

    def check_matches(self, config: Any, who: str) -> None:
        """`ValueError` naming both unless PEFT `LoraConfig` `config` (the one the trainers train)
        has this spec's rank, alpha and rsLoRA: vLLM scales `lora_B` by them (`who`: the trainer)."""
        theirs = (config.r, config.lora_alpha, bool(getattr(config, "use_rslora", False)))
        if theirs != (self.rank, self.alpha, self.use_rslora):
            raise ValueError(
                f"{who}: the adapter's PEFT config has r={theirs[0]}, lora_alpha={theirs[1]}, use_rslora={theirs[2]}, "
                f"but LoraSpec {self.name!r} has rank={self.rank}, alpha={self.alpha}, use_rslora={self.use_rslora}; "
                "build the spec with LoraSpec.of_peft(peft_config, ...)"
            )

    def peft_config(self) -> dict[str, Any]:
        """The adapter config as vLLM's `PEFTHelper.from_dict` reads it."""
        return {"r": self.rank, "lora_alpha": self.alpha, "use_rslora": self.use_rslora, "target_modules": []}

    def request(self):
        """vLLM's `LoRARequest` that serves this adapter (what rl-sync's rounds wrote)."""
        from vllm.lora.request import LoRARequest

        return LoRARequest(self.name, self.lora_id, self.path)
