"""What trainers send from and workers receive into, as endpoints and reports.

Trainers hand rl-sync a mapping of checkpoint names to DTensors (their layout is
read off the tensor), `Sharded` local shards with an explicit layout, or plain
tensors (replicated on every trainer). Workers hand it `Destination`s: a view
of live storage holding this rank's box (a whole parameter, a fused slot of
one, a TP shard) and the layout over the worker ranks. Layouts are over each
side's own ranks `[0, n)`; the coordinator places workers after trainers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol, TypeGuard, cast

import torch

from ..planning.layout import Layout, Mesh
from ..storage import Destination, Sharded
from ..wire.dtypes import dtype_name
from ..wire.messages import TensorReport
from ..wire.plan_info import LayoutInfo
from .aliasing import check_disjoint
from .endpoint import Endpoint

__all__ = ["Destination", "Entries", "Sharded", "trainer_entries", "worker_entries"]


class Entries(NamedTuple):
    """One side's tensors on one rank: what it reports, and where it sends from or writes into."""

    reports: list[TensorReport]
    endpoints: dict[str, Endpoint]
    """By checkpoint name; a tensor of which the rank holds nothing has none."""


def _entry(
    name: str,
    local: torch.Tensor | None,
    dtype: torch.dtype,
    layout: Layout,
    shape: tuple[int, ...],
    rank: int,
    side: str,
    block: tuple[int, ...] = (),
):
    report = TensorReport(name, dtype_name(dtype), tuple(shape), LayoutInfo.of(layout), tuple(block))
    box = layout.local_box(shape, rank)
    if box is None:
        return report, None
    if local is None or tuple(local.shape) != box.sizes:
        raise ValueError(
            f"{side} rank {rank}: tensor {name!r} holds local shape "
            f"{None if local is None else tuple(local.shape)} but its layout "
            f"{layout} gives this rank the box {box} of global shape {shape}; the rank order passed to "
            "WeightSync must match the ranks the layout names"
        )
    if local.dtype != dtype:
        raise ValueError(f"{side} rank {rank}: tensor {name!r} storage is {local.dtype}, declared {dtype}")
    return report, Endpoint(local, box.offsets)


class _DTensorLike(Protocol):
    """What is read of a `DTensor`, recognised by its `_spec` (as `Layout.from_dtensor` reads it)."""

    @property
    def shape(self) -> torch.Size: ...

    def to_local(self) -> torch.Tensor: ...


def _is_dtensor(value: object) -> TypeGuard[_DTensorLike]:
    return hasattr(value, "_spec")


def local_tensor(value: object, name: str = "", rank: int = 0) -> torch.Tensor:
    """The local shard of a trainer's `DTensor`, `Sharded` or plain tensor."""
    if isinstance(value, Sharded):
        return value.local
    if _is_dtensor(value):
        return value.to_local()
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(
        f"trainer rank {rank}: tensor {name!r} is a {type(value).__name__}; expected a DTensor, "
        "a Sharded or a torch.Tensor"
    )


def _layout(value: object, num_trainers: int) -> Layout:
    if isinstance(value, Sharded):
        return value.layout
    return Layout.from_dtensor(value) if _is_dtensor(value) else Layout.replicated(Mesh((num_trainers,)))


def trainer_entries(tensors: Mapping[str, object], rank: int, num_trainers: int) -> Entries:
    """The entries of a trainer's tensors at side rank `rank`."""
    reports, endpoints = [], {}
    for name, value in tensors.items():
        local = local_tensor(value, name, rank)
        layout = _layout(value, num_trainers)
        shape = tuple(cast("Sharded | _DTensorLike | torch.Tensor", value).shape)  # local_tensor took it
        report, endpoint = _entry(name, local.detach(), local.dtype, layout, shape, rank, "trainer")
        reports.append(report)
        if endpoint is not None:
            endpoints[name] = endpoint
    return Entries(reports, endpoints)


def worker_entries(destinations: Mapping[str, Destination], rank: int) -> Entries:
    """The entries of a worker's destinations at side rank `rank`."""
    reports, endpoints = [], {}
    for name, dest in destinations.items():
        if not isinstance(dest, Destination):
            raise TypeError(
                f"worker rank {rank}: destination {name!r} is a {type(dest).__name__}; expected a Destination"
            )
        # detached: rounds write in place, which autograd refuses on a leaf that requires grad
        view = None if dest.local is None else dest.local.detach()
        report, endpoint = _entry(name, view, dest.dtype, dest.layout, tuple(dest.shape), rank, "worker", dest.block)
        reports.append(report)
        if endpoint is not None:
            endpoints[name] = endpoint
    check_disjoint({name: e.tensor for name, e in endpoints.items()}, rank)
    return Entries(reports, endpoints)
