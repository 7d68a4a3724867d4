"""Bind the trainers' checkpoint to a running vLLM engine rank, read off vLLM's own loader.

For every checkpoint name, the probe (`rl_sync.vllm.probe`) shows which box of
it this rank's loader keeps and where it lands; the ranks of the engine
exchange what they found (`EngineRank.exchange`, an all-gather over the
engine's ranks) so each can infer the same layout over the engine
(`rl_sync.bind.infer`) and fail together. Then every name gets a
`Destination`:

* **direct**: a strided view of the live parameter (q/k/v slots of
  `qkv_proj`, gate/up of `gate_up_proj`, experts of `w13_weight`, the real rows
  of a padded vocabulary shard, ...);
* **reload**: the same view of a buffer in the loader's form, processed by
  vLLM after each round (`rl_sync.vllm.reload`);
* **fallback**: the whole tensor, handed to vLLM's loader. A name falls back
  when the loader's copies are not one box per rank, no layout gives the
  boxes, or its module's parameters cannot be rebuilt from what the trainers
  send; every name feeding a module with a fallback falls back too (vLLM's
  layerwise reload needs whole modules).

A name vLLM's loader refuses, or writes nowhere on any rank, fails init with
an error naming it and the rank.

Typical use (what `rl_sync.vllm.rank.VllmRank` does)::

    binding = VllmBinding.build(model, model_config, checkpoint, EngineRank(rank, size, exchange), engines)
    binding.destinations["model.layers.0.self_attn.k_proj.weight"]   # a slot of qkv_proj
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..bind.infer import Merged, infer_layout, merge_pieces
from ..layout import Box, Layout, Mesh, Replicate
from ..storage import Destination
from .modes import Mode, param_mode
from .probe import ParamForm, Probe, probe_loads
from .reload import Processor

Checkpoint = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass(frozen=True)
class EngineRank:
    """One rank of a vLLM engine: its tensor-parallel rank and size, and an all-gather of small
    Python objects over the engine's ranks (every rank calls it, in the same order)."""

    rank: int
    size: int
    exchange: Callable[[object], list]


@dataclass(frozen=True)
class ParamReport:
    """How one checkpoint name is written on this rank."""

    name: str
    param: str | None
    mode: Mode
    reason: str
    nbytes: int


def lift(layout: Layout, engines: int, size: int) -> Layout:
    """An engine-local layout over `engines` replicas of `size` ranks each (side ranks
    `e * size + r`): replicated across replicas."""
    nested = [[e * size + r for r in layout.mesh.ranks] for e in range(engines)]
    mesh = Mesh((engines,) + layout.mesh.shape, ranks=[r for row in nested for r in row])
    return Layout(mesh, (Replicate(),) + layout.placements)


def _owners(model: torch.nn.Module) -> dict[int, list[torch.nn.Module]]:
    """Live parameter identity -> every module holding it (tied embeddings have two)."""
    out: dict[int, list[torch.nn.Module]] = {}
    for _, module in model.named_modules():
        for param in module._parameters.values():
            if param is not None:
                out.setdefault(id(param), []).append(module)
    return out


def _live_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters(remove_duplicate=False))


def _local_report(probe: Probe, checkpoint: Checkpoint) -> dict[str, tuple]:
    """Per name: (status, parameter, box offsets, box sizes, parameters it touches)."""
    out = {}
    for name in checkpoint:
        pieces = probe.pieces.get(name, [])
        params = sorted({p.param for p in pieces})
        merged = merge_pieces(pieces) if pieces and name not in probe.unresolved else None
        if merged is not None:
            out[name] = ("ok", merged.param, merged.box.offsets, merged.box.sizes, params)
        elif pieces or name in probe.unresolved:
            out[name] = ("split", None, None, None, params)
        else:
            out[name] = ("none", None, None, None, params)
    return out


class VllmBinding:
    """Destinations of one vLLM rank for a checkpoint, plus what runs after each round."""

    def __init__(self, destinations: dict[str, Destination], reports: list[ParamReport], processor: Processor):
        self.destinations, self.reports, self.processor = destinations, reports, processor

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.reports if r.mode == "fallback")

    @classmethod
    def build(cls, model: torch.nn.Module, model_config, checkpoint: Checkpoint, where: EngineRank,
              engines: int = 1) -> VllmBinding:
        """Resolve every checkpoint name on this rank (collective over the engine's ranks)."""
        dtype = model_config.dtype
        probe = probe_loads(model, checkpoint, dtype)
        if probe.errors:
            name, error = next(iter(probe.errors.items()))
            raise ValueError(f"vLLM rank {where.rank}: checkpoint tensor {name!r} is refused by vLLM's loader "
                             f"({error}); the engine's model has no parameter for it")
        gathered = where.exchange(_local_report(probe, checkpoint))
        resolver = _Resolver(model, probe, checkpoint, where, gathered)
        layouts, fallback = resolver.layouts()
        fallback = resolver.close_modules(fallback | set().union(*where.exchange(sorted(resolver.uncovered(fallback)))))
        return resolver.finish(layouts, fallback, dtype, model_config, engines)


