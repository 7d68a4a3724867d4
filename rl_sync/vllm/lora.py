"""LoRA rounds into a vLLM rank: the adapter's tensors bound to one LoRA slot of the engine.

vLLM keeps, per LoRA layer, stacked tensors with one slot per active adapter
(`lora_a_stacked[s][slot, 0, :rank, :in]`, `lora_b_stacked[s][slot, 0, :out, :rank]`, one `s`
per packed sub-module: q/k/v of `qkv_proj`, gate/up of `gate_up_proj`). At binding, every
rank registers the adapter under `LoraSpec.lora_id` from zeros (the loader's own path, from
tensors instead of a directory) and pins it, so it holds one slot for the group's life and
vLLM never reads its `lora_path`. Each adapter tensor maps to its layer and slice as vLLM maps
a saved adapter; which box of it this rank keeps is read off the layer's own `slice_lora_a` /
`slice_lora_b` (`rl_sync.vllm.lora_boxes`), and the ranks' boxes give its layout. A round
writes `lora_A` (and `lora_B` when vLLM's scaling is 1) straight into the slot; a scaled
`lora_B` lands in a buffer of rl-sync's and is scaled into the slot after the round, exactly
as vLLM scales a loaded adapter (`lora_b *= alpha / r` in the LoRA dtype).

Typical use (what `actors.vllm.VllmWorkerMixin` does)::

    slots = LoraSlots(model, spec)
    destinations = slots.bind(checkpoint, engine_rank_of(vllm_config, side_rank=0, side_size=2), engines=1)
    ...   # a round writes into destinations
    slots.after_update(names=None)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace
from typing import Any, NamedTuple

import torch

from ..config.lora import LoraSpec
from ..storage import Destination
from . import compat
from .binding import Checkpoint, EngineRank, ParamReport, lift
from .lora_boxes import Target, check_fits, layout_of, locate, slot_view
from .modes import Mode


class Scaled(NamedTuple):
    """A `lora_B` vLLM scales: received into `raw`, written into `slot` times `scaling`."""

    raw: torch.Tensor
    slot: torch.Tensor
    scaling: float


def lora_manager(model: torch.nn.Module, rank: int):
    """The engine's `LoRAModelManager` (vLLM attaches it to the model it adapts)."""
    manager = getattr(model, "lora_manager", None)
    if manager is None:
        raise ValueError(
            f"vLLM rank {rank}: the engine serves no LoRA adapters; start it with enable_lora=True "
            "(and max_lora_rank at least the adapter's rank) to take LoRA rounds"
        )
    return manager


RL_SYNC_OWNED = "rl_sync_owned"
"""Set on the adapters rl-sync registers: a binding replaces only those."""


