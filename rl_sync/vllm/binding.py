"""Bind the trainers' checkpoint to a running vLLM engine rank, read off vLLM's own loader.

For every checkpoint name, the probe (`rl_sync.vllm.probe`) shows which boxes
of it this rank's loader keeps and where they land; the ranks of the engine
exchange what they found (`EngineRank.exchange`, an all-gather over the
engine's ranks) and each decides the same tensors, layouts and fallbacks
(`rl_sync.vllm.entries`: whole tensors, or parts of a fused one). Then every
entry gets a `Destination`:

* **direct**: a strided view of the live parameter (q/k/v slots of
  `qkv_proj`, gate/up of `gate_up_proj`, experts of `w13_weight`, the real rows
  of a padded vocabulary shard, ...);
* **reload**: the same view of a buffer in the loader's form, processed by
  vLLM after each round (`rl_sync.vllm.reload`);
* **fallback**: the whole tensor, handed to vLLM's loader: when the loader's
  copies are no box, no layout gives the boxes, or a module's parameters
  cannot be rebuilt from what the trainers send; every name feeding a module
  with a fallback falls back too (vLLM's layerwise reload needs whole
  modules).

Typical use (what `rl_sync.vllm.rank.VllmDestinations` does)::

    binding = VllmBinding.build(model, model_config, checkpoint, EngineRank(rank, size, exchange), engines)
    binding.destinations["model.layers.0.self_attn.k_proj.weight"]   # a slot of qkv_proj
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..bind.infer import Merged
from ..planning.layout import Layout, Mesh, Replicate
from ..storage import Destination
from .entries import MODULE, UNCOVERED, UNMERGED, Entry, local_report, plan_entries
from .modes import Mode, param_mode
from .probe import ParamForm, Probe, contiguous_strides, probe_loads
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


class VllmBinding:
    """Destinations of one vLLM rank for a checkpoint, plus what runs after each round."""

    def __init__(self, destinations: dict[str, Destination], reports: list[ParamReport], processor: Processor):
        self.destinations, self.reports, self.processor = destinations, reports, processor

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.reports if r.mode == "fallback")

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        model_config,
        checkpoint: Checkpoint,
        where: EngineRank,
        engines: int = 1,
        sharded: Mapping[str, Sequence[int]] | None = None,
    ) -> VllmBinding:
        """Resolve every checkpoint name on this rank (collective over the engine's ranks).
        `sharded[name]`: dims no part may be cut along (`rl_sync.planning.parts.uncuttable_dims`)."""
        probe = probe_loads(model, checkpoint, model_config.dtype)
        if probe.errors:
            name, error = next(iter(probe.errors.items()))
            raise ValueError(
                f"vLLM rank {where.rank}: checkpoint tensor {name!r} is refused by vLLM's loader "
                f"({error}); the engine's model has no parameter for it"
            )
        gathered = where.exchange(local_report(probe, checkpoint))
        entries, fallback, unmerged = plan_entries(checkpoint, gathered, probe.pieces, sharded or {}, where.rank)
        resolver = _Resolver(model, probe, gathered, [e for e in entries if e.base not in fallback])
        local = dict.fromkeys(resolver.uncovered(), UNCOVERED) | dict.fromkeys(unmerged, UNMERGED)
        for found in where.exchange(sorted(local.items())):
            fallback = dict(found) | fallback
        fallback = resolver.close_modules(fallback)
        resolver.entries = [e for e in entries if e.base not in fallback]
        return resolver.finish(checkpoint, fallback, model_config, where, engines)


class _Resolver:
    """Modes, buffers and destinations of one rank's entries (see `VllmBinding.build`)."""

    def __init__(self, model, probe: Probe, gathered: list[dict], entries: list[Entry]):
        self.model, self.probe, self.gathered, self.entries = model, probe, gathered, entries
        self.live = _live_params(model)
        self.owners = _owners(model)

    def _modules_of_param(self, param: str) -> list[torch.nn.Module]:
        live = self.live.get(param)
        return [] if live is None else self.owners.get(id(live), [])

    def close_modules(self, fallback: dict[str, str]) -> dict[str, str]:
        """Every name feeding a module that a fallback name feeds falls back too (`MODULE`)."""
        params_of = {name: set().union(*(g[name][1] for g in self.gathered)) for name in self.gathered[0]}
        fallback = dict(fallback)
        while True:
            modules = {id(m) for name in fallback for p in params_of[name] for m in self._modules_of_param(p)}
            grown = {
                n
                for n, params in params_of.items()
                if any(id(m) in modules for p in params for m in self._modules_of_param(p))
            }
            if grown <= fallback.keys():
                return fallback
            fallback = dict.fromkeys(grown, MODULE) | fallback

    def _mine(self) -> list[tuple[Entry, Merged]]:
        """The entries this rank keeps a part of, each with its view."""
        return [(e, e.merged) for e in self.entries if e.merged is not None]

    def _modes(self) -> dict[str, tuple[Mode, str]]:
        """Mode of every parameter this rank's entries land in."""
        modes = {}
        for _, merged in self._mine():
            param = merged.param
            if param in modes:
                continue
            owners = self._modules_of_param(param)
            modes[param] = param_mode(owners, self.live[param], self.probe.forms[param])
            if modes[param][0] == "reload" and not any(
                _attr_of(m, self.live[param]) in _module_forms(m) for m in owners
            ):
                modes[param] = ("direct", "used as stored (vLLM's processing leaves it alone)")
        return modes

    def _covered(self) -> dict[int, int]:
        """Elements of each live parameter this rank's entries and the loader's fills cover."""
        covered: dict[int, int] = {}
        for _, merged in self._mine():
            key = id(self.live[merged.param])
            covered[key] = covered.get(key, 0) + merged.box.numel
        for param, fills in self.probe.fills.items():
            if param in self.live:
                key = id(self.live[param])
                covered[key] = covered.get(key, 0) + sum(math.prod(g.sizes) for g, _ in fills)
        return covered

    def reload_modules(self) -> list[torch.nn.Module]:
        modules: dict[int, torch.nn.Module] = {}
        for param, (mode, _) in self._modes().items():
            if mode == "reload":
                modules.update((id(m), m) for m in self._modules_of_param(param))
        return list(modules.values())

    def uncovered(self) -> set[str]:
        """Names feeding a reload module with a parameter this rank can rebuild neither from what
        the trainers send nor from its live value (then vLLM's loader takes the module)."""
        covered, bad = self._covered(), set()
        for module in self.reload_modules():
            for attr, form in _module_forms(module).items():
                live = module._parameters.get(attr)
                if live is None or covered.get(id(live), 0) >= math.prod(form.shape) or _same_form(live, form):
                    continue
                bad |= {
                    e.base
                    for e, merged in self._mine()
                    if any(m is module for m in self._modules_of_param(merged.param))
                }
        return bad

    def finish(
        self, checkpoint: Checkpoint, fallback: Mapping[str, str], model_config, where: EngineRank, engines: int
    ) -> VllmBinding:
        """Destinations, per-name reports and the post-round processor."""
        dtype = model_config.dtype
        modes = self._modes()
        buffers, by_live = _loader_buffers(self.reload_modules(), self.probe, self.live)
        destinations, reports, modules_of = {}, [], {}
        for entry in self.entries:
            view, reason, param_dtype = None, "kept by other ranks of the engine", dtype
            mode: Mode = "direct"
            if entry.merged is not None:
                param = entry.merged.param
                mode, reason = modes[param]
                live = self.live[param]
                target = live.detach() if mode == "direct" else by_live[id(live)]
                dst = entry.merged.dst
                view = torch.as_strided(target, dst.sizes, dst.strides, target.storage_offset() + dst.offset)
                param_dtype = target.dtype  # (reload: the loader form's, which may be narrower than the live one)
                if mode == "reload":
                    modules_of[entry.name] = self._modules_of_param(param)
            destinations[entry.name] = Destination(
                view, lift(entry.layout, engines, where.size), entry.shape, param_dtype
            )
            reports.append(
                ParamReport(
                    entry.name,
                    None if entry.merged is None else entry.merged.param,
                    mode,
                    reason,
                    0 if view is None else view.numel() * view.element_size(),
                )
            )
        whole = lift(Layout(Mesh.from_ranks(list(range(where.size))), (Replicate(),)), engines, where.size)
        for name in sorted(fallback):
            shape = tuple(checkpoint[name][1])
            destinations[name] = Destination(
                torch.empty(shape, dtype=dtype), whole, shape, dtype, fallback=True, reason=fallback[name]
            )
            reports.append(ParamReport(name, None, "fallback", fallback[name], math.prod(shape) * dtype.itemsize))
        processor = Processor(
            self.model,
            dtype,
            model_config,
            buffers,
            modules_of,
            _fallback_modules(self, fallback),
            _attention_layers(self.model),
        )
        return VllmBinding(destinations, reports, processor)


def _module_forms(module: torch.nn.Module) -> dict[str, ParamForm]:
    """The loader form of each parameter `module` loads: vLLM's recorded metadata, and a
    parameter that metadata leaves out (a linear layer's `bias`, made after its weights) whose
    dtype the module's processing changed: on a CPU with AMX, vLLM widens a bf16 linear bias to
    fp32 after loading, so its loader form is its shape in the dtype the module made it
    (`params_dtype`), and a round passes its values through that dtype as vLLM's loader does."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS, SKIP_TENSORS

    params, _ = get_layerwise_info(module).restore_metadata
    forms = {attr: ParamForm(tuple(p.shape), tuple(p.stride()), p.dtype) for attr, p in params.items()}
    made = getattr(module, "params_dtype", None)
    for attr in SKIP_TENSORS - SKIP_LOAD_TENSORS:  # (loaded, yet never put back on meta)
        live = module._parameters.get(attr)
        if live is not None and isinstance(made, torch.dtype) and live.is_floating_point() and live.dtype != made:
            forms[attr] = ParamForm(tuple(live.shape), contiguous_strides(tuple(live.shape)), made)
    return forms


def _attr_of(module: torch.nn.Module, param: torch.Tensor) -> str | None:
    return next((attr for attr, p in module._parameters.items() if p is param), None)


def _same_form(live: torch.Tensor, form: ParamForm) -> bool:
    return (tuple(live.shape), tuple(live.stride()), live.dtype) == (form.shape, form.stride, form.dtype)


def _loader_buffers(modules: Sequence[torch.nn.Module], probe: Probe, live: Mapping[str, torch.Tensor]):
    """A loader-form buffer per parameter of every reload module, one per live parameter (tied
    parameters share theirs): the live value where it still has that form, else zeros, then
    the loader's constant fills (vocabulary padding). Returns the buffers by module and
    parameter name, and by live parameter identity."""
    fills: dict[int, list] = {}
    for name, found in probe.fills.items():
        if name in live:
            fills.setdefault(id(live[name]), []).extend(found)
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


def _fallback_modules(resolver: _Resolver, fallback: Mapping[str, str]) -> list[torch.nn.Module]:
    modules: dict[int, torch.nn.Module] = {}
    for name in fallback:
        for g in resolver.gathered:
            for param in g[name][1]:
                modules.update((id(m), m) for m in resolver._modules_of_param(param))
    return list(modules.values())


def _attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    from vllm.model_executor.layers.attention import is_deferred_attention_layer

    return [m for m in model.modules() if is_deferred_attention_layer(m)]
