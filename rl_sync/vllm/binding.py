"""Bind the trainers' checkpoint to a running vLLM engine rank, read off vLLM's own loader.

For every checkpoint name, the probe (`rl_sync.vllm.probe`) shows which boxes
of it this rank's loader keeps and where they land; the ranks of the engine
exchange what they found (`EngineRank.exchange`, an all-gather over the
engine's ranks) and each decides the same tensors, layouts and fallbacks
(`rl_sync.vllm.entries`: whole tensors, or parts of a fused one). Then every
entry gets a `Destination`:

* **direct**: a strided view of the live parameter (q/k/v slots of
  `qkv_proj`, gate/up of `gate_up_proj`, experts of `w13_weight`, the real rows
  of a padded vocabulary shard, ...), with the `Slot` of its module's
  `_parameters`: a parameter the engine replaces there is followed each round
  without binding again (`rl_sync.rank.watch`);
* **reload**: the same view of a buffer in the loader's form, processed by
  vLLM after each round (`rl_sync.vllm.reload`); a block-FP8 layer's weight
  is an FP8 destination with the layer's block, and its blocks of
  `weight_scale_inv` a second one (`rl_sync.vllm.fp8`);
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
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..bind.infer import Geometry, Merged
from ..planning.layout import Layout, Mesh, Replicate
from ..planning.quant import dest_scale_layout, grid_shape, scale_name
from ..storage import Destination, Slot
from . import compat, fp8
from .entries import MODULE, UNCOVERED, UNMERGED, Entry, local_report, plan_entries
from .modes import Mode, param_mode
from .probe import ParamForm, Probe, attr_of, contiguous_strides, probe_loads
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
        seeded: bool = True,
    ) -> VllmBinding:
        """Resolve every checkpoint name on this rank (collective over the engine's ranks).
        `sharded[name]`: dims no part may be cut along (`rl_sync.planning.parts.uncuttable_dims`).
        `seeded=False`: the next round writes every bound element, so a loader-form buffer the
        entries and fills cover whole is left as allocated (see `_loader_buffers`)."""
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
        return resolver.finish(checkpoint, fallback, model_config, where, engines, seeded)


class _Resolver:
    """Modes, buffers and destinations of one rank's entries (see `VllmBinding.build`)."""

    def __init__(self, model, probe: Probe, gathered: list[dict], entries: list[Entry]):
        self.model, self.probe, self.gathered, self.entries = model, probe, gathered, entries
        self.live = _live_params(model)
        self.owners = _owners(model)
        self.attention = _attention_layers(model)
        self.readers = _impl_readers(self.attention)

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
                attr_of(m, self.live[param]) in _module_forms(m) for m in owners
            ):
                modes[param] = ("direct", "used as stored (vLLM's processing leaves it alone)")
        return modes

    def _covered(self) -> dict[int, int]:
        """Elements of each live parameter this rank's entries (block-FP8 scales included) and
        the loader's fills cover."""
        covered: dict[int, int] = {}
        for _, merged in self._mine():
            key = id(self.live[merged.param])
            covered[key] = covered.get(key, 0) + merged.box.numel
            block = self._block(merged.param)
            if block is not None:
                key = id(fp8.scale_param(self._modules_of_param(merged.param)))
                covered[key] = covered.get(key, 0) + fp8.scale_elements(merged.box, block)
        for param, fills in self.probe.fills.items():
            if param in self.live:
                key = id(self.live[param])
                covered[key] = covered.get(key, 0) + sum(math.prod(g.sizes) for g, _ in fills)
        return covered

    def _coverage(self) -> Iterator[tuple[torch.nn.Module, torch.Tensor, ParamForm, bool]]:
        """Each parameter of each reload module: the module, the live parameter, its loader form,
        and whether this rank's entries and the loader's fills cover that form whole."""
        covered = self._covered()
        for module in self.reload_modules():
            for attr, form in _module_forms(module).items():
                live = module._parameters.get(attr)
                if live is not None:
                    yield module, live, form, covered.get(id(live), 0) >= math.prod(form.shape)

    def _covered_whole(self) -> set[int]:
        """The live parameters (by identity) whose loader form this rank covers whole."""
        return {id(live) for _, live, _, whole in self._coverage() if whole}

    def _param_of(self, entry: Entry) -> str:
        """The parameter an entry lands in (named by any rank that keeps a part of it)."""
        if entry.merged is not None:
            return entry.merged.param
        return next(p for g in self.gathered for p in g[entry.base][1])

    def _block(self, param: str) -> tuple[int, int] | None:
        """The block `param` is kept FP8-quantized in (`rl_sync.vllm.fp8`), or None."""
        try:
            return fp8.block_of(self._modules_of_param(param), self.live[param], self.probe.forms[param])
        except ValueError as exc:
            raise ValueError(f"vLLM parameter {param!r}: {exc}") from None

    def reload_modules(self) -> list[torch.nn.Module]:
        modules: dict[int, torch.nn.Module] = {}
        for param, (mode, _) in self._modes().items():
            if mode == "reload":
                modules.update((id(m), m) for m in self._modules_of_param(param))
        return list(modules.values())

    def uncovered(self) -> set[str]:
        """Names feeding a reload module with a parameter this rank can rebuild neither from what
        the trainers send nor from its live value (then vLLM's loader takes the module)."""
        bad: set[str] = set()
        for module, live, form, whole in self._coverage():
            if whole or _same_form(live, form):
                continue
            bad.update(e.base for e, merged in self._mine() if module in self._modules_of_param(merged.param))
        return bad

    def _slot(self, param: str) -> Slot:
        """Where the engine keeps live parameter `param`: its module's `_parameters` (a direct
        destination is cut again from a parameter the engine puts there in its place)."""
        module, _, attr = param.rpartition(".")
        return Slot(self.model.get_submodule(module)._parameters, attr)

    def finish(
        self,
        checkpoint: Checkpoint,
        fallback: Mapping[str, str],
        model_config,
        where: EngineRank,
        engines: int,
        seeded: bool = True,
    ) -> VllmBinding:
        """Destinations, per-name reports and the post-round processor (`seeded`: see `build`)."""
        modes = self._modes()
        unseeded = set() if seeded else self._covered_whole()
        buffers, by_live = _loader_buffers(self.reload_modules(), self.probe, self.live, unseeded)
        built = _Built(model_config.dtype, where, engines)
        for entry in self.entries:
            self._add(built, entry, modes, by_live)
        device = next(iter(self.live.values())).device if self.live else torch.device("cpu")
        for name in sorted(fallback):
            built.fallback(name, tuple(checkpoint[name][1]), device, fallback[name])
        processor = Processor(
            self.model,
            model_config.dtype,
            model_config,
            buffers,
            built.modules_of,
            _fallback_modules(self, fallback),
            self.attention,
            built.owners,
        )
        return VllmBinding(built.destinations, built.reports, processor)

    def _add(self, built: _Built, entry: Entry, modes: Mapping, by_live: Mapping[int, torch.Tensor]) -> None:
        """One entry's destination (and its block scales' for a block-FP8 weight)."""
        param = self._param_of(entry)
        block = self._block(param)
        layout = lift(entry.layout, built.engines, built.where.size)
        view, target, reason = None, None, "kept by other ranks of the engine"
        mode: Mode = "direct"
        slot = None
        if entry.merged is not None:
            mode, reason = modes[param]
            live = self.live[param]
            built.owners[entry.name] = self._modules_of_param(param) + self.readers.get(_storage(live), [])
            target = live.detach() if mode == "direct" else by_live[id(live)]
            view = _view(target, entry.merged.dst)
            if mode == "reload":
                built.modules_of[entry.name] = self._modules_of_param(param)
            else:
                slot = self._slot(param)
        # (reload: the loader form's dtype, which may be narrower than the live one)
        dtype = fp8.FP8 if block else built.dtype if target is None else target.dtype
        destination = Destination(view, layout, entry.shape, dtype, block=block or (), slot=slot)
        built.add(entry.name, destination, param, mode, reason)
        if block is not None:
            scales = self._scales(entry, param, layout, block, mode, by_live, built.where)
            built.add(scale_name(entry.name), scales, param + "::" + fp8.SCALE_ATTR, mode, reason)

    def _scales(
        self,
        entry: Entry,
        param: str,
        layout: Layout,
        block: tuple[int, int],
        mode: Mode,
        by_live: Mapping[int, torch.Tensor],
        where: EngineRank,
    ) -> Destination:
        """The destination of a block-FP8 weight's scales: its blocks of `weight_scale_inv`."""
        what = f"vLLM rank {where.rank}: {entry.name!r}"
        grid, scale_layout = grid_shape(entry.shape, block, what), dest_scale_layout(layout, entry.shape, block, what)
        view, slot = None, None
        if entry.merged is not None:
            live = fp8.scale_param(self._modules_of_param(param))
            buffer = live.detach() if mode == "direct" else by_live[id(live)]
            box = scale_layout.local_box(grid, where.rank)  # (the engines' layouts agree: engine 0's rank)
            assert box is not None, "a rank keeping a box of the weight keeps its blocks' scales"
            view = fp8.scale_view(entry.merged.dst, self.probe.forms[param], buffer, box, block, what)
            slot = self._slot(param.rpartition(".")[0] + "." + fp8.SCALE_ATTR) if mode == "direct" else None
        return Destination(view, scale_layout, grid, torch.float32, slot=slot)