class LoraSlots:
    """One vLLM rank's slot for the group's adapter, its destinations and the post-round scaling."""

    def __init__(self, model: torch.nn.Module, spec: LoraSpec):
        self.model, self.spec = model, spec
        self.reports: list[ParamReport] = []
        self.scaled: dict[str, Scaled] = {}
        self.slot = -1
        self.rank = 0

    def bind(self, checkpoint: Checkpoint, where: EngineRank, engines: int) -> dict[str, Destination]:
        """Register the adapter in a slot of this rank's engine and resolve every adapter tensor
        (collective over the engine's ranks, all in the same order)."""
        self.rank = where.rank
        manager = lora_manager(self.model, where.rank)
        config = manager.lora_config
        self._check_rank(config.max_lora_rank)
        mapper = _rename_mapper(self.model)
        targets, boxes = _exchange_targets(manager, checkpoint, mapper, where)
        whole = {}
        for name, target in targets.items():
            shape = tuple(checkpoint[name][1])
            self._check_shape(name, target, shape)
            layout = lift(layout_of(name, shape, [b[name] for b in boxes], where.rank), engines, where.size)
            whole[name] = Destination(None, layout, shape, config.lora_dtype)
        self.slot = self._register(manager, checkpoint, config.lora_dtype, mapper)
        # one scaling for every module: LoraSpec takes no rank or alpha patterns
        scaling = _peft_helper(self.spec).vllm_lora_scaling_factor
        return {name: self._destination(name, targets[name], d, scaling) for name, d in whole.items()}

    def _check_rank(self, max_rank: int) -> None:
        if self.spec.rank > max_rank:
            raise ValueError(
                f"vLLM rank {self.rank}: adapter {self.spec.name!r} has rank {self.spec.rank} but the engine's "
                f"max_lora_rank is {max_rank}; start the engine with max_lora_rank >= {self.spec.rank}"
            )

    def _register(self, manager, checkpoint: Checkpoint, dtype: torch.dtype, mapper) -> int:
        """Add the adapter (zeros) under the spec's id, pin it to a slot; returns the slot. An
        adapter rl-sync registered under that id before (this group's, bound before a repair) is
        replaced; one the engine loaded otherwise is refused, before anything changes."""
        from vllm.lora.lora_model import LoRAModel

        held = manager.list_adapters().get(self.spec.lora_id)
        if held is not None and not getattr(held, RL_SYNC_OWNED, False):
            raise ValueError(
                f"vLLM rank {self.rank}: lora_id {self.spec.lora_id} is taken by an adapter the engine loaded "
                f"itself; give LoraSpec {self.spec.name!r} a lora_id the engine does not serve"
            )
        zeros = {name: torch.zeros(shape, dtype=dtype) for name, (_, shape) in checkpoint.items()}
        adapter = LoRAModel.from_lora_tensors(
            self.spec.lora_id, zeros, _peft_helper(self.spec), device="cpu", dtype=dtype, weights_mapper=mapper
        )
        setattr(adapter, RL_SYNC_OWNED, True)
        manager.remove_adapter(self.spec.lora_id)
        manager.add_adapter(adapter)
        manager.pin_adapter(self.spec.lora_id)
        return manager.lora_index_to_id.index(self.spec.lora_id)

    def _check_shape(self, name: str, target: Target, shape: tuple[int, ...]) -> None:
        """Before anything is registered: the tensor has the spec's rank and its box fits the slot."""
        rank = shape[0 if target.matrix == "A" else 1]
        if rank != self.spec.rank:
            raise ValueError(
                f"vLLM rank {self.rank}: adapter tensor {name!r} {shape} has rank {rank}, but LoraSpec.rank "
                f"is {self.spec.rank}"
            )
        check_fits(target, name, self.rank)

    def _destination(self, name: str, target: Target, whole: Destination, scaling: float) -> Destination:
        """`whole` with this rank's storage: the slot's box, or a buffer `scaling` is applied from."""
        slot = slot_view(target, self.slot)
        local, reason = slot, "written into the adapter's slot"
        mode: Mode = "direct"
        if target.matrix == "B" and scaling != 1:
            local = torch.zeros(slot.shape, dtype=whole.dtype, device=slot.device)  # (as the slot)
            self.scaled[name] = Scaled(local, slot, scaling)
            mode, reason = "reload", f"scaled by {scaling:g} into the adapter's slot after each round"
        self.reports.append(ParamReport(name, target.layer, mode, reason, local.numel() * local.element_size()))
        return replace(whole, local=local)

    def write_modes(self) -> dict[str, str]:
        """`{name: "direct" | "reload"}`: `reload` for a `lora_B` scaled after each round."""
        return {r.name: r.mode for r in self.reports}

    def _holder(self) -> int | None:
        """The adapter id in the slot this adapter was bound to, or None when it holds no
        registered adapter."""
        manager = lora_manager(self.model, self.rank)
        held = manager.lora_index_to_id[self.slot] if 0 <= self.slot < len(manager.lora_index_to_id) else None
        return held if held in manager.list_adapters() else None

    def holds_slot(self) -> bool:
        """Whether the adapter still holds the slot it was bound to (vLLM's LoRA state was not
        reset, the adapter not removed)."""
        return self._holder() == self.spec.lora_id

    def check(self) -> None:
        """Before anything is written or committed: `holds_slot()`, else `ValueError`."""
        if not self.holds_slot():
            held = self._holder()
            raise ValueError(
                f"vLLM rank {self.rank}: adapter {self.spec.name!r} (id {self.spec.lora_id}) no longer holds LoRA "
                f"slot {self.slot} (it holds {held}; the engine's LoRA state was reset or the adapter removed); "
                "nothing was written, and the next push binds it anew (with auto_repair) or call repair()"
            )

    def after_update(self, names: Collection[str] | None) -> int:
        """Scale what a round wrote of each scaled `lora_B` into its slot; returns tensors scaled."""
        done = 0
        for name, scaled in self.scaled.items():
            if names is None or name in names:
                scaled.slot.copy_(scaled.raw).mul_(scaled.scaling)
                done += 1
        return done


def _exchange_targets(manager, checkpoint: Checkpoint, mapper, where: EngineRank) -> tuple[dict, list[dict]]:
    """Every adapter tensor's target on this rank, and every rank's boxes (all-gathered); a
    rank that cannot place a tensor makes every rank raise its error, none waits for it."""
    try:
        targets = {
            name: locate(manager, name, tuple(shape), mapper, where.rank) for name, (_, shape) in checkpoint.items()
        }
        found: dict | str = {name: t.box for name, t in targets.items()}
    except ValueError as exc:
        targets, found = {}, str(exc)
    gathered = where.exchange(found)
    errors = [g for g in gathered if isinstance(g, str)]
    if errors:
        raise ValueError(errors[0])
    return targets, gathered


def _peft_helper(spec: LoraSpec):
    from vllm.lora.peft_helper import PEFTHelper

    return PEFTHelper.from_dict(spec.peft_config())


def _rename_mapper(model: torch.nn.Module) -> Any:
    """vLLM's renames from a saved adapter's module names to the model's (None for most models),
    as its LoRA loader applies them."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    return None if mapper is None else compat.lora_name_mapper(mapper)
