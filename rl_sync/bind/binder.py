"""Resolve checkpoint names to live storage on one inference worker.

For every checkpoint tensor the trainers declare, the binder finds its rule,
the destination layout over the worker side's ranks (engines x pipeline
stages x TP, GQA and expert parallelism included), and, on the ranks that keep
a part of it, the exact view of live storage: a whole parameter, a fused slot
(q/k/v of `qkv_proj`, gate/up of `gate_up_proj`), an expert's slice of a
stacked parameter, or a vocab shard inside padded rows. Every worker computes
the same layouts from the same config, which the coordinator checks.

Names no rule binds, or that bind to a different dtype, are fallbacks: they
are delivered whole to every worker and handed to a `load_weights`-style hook;
without a hook they fail init, listed.

The same layouts, without live storage, are the destinations of synthetic
models (`Binder.destination`, `rl_sync.models.synthetic`).

Typical use::

    binding = Binder(cfg, Parallel(engines=2, tp=4)).bind(checkpoint, model.params, rank)
    binding.destinations["model.layers.0.self_attn.k_proj.weight"].local   # a slot of qkv_proj
    binding.destinations["model.layers.0.self_attn.k_proj.weight"].slot    # (params, "...qkv_proj.weight")
    Binder(cfg, par).destination("model.layers.0.self_attn.k_proj.weight", (1024, 4096))   # its Layout
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import torch

from ..models.config import ModelConfig, Parallel
from ..planning.layout import Box, Layout, Mesh, Replicate, Shard
from ..planning.quant import LIVE_SCALE_SUFFIX, dest_scale_layout, grid_shape, scale_name
from ..storage import Destination, Slot
from .rules import BUILTIN, FUSED, MLA_PLAIN_Q_RULES, QUANTIZED, Rule

NO_RULE = "no rule binds it"
"""Why a name the binder resolves falls back (`Destination.reason`)."""


@dataclass(frozen=True)
class Binding:
    """What one worker binds: destinations by checkpoint name, and the fallback names."""

    destinations: dict[str, Destination]
    fallbacks: tuple[str, ...]


@dataclass(frozen=True)
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    rule: Rule
    groups: dict[str, str]
    layout: Layout
    target: str
    box: Box | None


@overload
def _fmt(template: str, groups: dict[str, str]) -> str: ...
@overload
def _fmt(template: str | None, groups: dict[str, str]) -> str | None: ...
def _fmt(template: str | None, groups: dict[str, str]) -> str | None:
    return None if template is None else template.format(**groups)


class Binder:
    """Binding rules applied to one model config and parallel layout."""

    def __init__(self, cfg: ModelConfig, par: Parallel, rules: Sequence[Rule] = ()):
        self.cfg, self.par = cfg, par
        plain_q = MLA_PLAIN_Q_RULES if cfg.attention == "mla" and not cfg.q_lora_rank else ()
        self.rules = tuple(rules) + plain_q + BUILTIN[cfg.family]
        self._compiled = [(re.compile(r.pattern), r) for r in self.rules]
        self._layouts: dict[tuple, Layout | None] = {}
        if cfg.experts and par.ep and cfg.experts % par.tp:
            raise ValueError(f"expert parallelism needs experts ({cfg.experts}) divisible by tp ({par.tp})")

    def match(self, name: str) -> tuple[Rule, dict[str, str]] | None:
        for pattern, rule in self._compiled:
            found = pattern.fullmatch(name)
            if found:
                return rule, found.groupdict()
        return None

    def _stages(self, rule: Rule, groups: dict[str, str]) -> list[int]:
        last = self.par.pp - 1
        if "layer" in groups:
            return [self.par.stage_of(int(groups["layer"]), self.cfg.layers)]
        if rule.target.startswith("model.embed_tokens"):
            return sorted({0, last}) if self.cfg.tie_embeddings else [0]
        return [last]

    def _mesh(self, stages: list[int], tp_ranks: Sequence[int] | None = None, split_tp: tuple[int, ...] = ()) -> Mesh:
        """Worker ranks as (engines, stages..., tp...) for the given stages and TP ranks."""
        par = self.par
        tps = list(range(par.tp)) if tp_ranks is None else list(tp_ranks)
        shape = split_tp or (len(tps),)
        nested = [[_reshape([par.rank(e, s, t) for t in tps], shape) for s in stages] for e in range(par.engines)]
        if len(stages) == 1:
            nested = [row[0] for row in nested]
        return Mesh.from_ranks(nested)

    def destination(self, name: str, shape: tuple[int, ...]) -> Layout:
        """The destination layout of checkpoint tensor `name` over the worker side's ranks
        `[0, par.size)`; `ValueError` when no rule binds it in place (a synthetic model must
        never fall back)."""
        found = self.match(name)
        layout = None if found is None else self.layout(found[0], found[1], tuple(shape))
        if layout is None:
            why = "no rule matches it" if found is None else f"its rule {found[0].pattern!r} falls back"
            raise ValueError(
                f"{self.cfg.family} checkpoint tensor {name!r} (shape {tuple(shape)}) has no destination layout: {why}"
            )
        return layout

    def quantized(self, rule: Rule, groups: dict[str, str]) -> bool:
        """Whether a block-quantized FP8 model keeps what `rule` binds as FP8: the linear and
        expert weights (`QUANTIZED` targets); `TPModel` and vLLM quantize the same set."""
        return self.cfg.fp8_block is not None and _fmt(rule.target, groups).endswith(QUANTIZED)

    def layout(self, rule: Rule, groups: dict[str, str], shape: tuple[int, ...]) -> Layout | None:
        """The destination layout of one checkpoint tensor, or None when it must fall back
        (one `Layout` object per distinct layout)."""
        stages = self._stages(rule, groups)
        owner = None
        if rule.expert is not None and self.par.ep:
            owner = int(_fmt(rule.expert, groups)) // (self.cfg.experts // self.par.tp)
        key = (rule.split, rule.tp_dim, tuple(stages), owner)
        if key not in self._layouts:
            self._layouts[key] = self._layout(rule, stages, owner)
        return self._layouts[key]

    def _layout(self, rule: Rule, stages: list[int], owner: int | None) -> Layout | None:
        par, cfg = self.par, self.cfg
        lead = (Replicate(),) * (2 if len(stages) > 1 else 1)
        split = rule.split
        if split == "replicated":
            return Layout(self._mesh(stages), lead + (Replicate(),))
        if split == "vocab":
            return Layout(self._mesh(stages), lead + (Shard(0, par.padded_vocab(cfg.vocab) // par.tp),))
        if split in ("column", "row"):
            return Layout(self._mesh(stages), lead + (Shard(0 if split == "column" else 1),))
        if split == "kv":
            if par.tp <= cfg.kv_heads:
                return Layout(self._mesh(stages), lead + (Shard(0),))
            if par.tp % cfg.kv_heads:
                raise ValueError(f"tp {par.tp} must divide or be a multiple of kv_heads {cfg.kv_heads}")
            mesh = self._mesh(stages, split_tp=(cfg.kv_heads, par.tp // cfg.kv_heads))
            return Layout(mesh, lead + (Shard(0), Replicate()))
        if split == "experts":
            if par.ep:
                return Layout(self._mesh(stages), lead + (Shard(0),))
            return None if rule.tp_dim is None else Layout(self._mesh(stages), lead + (Shard(rule.tp_dim),))
        if owner is not None:
            return Layout(self._mesh(stages, tp_ranks=[owner]), lead + (Replicate(),))
        return Layout(self._mesh(stages), lead + (Shard(0 if split == "expert_column" else 1),))

    def bind(
        self,
        checkpoint: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
        params: Mapping[str, torch.Tensor],
        rank: int,
        allow_fallback: bool = False,
    ) -> Binding:
        """Destinations for every checkpoint name on worker side rank `rank` (see module docstring)."""
        entries, fallbacks = [], []
        for name, (dtype, shape) in checkpoint.items():
            found = self.match(name)
            layout = None if found is None else self.layout(found[0], found[1], tuple(shape))
            if found is None or layout is None:
                fallbacks.append(name)
                continue
            rule, groups = found
            box = layout.local_box(tuple(shape), rank)
            entries.append(
                _Entry(name, tuple(shape), dtype, rule, groups, layout, self._target(rule, groups, rank), box)
            )
        if fallbacks and not allow_fallback:
            raise ValueError(
                f"worker rank {rank}: no rule binds {len(fallbacks)} checkpoint tensors "
                f"{fallbacks[:8]}; add rules or give the worker a fallback hook"
            )
        destinations = self._destinations(entries, params, rank)
        for name in fallbacks:
            dtype, shape = checkpoint[name]
            whole = Layout.replicated(Mesh((self.par.size,)))
            destinations[name] = Destination(
                torch.empty(shape, dtype=dtype), whole, tuple(shape), dtype, fallback=True, reason=NO_RULE
            )
        return Binding(destinations, tuple(fallbacks))

    def _target(self, rule: Rule, groups: dict[str, str], rank: int) -> str:
        target = _fmt(rule.target, groups)
        _, stage, _ = self.par.coords(rank)
        if rule.split == "vocab" and target.startswith("model.embed_tokens") and stage == self.par.pp - 1 and stage > 0:
            return "lm_head.weight"  # tied embeddings: the last stage's copy is its head
        return target

    def _destinations(
        self, entries: list[_Entry], params: Mapping[str, torch.Tensor], rank: int
    ) -> dict[str, Destination]:
        offsets = _slot_offsets(entries)
        out = {}
        for e in entries:
            view, block = None, self._block(e)
            if e.box is not None:
                if e.target not in params:
                    raise ValueError(
                        f"worker rank {rank}: checkpoint tensor {e.name!r} binds to live parameter "
                        f"{e.target!r}, which this rank does not hold"
                    )
                view = self._view(e, params[e.target], offsets.get(e.name, 0), rank, e.box, block is not None)
            slot = None if view is None else Slot(params, e.target)
            if block is not None:
                out[e.name] = Destination(view, e.layout, e.shape, torch.float8_e4m3fn, block=block, slot=slot)
                out[scale_name(e.name)] = self._scales(e, params, block, offsets.get(e.name, 0), rank)
            else:
                out[e.name] = Destination(view, e.layout, e.shape, e.dtype, slot=slot)
        return out

    def _block(self, e: _Entry) -> tuple[int, int] | None:
        """The FP8 block size this rank keeps this checkpoint tensor quantized in (`quantized`, for a
        floating-point checkpoint tensor), or None when it keeps it as is."""
        quantized = self.quantized(e.rule, e.groups) and e.dtype.is_floating_point
        return self.cfg.fp8_block if quantized else None

    def _scales(
        self, e: _Entry, params: Mapping[str, torch.Tensor], block: tuple[int, int], slot_offset: int, rank: int
    ) -> Destination:
        """The destination of a quantized tensor's block scales: its blocks of the live scale
        parameter (a fused slot's start, in blocks, is its start in rows over the block rows)."""
        what = f"worker rank {rank}: {e.name!r}"
        layout, grid = dest_scale_layout(e.layout, e.shape, block, what), grid_shape(e.shape, block, what)
        box, view = layout.local_box(grid, rank), None
        if box is not None:
            if slot_offset % block[0]:
                raise ValueError(
                    f"{what}: its slot starts at row {slot_offset} of {e.target!r}, not on a "
                    f"{block[0]}-row block boundary; every fused slot must hold whole blocks"
                )
            target = e.target + LIVE_SCALE_SUFFIX
            if target not in params:
                raise ValueError(f"{what}: {e.target!r} is FP8 but this rank holds no {target!r} for its scales")
            view = self._view(e, params[target], slot_offset // block[0], rank, box, True)
            return Destination(view, layout, grid, torch.float32, slot=Slot(params, target))
        return Destination(view, layout, grid, torch.float32)

    def _view(
        self, e: _Entry, param: torch.Tensor, slot_offset: int, rank: int, box: Box, quantized: bool
    ) -> torch.Tensor:
        if param.dtype != e.dtype and not quantized:
            raise ValueError(
                f"worker rank {rank}: {e.name!r} is {e.dtype} in the checkpoint but live parameter "
                f"{e.target!r} is {param.dtype}; a cast needs a fallback rule"
            )
        view = param
        if e.rule.expert is not None:
            expert = int(_fmt(e.rule.expert, e.groups))
            view = view[expert % (self.cfg.experts // self.par.tp) if self.par.ep else expert]
        fused = next((slots for suffix, slots in FUSED.items() if e.target.endswith(suffix)), None)
        if fused is not None and e.rule.slot is not None:
            view = view.narrow(0, slot_offset, box.sizes[0])
        elif e.rule.split == "vocab":
            view = view.narrow(0, 0, box.sizes[0])
        if tuple(view.shape) != box.sizes:
            raise ValueError(
                f"worker rank {rank}: {e.name!r} needs a {box.sizes} box here but live parameter "
                f"{e.target!r} (shape {tuple(param.shape)}) gives {tuple(view.shape)}"
            )
        return view


def _slot_offsets(entries: list[_Entry]) -> dict[str, int]:
    """Offset of each fused slot along the fused dim: the local sizes of the slots before it."""
    groups: dict[tuple[str, str | None], list[tuple[int, str, int]]] = {}
    for e in entries:
        slots = next((s for suffix, s in FUSED.items() if e.target.endswith(suffix)), None)
        if slots is None or e.rule.slot is None or e.box is None:
            continue
        slot = _fmt(e.rule.slot, e.groups)
        member = (slots.index(slot), e.name, e.box.sizes[0])
        groups.setdefault((e.target, _fmt(e.rule.expert, e.groups)), []).append(member)
    offsets = {}
    for members in groups.values():
        cursor = 0
        for _, name, rows in sorted(members, key=lambda m: m[0]):
            offsets[name] = cursor
            cursor += rows
    return offsets


def _reshape(flat: list[int], shape: tuple[int, ...]):
    if len(shape) == 1:
        return flat
    step = len(flat) // shape[0]
    return [_reshape(flat[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
