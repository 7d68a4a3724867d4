"""Watch vLLM's own loader place every checkpoint tensor, on meta tensors.

For one rank of a running engine, `probe_loads` puts every layer back into
the form vLLM's weight loaders fill (the shapes recorded when the model was
built, before any post-load repacking, as meta tensors), feeds
`model.load_weights` one meta tensor per checkpoint name, and records every
`copy_` and `fill_` the loaders issue: which box of the checkpoint tensor
lands where in which parameter (`rl_sync.bind.infer.Piece`; a copy from a
transposed view of the checkpoint tensor lands in a transposed view of the
parameter, in the checkpoint's dims), and which elements are filled with a
constant (vocabulary padding). Nothing is
allocated and no live weight is touched; the live tensors are put back before
it returns. Names the loader refuses are reported with vLLM's own error.

Typical use (inside a vLLM worker, between generations)::

    probe = probe_loads(model, {"model.norm.weight": (torch.float32, (64,))}, dtype=torch.bfloat16)
    probe.pieces["model.norm.weight"]     # [Piece(param="model.norm.weight", src=Box(...), dst=Geometry(...))]
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..bind.infer import Geometry, Piece
from ..planning.layout import Box
from .indices import affine_blocks, index_tensor

_COPY = torch.ops.aten.copy_.default
_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)


def storage_key(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (meta tensors included, where data pointers are 0)."""
    return tensor.untyped_storage()._cdata