class _Resolver:
    """The steps of `VllmBinding.build` on one rank, sharing what the probe and exchange found."""

    def __init__(self, model, probe: Probe, checkpoint: Checkpoint, where: EngineRank, gathered: list[dict]):
        self.model, self.probe, self.checkpoint, self.where, self.gathered = model, probe, checkpoint, where, gathered
        self.live = _live_params(model)
        self.owners = _owners(model)
        self.mine = gathered[where.rank]
        self.merged: dict[str, Merged] = {n: merge_pieces(probe.pieces[n]) for n, r in self.mine.items() if r[0] == "ok"}

    def layouts(self) -> tuple[dict[str, Layout], set[str]]:
        """Engine-local layouts of the names that bind, and the names that fall back."""
        layouts, fallback = {}, set()
        for name, (_, shape) in self.checkpoint.items():
            reports = [g[name] for g in self.gathered]
            if all(r[0] == "none" for r in reports):
                raise ValueError(f"vLLM rank {self.where.rank}: checkpoint tensor {name!r} {tuple(shape)} is written "
                                 f"nowhere by vLLM's loader on any of the engine's {self.where.size} ranks; the "
                                 "engine's model has no parameter for it")
            if any(r[0] == "split" for r in reports):
                fallback.add(name)
                continue
            boxes = [Box(tuple(r[2]), tuple(r[3])) if r[0] == "ok" else None for r in reports]
            layout = infer_layout(tuple(shape), boxes)
            if layout is None:
                fallback.add(name)
            else:
                layouts[name] = layout
        return layouts, fallback

    def _modules_of_param(self, param: str) -> list[torch.nn.Module]:
        live = self.live.get(param)
        return [] if live is None else self.owners.get(id(live), [])

    def close_modules(self, fallback: set[str]) -> set[str]:
        """Every name feeding a module that a fallback name feeds falls back too."""
        params_of = {name: set().union(*(g[name][4] for g in self.gathered)) for name in self.checkpoint}
        fallback = set(fallback)
        while True:
            modules = {id(m) for name in fallback for p in params_of[name] for m in self._modules_of_param(p)}
            grown = {n for n, params in params_of.items()
                     if any(id(m) in modules for p in params for m in self._modules_of_param(p))}
            if grown <= fallback:
                return fallback
            fallback |= grown

    def _reload_params(self, fallback: set[str]) -> dict[str, tuple[Mode, str]]:
        """Mode of every parameter this rank's bound names land in."""
        modes = {}
        for name, report in self.mine.items():
            if report[0] == "ok" and name not in fallback and report[1] not in modes:
                param, owners = report[1], self._modules_of_param(report[1])
                modes[param] = param_mode(owners, self.live[param], self.probe.forms[param])
                if modes[param][0] == "reload" and not any(_attr_of(m, self.live[param]) in _module_forms(m) for m in owners):
                    modes[param] = ("direct", "used as stored (vLLM's processing leaves it alone)")
        return modes

    def _covered(self, fallback: set[str]) -> dict[int, int]:
        """Elements of each live parameter the bound names and the loader's fills cover."""
        covered: dict[int, int] = {}
        for name, report in self.mine.items():
            if report[0] == "ok" and name not in fallback:
                key = id(self.live[report[1]])
                covered[key] = covered.get(key, 0) + math.prod(report[3])
        for param, fills in self.probe.fills.items():
            if param in self.live:
                key = id(self.live[param])
                covered[key] = covered.get(key, 0) + sum(math.prod(g.sizes) for g, _ in fills)
        return covered

    def reload_modules(self, fallback: set[str]) -> list[torch.nn.Module]:
        modules: dict[int, torch.nn.Module] = {}
        for param, (mode, _) in self._reload_params(fallback).items():
            if mode == "reload":
                modules.update((id(m), m) for m in self._modules_of_param(param))
        return list(modules.values())

    def uncovered(self, fallback: set[str]) -> set[str]:
        """Names feeding a reload module with a parameter this rank can rebuild neither from what
        the trainers send nor from its live value (then vLLM's loader takes the module)."""
        covered, bad = self._covered(fallback), set()
        for module in self.reload_modules(fallback):
            for attr, form in _module_forms(module).items():
                live = module._parameters.get(attr)
                if live is None or covered.get(id(live), 0) >= math.prod(form.shape) or _same_form(live, form):
                    continue
                bad |= {n for n, r in self.mine.items() if r[0] == "ok" and any(
                    m is module for m in self._modules_of_param(r[1]))}
        return bad

    def finish(self, layouts: dict[str, Layout], fallback: set[str], dtype: torch.dtype, model_config,
               engines: int) -> VllmBinding:
        """Destinations, per-name reports and the post-round processor."""
        modes = self._reload_params(fallback)
        buffers, by_live = _loader_buffers(self.reload_modules(fallback), self.probe, self.live)
        whole = lift(Layout(Mesh.from_ranks(list(range(self.where.size))), (Replicate(),)), engines, self.where.size)
        destinations, reports, modules_of = {}, [], {}
        for name, (_, shape) in self.checkpoint.items():
            if name in fallback:
                destinations[name] = Destination(torch.empty(shape, dtype=dtype), whole, tuple(shape), dtype, fallback=True)
                reports.append(ParamReport(name, None, "fallback", "vLLM's loader takes it (whole tensor)",
                                           math.prod(shape) * dtype.itemsize))
                continue
            merged = self.merged.get(name)
            view, mode, reason = None, "direct", "kept by other ranks of the engine"
            if merged is not None:
                mode, reason = modes[merged.param]
                live = self.live[merged.param]
                target = live.detach() if mode == "direct" else by_live[id(live)]
                view = torch.as_strided(target, merged.dst.sizes, merged.dst.strides, target.storage_offset() + merged.dst.offset)
                if mode == "reload":
                    modules_of[name] = self._modules_of_param(merged.param)
            param_dtype = dtype if merged is None else self.live[merged.param].dtype
            destinations[name] = Destination(view, lift(layouts[name], engines, self.where.size), tuple(shape), param_dtype)
            reports.append(ParamReport(name, merged and merged.param, mode, reason,
                                       0 if view is None else view.numel() * view.element_size()))
        processor = Processor(self.model, dtype, model_config, buffers, modules_of,
                              _fallback_modules(self, fallback), _attention_layers(self.model))
        return VllmBinding(destinations, reports, processor)