class _Built:
    """What `_Resolver.finish` builds: destinations, per-name reports, reload modules by name."""

    def __init__(self, dtype: torch.dtype, where: EngineRank, engines: int):
        self.dtype, self.where, self.engines = dtype, where, engines
        self.destinations: dict[str, Destination] = {}
        self.reports: list[ParamReport] = []
        self.modules_of: dict[str, list[torch.nn.Module]] = {}
        self.owners: dict[str, list[torch.nn.Module]] = {}

    def add(self, name: str, destination: Destination, param: str, mode: Mode, reason: str) -> None:
        view = destination.local
        self.destinations[name] = destination
        nbytes = 0 if view is None else view.numel() * view.element_size()
        self.reports.append(ParamReport(name, None if view is None else param, mode, reason, nbytes))

    def fallback(self, name: str, shape: tuple[int, ...], device: torch.device, reason: str) -> None:
        """A whole tensor for vLLM's loader, on the engine's device; `reason`: why it falls back."""
        size = self.where.size
        whole = lift(Layout(Mesh.from_ranks(list(range(size))), (Replicate(),)), self.engines, size)
        buffer = torch.empty(shape, dtype=self.dtype, device=device)
        self.destinations[name] = Destination(buffer, whole, shape, self.dtype, fallback=True, reason=reason)
        self.reports.append(ParamReport(name, None, "fallback", reason, buffer.numel() * self.dtype.itemsize))