@dataclass(frozen=True)
class ParamForm:
    """A parameter as the loaders fill it: shape, strides and dtype before post-processing."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Probe:
    """What the loaders did, per checkpoint name and per parameter (qualified names)."""

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    fills: dict[str, list[tuple[Geometry, float]]] = field(default_factory=dict)
    forms: dict[str, ParamForm] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    """Names the loader raised on, with its message."""
    unresolved: dict[str, str] = field(default_factory=dict)
    """Names whose copies are not a box of the checkpoint tensor, with the reason (one of `REASONS`)."""

    NOT_A_PARAMETER: ClassVar[str] = "vLLM's loader copies it into a tensor that is not a parameter of the model"
    DERIVED: ClassVar[str] = (
        "vLLM's loader copies it from a tensor derived from the checkpoint's (cast, reshaped or copied)"
    )
    NOT_A_BOX: ClassVar[str] = "vLLM's loader copies a part of it that is no box of it into a parameter"
    REASONS: ClassVar[tuple[str, ...]] = (NOT_A_PARAMETER, DERIVED, NOT_A_BOX)


def attr_of(module: torch.nn.Module, param: torch.Tensor) -> str | None:
    """The name `module` registers `param` under (None when it holds no such parameter)."""
    return next((attr for attr, p in module._parameters.items() if p is param), None)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def _box_of(view: torch.Tensor, shape: tuple[int, ...]) -> tuple[Box, list[int]] | None:
    """The box of a contiguous tensor of `shape` that `view` (a view of it, its dims maybe
    permuted: GPT-2's Conv1D weights are copied from their transpose) covers, and which
    checkpoint dim each non-unit view dim is; `None` when the view is not such a box."""
    strides = contiguous_strides(shape)
    offset, coords = view.storage_offset(), []
    for s in strides:
        coords.append(offset // s if s else 0)
        offset = offset % s if s else offset
    dims: list[int] = []
    for size, stride in zip(view.shape, view.stride()):
        if size == 1:
            continue
        matches = [d for d in range(len(shape)) if strides[d] == stride and d not in dims and shape[d] > 1]
        if not matches:
            return None
        dims.append(matches[0])
    sizes = [1] * len(shape)
    for d, size in zip(dims, (s for s in view.shape if s != 1)):
        sizes[d] = size
    box = Box(tuple(coords), tuple(sizes))
    if any(o + s > n for o, s, n in zip(box.offsets, box.sizes, shape)):
        return None
    return box, dims


def _dst_geometry(dst: torch.Tensor, box: Box, dims: list[int]) -> Geometry | None:
    """`dst` (the copy's destination view) in the checkpoint box's dims."""
    non_unit = [(s, t) for s, t in zip(dst.shape, dst.stride()) if s != 1]
    if [s for s, _ in non_unit] != [box.sizes[d] for d in dims]:
        return None
    strides = [0] * box.ndim
    for d, (_, t) in zip(dims, non_unit):
        strides[d] = t
    return Geometry(int(dst.storage_offset()), box.sizes, tuple(strides))


def _fill_value(func, args) -> float:
    return float(args[1]) if func is not _FILLS[1] else 0.0


def _writes_first(func) -> bool:
    """Whether `func` writes into its first argument (an in-place op)."""
    arguments = func._schema.arguments
    return bool(arguments) and arguments[0].alias_info is not None and arguments[0].alias_info.is_write


class _Unattributed(RuntimeError):
    """A copy the probe cannot ascribe to a checkpoint name while all load in one call."""


class _Recorder(TorchDispatchMode):
    """Records the loaders' copies and fills, and what they do in place to a checkpoint tensor;
    nothing else is intercepted."""

    def __init__(self, sources: dict[int, tuple[str, tuple[int, ...]]], params: dict[int, str], probe: Probe):
        super().__init__()
        self.sources, self.params, self.probe = sources, params, probe
        self.current: str | None = ""
        """The checkpoint name being loaded; None while all load in one call (a copy that does not
        name its checkpoint tensor then raises `_Unattributed`)."""
        self.shape: tuple[int, ...] = ()
        """The current checkpoint tensor's shape, for copies from a tensor derived from it."""
        self.altered: dict[int, float | None] = {}
        """Checkpoint tensors (by storage) a loader changed in place: to a constant (gpt-oss zeroes
        `w2_bias` on TP ranks past the first), or otherwise (None)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Copies and fills into a parameter are recorded and not run: some parameters vLLM
        never moves to meta stay live (e.g. `e_score_correction_bias`) and must not change.
        Nor is a change in place to a checkpoint tensor, which its later copies then carry."""
        if func is _COPY and (storage_key(args[0]) in self.params or storage_key(args[1]) in self.sources):
            self._copy(args[0], args[1])
            return args[0]
        target = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _FILLS and target is not None and storage_key(target) in self.params:
            self._fill(self.params[storage_key(target)], target, _fill_value(func, args))
            return args[0]
        if target is not None and storage_key(target) in self.sources and _writes_first(func):
            whole = func in _FILLS and target.numel() == math.prod(self.sources[storage_key(target)][1])
            self.altered[storage_key(target)] = _fill_value(func, args) if whole else None
            return args[0]
        return func(*args, **(kwargs or {}))

    def _fill(self, param: str, dst: torch.Tensor, value: float) -> None:
        geometry = Geometry(int(dst.storage_offset()), tuple(dst.shape), tuple(dst.stride()))
        self.probe.fills.setdefault(param, []).append((geometry, value))

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        param = self.params.get(storage_key(dst))
        source = self.sources.get(storage_key(src))
        name = source[0] if source is not None else self.current
        if name is None:
            raise _Unattributed("a copy from a tensor derived from a checkpoint tensor, while all load at once")
        if param is None:
            self.probe.unresolved[name] = Probe.NOT_A_PARAMETER
            return
        if source is None:
            self._derived(name, param, dst, src)
            return
        if storage_key(src) in self.altered:
            value = self.altered[storage_key(src)]
            if value is None:
                self.probe.unresolved[name] = Probe.DERIVED
            else:
                self._fill(param, dst, value)
            return
        found = _box_of(src, source[1])
        geometry = None if found is None else _dst_geometry(dst, *found)
        if found is None or geometry is None:
            self.probe.unresolved[name] = Probe.NOT_A_BOX
            return
        self.probe.pieces.setdefault(name, []).append(Piece(param, found[0], geometry))

    def _derived(self, name: str, param: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A copy from a tensor derived from the checkpoint's: pieces where `src` holds element
        indices (`rl_sync.vllm.indices`) that form boxes, else `DERIVED`."""
        blocks = None if src.is_meta else affine_blocks(src)
        pieces = []
        for block in blocks or ():
            whole = torch.empty(math.prod(self.shape), device="meta")
            view = whole.as_strided(src[block.slices].shape, block.strides, block.offset)
            found = None if min(block.strides, default=0) < 0 else _box_of(view, self.shape)
            geometry = None if found is None else _dst_geometry(dst[block.slices], *found)
            if found is None or geometry is None:
                break
            pieces.append(Piece(param, found[0], geometry))
        if blocks is None or len(pieces) < len(blocks):
            self.probe.unresolved[name] = Probe.DERIVED
        else:
            self.probe.pieces.setdefault(name, []).extend(pieces)


_ONLINE_LOADER = "online_process_loader"
"""vLLM's wrapper of a weight loader under online processing (online quantization, layerwise
reload): it buffers loads until the layer is whole, then processes it, and ignores loads once
the layer was processed."""


def _unwrap_online_loaders(layer: torch.nn.Module) -> list[tuple[torch.Tensor, object]]:
    """Point the layer's tensors at the loaders their online-processing wrappers wrap (an online
    FP8 layer keeps them after loading), so the probe sees the loaders' copies; returns each
    tensor with the loader to put back."""
    out = []
    for tensor in list(layer._parameters.values()) + list(layer._buffers.values()):
        loader = getattr(tensor, "weight_loader", None)
        if tensor is None or getattr(loader, "__name__", None) != _ONLINE_LOADER:
            continue
        out.append((tensor, loader))
        while getattr(loader, "__name__", None) == _ONLINE_LOADER:
            loader = loader.__wrapped__  # type: ignore[union-attr]  # functools.wraps sets it
        tensor.weight_loader = loader  # type: ignore[attr-defined]  # (vLLM's, a property of its parameter classes)
    return out


@contextmanager
def model_form(model: torch.nn.Module) -> Iterator[dict[str, ParamForm]]:
    """Every layer in the form its loaders fill (vLLM's recorded metadata, on meta), live
    tensors put back on exit; yields each parameter's form by qualified name."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    saved, wrapped = [], []
    try:
        for _, layer in model.named_modules():
            saved.append((layer, dict(layer._parameters), dict(layer._buffers), set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            wrapped.extend(_unwrap_online_loaders(layer))
        yield {name: ParamForm(tuple(p.shape), tuple(p.stride()), p.dtype) for name, p in model.named_parameters()}
    finally:
        for tensor, loader in wrapped:
            tensor.weight_loader = loader  # type: ignore[attr-defined]
        for layer, params, buffers, non_persistent in saved:
            for name in list(layer._parameters) + list(layer._buffers):
                delattr(layer, name)
            for name, param in params.items():
                layer.register_parameter(name, param)
            for name, buffer in buffers.items():
                layer.register_buffer(name, buffer, persistent=name not in non_persistent)


def probe_loads(
    model: torch.nn.Module, checkpoint: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], dtype: torch.dtype
) -> Probe:
    """Run the model's loader on meta tensors of the checkpoint's shapes (in the engine's
    `dtype`, as the engine would load a checkpoint) and record where everything lands; a name
    the loader copies from a derived tensor is loaded again from its element indices (one real
    int64 tensor of its shape at a time) to find where those copies take their elements from."""
    probe = Probe()
    with model_form(model) as forms:
        probe.forms = forms
        params = {storage_key(p): name for name, p in model.named_parameters()}
        tensors = {
            name: torch.empty(tuple(shape), dtype=dtype, device="meta") for name, (_, shape) in checkpoint.items()
        }
        _load(model, tensors, params, probe)
        derived = [name for name, why in probe.unresolved.items() if why == Probe.DERIVED]
        for name in derived:
            again = Probe()
            _load(model, {name: index_tensor(checkpoint[name][1])}, params, again)
            if name not in again.unresolved and name not in again.errors:
                probe.pieces[name] = again.pieces[name]
                del probe.unresolved[name]
    return probe


def _load(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor], params: dict[int, str], probe: Probe) -> None:
    """Feed `tensors` to the model's loader, recording into `probe`: all in one call when every
    copy names its checkpoint tensor and the loader raises on none (one walk of the model, where
    a call per name walks it once per name), else one at a time, each error its name's."""
    if len(tensors) > 1:
        together = Probe()
        try:
            with _recorder(tensors, params, together) as recorder:
                recorder.current = None
                # vLLM's model method: torch types nn.Module.__getattr__ as Tensor | Module
                model.load_weights(list(tensors.items()))  # type: ignore[operator]
        except Exception:  # vLLM's loaders raise anything from KeyError to AssertionError; or _Unattributed
            pass
        else:
            for found in ("pieces", "fills", "unresolved"):
                getattr(probe, found).update(getattr(together, found))
            return
    with _recorder(tensors, params, probe) as recorder:
        for name, tensor in tensors.items():
            recorder.current, recorder.shape = name, tuple(tensor.shape)
            try:
                model.load_weights([(name, tensor)])  # type: ignore[operator]
            except Exception as exc:
                probe.errors[name] = f"{type(exc).__name__}: {exc}"


def _recorder(tensors: Mapping[str, torch.Tensor], params: dict[int, str], probe: Probe) -> _Recorder:
    return _Recorder({storage_key(t): (n, tuple(t.shape)) for n, t in tensors.items()}, params, probe)
