"""Ready actors around real models: a Hugging Face trainer sharded with FSDP2,
and an inference engine worker holding `rl_sync.models.TPModel`.

Both form their own Gloo process groups (trainers: one FSDP group; workers:
one world for every worker and a TP group per engine stage), independent of
rl-sync's sync group. Wrap them with `ray.remote` like any class::

    Trainer = ray.remote(HFTrainer)
    t = Trainer.remote(rank, 2, hf_config.to_dict(), "tcp://127.0.0.1:29500")
    Worker = ray.remote(EngineWorker)
    w = Worker.remote(rank, Parallel(tp=2), hf_config.to_dict(), "tcp://127.0.0.1:29501")

Requires `transformers` (the `hf` extra), and `peft` for a trainer with a LoRA adapter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from rl_sync.bind.binder import Binder
from rl_sync.bind.rules import Rule
from rl_sync.lora import adapter_sources
from rl_sync.models.config import ModelConfig, Parallel
from rl_sync.models.tp_model import TPModel

from .trainer_mixin import SyncTrainerMixin
from .worker_mixin import SyncWorkerMixin


def _with_adapter(model, lora: Mapping[str, Any]):
    """`model` with a PEFT LoRA adapter (`default`) of `lora`'s `LoraConfig` arguments."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**lora))


def hf_config(config: Mapping[str, Any]):
    """A transformers config object from its `to_dict()` form."""
    from transformers import AutoConfig

    values = dict(config)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def decoder_layers(model: Any) -> torch.nn.ModuleList:
    """A transformers causal LM's stack of decoder layers (`model.layers`, GPT-2's `transformer.h`,
    ...): its first module list of `config.num_hidden_layers` layers."""
    count = model.config.num_hidden_layers
    found = next((m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), None)
    if found is None:
        raise ValueError(
            f"{type(model).__name__} holds no list of {count} modules (config.num_hidden_layers): "
            "expected its decoder layers"
        )
    return found


class HFTrainer(SyncTrainerMixin):
    """A trainer rank: a `transformers` causal LM from a config (random init, no download),
    every decoder layer and the root `fully_shard`-ed over the trainers' group (Gloo on the CPU;
    `device="cuda"`: NCCL, one trainer per GPU, the GPU Ray gives the actor). `lora`: PEFT
    `LoraConfig` arguments; the model gets that adapter (the base frozen) before sharding, and
    the trainer exposes and trains only the adapter (`rl_sync.lora.adapter_sources`)."""

    def __init__(
        self,
        rank: int,
        size: int,
        config: Mapping[str, Any],
        init_method: str,
        seed: int = 0,
        norm_noise: float = 0.1,
        dtype: str = "float32",
        device: str = "cpu",
        lora: Mapping[str, Any] | None = None,
    ):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        self.rank, self.size, self.device = rank, size, torch.device(device)
        backend = "gloo" if self.device.type == "cpu" else f"{self.device.type}:nccl,cpu:gloo"
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=120)
        )
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(hf_config(config)).to(getattr(torch, dtype)).to(self.device)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.normal_(1.0, norm_noise)  # ones would hide a norm bound to the wrong slot
        self.lora = lora is not None
        self.model = model if lora is None else _with_adapter(model, lora)
        mesh = init_device_mesh(self.device.type, (size,))
        for layer in decoder_layers(self.base()):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.optimizer: torch.optim.AdamW | None = None

    def base(self):
        """The transformers model (under a PEFT model, the one it adapts)."""
        return self.model.get_base_model() if self.lora else self.model

    def rl_sync_sources(self) -> dict[str, Any]:
        return adapter_sources(self.model) if self.lora else dict(self.model.named_parameters())

    @ray.method  # typed: handles get `full_state.remote`
    def full_state(self) -> dict[str, torch.Tensor]:
        """Every parameter whole, on the CPU (collective: every trainer calls it)."""
        return {n: p.full_tensor().detach().cpu().clone() for n, p in self.model.named_parameters()}

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The trainer model's logits (collective: every trainer calls it, same tokens)."""
        with torch.no_grad():
            logits = self.model(tokens.to(self.device)).logits.cpu()
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward without backward
        return logits

    def train_step(self, tokens: torch.Tensor, lr: float = 1e-3) -> float:
        """One next-token step with AdamW over the trainable parameters (collective)."""
        if self.optimizer is None:
            self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=lr)
        tokens = tokens.to(self.device)
        logits = self.model(tokens[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return loss.item()

    @ray.method  # typed: handles get `base_state.remote`
    def base_state(self) -> dict[str, torch.Tensor]:
        """The base model's parameters whole, by their transformers names, on the CPU (what a
        checkpoint of it holds; collective)."""
        return {
            n.replace(".base_layer.", "."): p.full_tensor().detach().cpu().clone()
            for n, p in self.base().named_parameters()
            if ".lora_" not in n
        }

    def save_adapter(self, directory: str) -> None:
        """The adapter whole, written by rank 0 with PEFT's `save_pretrained` (collective)."""
        state = {n: p.full_tensor().detach().cpu() for n, p in self.model.state_dict().items() if ".lora_" in n}
        if self.rank == 0:
            self.model.save_pretrained(directory, state_dict=state)

    @ray.method  # typed: handles get `call.remote`
    def call(self, fn, *args, **kwargs):
        return fn(self, *args, **kwargs)


class EngineWorker(SyncWorkerMixin):
    """An inference worker rank holding its `TPModel` shard; binds checkpoint names with
    the built-in rules (plus `rules`); `load_hook(self, pairs)` takes what falls back.
    `fp8_block`: keep projections and experts block-quantized FP8 in blocks of this size;
    `dtype`: every other weight's (and the forward's) dtype."""

    def __init__(
        self,
        rank: int,
        par: Parallel,
        config: Mapping[str, Any],
        init_method: str,
        rules: Iterable[Rule] = (),
        load_hook=None,
        fp8_block: tuple[int, int] | None = None,
        dtype: str = "float32",
    ):
        self.rank, self.par = rank, par
        self.cfg = ModelConfig.from_hf(hf_config(config))
        if fp8_block is not None:
            rows, cols = fp8_block  # a tuple, or a list from a config
            self.cfg = replace(self.cfg, fp8_block=(rows, cols))
        self.model = TPModel(self.cfg, par, rank, getattr(torch, dtype))
        self.binder = Binder(self.cfg, par, tuple(rules))
        self.load_hook = load_hook
        self.fallback_calls = 0
        dist.init_process_group(
            "gloo", init_method=init_method, rank=rank, world_size=par.size, timeout=timedelta(seconds=120)
        )
        self.groups = {}
        for e in range(par.engines):
            for s in range(par.pp):
                ranks = [par.rank(e, s, t) for t in range(par.tp)]
                self.groups[(e, s)] = dist.new_group(ranks, backend="gloo")
        engine, stage, _ = par.coords(rank)
        self.group = self.groups[(engine, stage)]

    def rl_sync_destinations(self, checkpoint: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]):
        binding = self.binder.bind(checkpoint, self.model.params, self.rank, allow_fallback=self.load_hook is not None)
        return binding.destinations

    def rl_sync_load_fallbacks(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.fallback_calls += 1
        self.load_hook(self, pairs)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """This rank's stage forward (every TP rank of the stage calls it with the same inputs)."""
        with torch.no_grad():
            return self.model.forward(inputs, self.group)

    @ray.method  # typed: handles get `call.remote`
    def call(self, fn, *args, **kwargs):
        return fn(self, *args, **kwargs)