def _module_forms(module: torch.nn.Module) -> dict[str, ParamForm]:
    """The loader form of each parameter `module` loads (vLLM's recorded metadata)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params, _ = get_layerwise_info(module).restore_metadata
    return {attr: ParamForm(tuple(p.shape), tuple(p.stride()), p.dtype) for attr, p in params.items()}


def _attr_of(module: torch.nn.Module, param: torch.Tensor) -> str | None:
    return next((attr for attr, p in module._parameters.items() if p is param), None)


def _same_form(live: torch.Tensor, form: ParamForm) -> bool:
    return (tuple(live.shape), tuple(live.stride()), live.dtype) == (form.shape, form.stride, form.dtype)


def _loader_buffers(modules: Sequence[torch.nn.Module], probe: Probe, live: dict[str, torch.Tensor]):
    """A loader-form buffer per parameter of every reload module, one per live parameter (tied
    parameters share theirs): the live value where it still has that form, else zeros, then
    the loader's constant fills (vocabulary padding). Returns the buffers by module and
    parameter name, and by live parameter identity."""
    fills: dict[int, list] = {}
    for param, found in probe.fills.items():
        if param in live:
            fills.setdefault(id(live[param]), []).extend(found)
    by_live: dict[int, torch.Tensor] = {}
    out: dict[torch.nn.Module, dict[str, torch.Tensor]] = {}
    for module in modules:
        out[module] = {}
        for attr, form in _module_forms(module).items():
            param = module._parameters.get(attr)
            if param is None:
                continue
            if id(param) not in by_live:
                buffer = torch.empty_strided(form.shape, form.stride, dtype=form.dtype, device=param.device)
                if _same_form(param, form):
                    buffer.copy_(param.data)
                else:
                    buffer.zero_()
                for geometry, value in fills.get(id(param), []):
                    torch.as_strided(buffer, geometry.sizes, geometry.strides, geometry.offset).fill_(value)
                by_live[id(param)] = buffer
            out[module][attr] = by_live[id(param)]
    return out, by_live


def _fallback_modules(resolver: _Resolver, fallback: set[str]) -> list[torch.nn.Module]:
    modules: dict[int, torch.nn.Module] = {}
    for name in fallback:
        for g in resolver.gathered:
            for param in g[name][4]:
                modules.update((id(m), m) for m in resolver._modules_of_param(param))
    return list(modules.values())


def _attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return [m for m in model.modules() if is_deferred_attention_layer(m)]