def _view(target: torch.Tensor, dst: Geometry) -> torch.Tensor:
    return torch.as_strided(target, dst.sizes, dst.strides, target.storage_offset() + dst.offset)


def _module_forms(module: torch.nn.Module) -> dict[str, ParamForm]:
    """The loader form of each parameter `module` loads: vLLM's recorded metadata, and a
    parameter that metadata leaves out (a linear layer's `bias`, made after its weights) whose
    dtype the module's processing changed: on a CPU with AMX, vLLM widens a bf16 linear bias to
    fp32 after loading, so its loader form is its shape in the dtype the module made it
    (`params_dtype`), and a round passes its values through that dtype as vLLM's loader does."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    params, _ = get_layerwise_info(module).restore_metadata
    forms = {attr: ParamForm(tuple(p.shape), tuple(p.stride()), p.dtype) for attr, p in params.items()}
    made = getattr(module, "params_dtype", None)
    for attr in compat.loaded_never_on_meta():
        live = module._parameters.get(attr)
        if live is not None and isinstance(made, torch.dtype) and live.is_floating_point() and live.dtype != made:
            forms[attr] = ParamForm(tuple(live.shape), contiguous_strides(tuple(live.shape)), made)
    return forms


def _same_form(live: torch.Tensor, form: ParamForm) -> bool:
    return (tuple(live.shape), tuple(live.stride()), live.dtype) == (form.shape, form.stride, form.dtype)


def _loader_buffers(
    modules: Sequence[torch.nn.Module],
    probe: Probe,
    live: Mapping[str, torch.Tensor],
    unseeded: Collection[int] = (),
):
    """A loader-form buffer per parameter of every reload module, one per live parameter (tied
    parameters share theirs): the live value where it still has that form, else zeros (neither
    for a live parameter in `unseeded`, whose every element the next round writes), then the
    loader's constant fills (vocabulary padding). Returns the buffers by module and parameter
    name, and by live parameter identity."""
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
                if id(param) not in unseeded:
                    buffer.copy_(param.data) if _same_form(param, form) else buffer.zero_()
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
    return [m for m in model.modules() if compat.deferred_attention(m)]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _impl_readers(attention: Sequence[torch.nn.Module]) -> dict[int, list[torch.nn.Module]]:
    """Storage -> the `attention` layers whose kernel implementation (`layer.impl`) holds a tensor
    in it: a parameter of another module it derives state from when processed (GPT-OSS's
    attention sinks, kept by the enclosing block, made float32 by FlashInfer's implementation)."""
    out: dict[int, list[torch.nn.Module]] = {}
    for layer in attention:
        held = getattr(getattr(layer, "impl", None), "__dict__", {}).values()
        for storage in {_storage(t) for t in held if isinstance(t, torch.Tensor)} - {0}:
            out.setdefault(storage, []).append(layer)
    return out
