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

    def where(self) -> dict[str, int]:
        """The index of each name's report."""
        return {r.name: i for i, r in enumerate(self.reports)}

    def updated(
        self, again: Mapping[str, tuple[TensorReport, Endpoint | None]], what: str, where: Mapping[str, int]
    ) -> Entries:
        """These entries with the names of `again` resolved anew (`where`: `self.where()`);
        `ValueError` naming the first whose report differs from the one the group planned with
        (`what`: "worker rank 1")."""
        endpoints = dict(self.endpoints)
        for name, (report, endpoint) in again.items():
            planned = self.reports[where[name]]
            if report != planned:
                raise ValueError(
                    f"{what}: tensor {name!r} is now {_described(report)}; the group planned it as "
                    f"{_described(planned)}; repair() plans it anew (the next push does, with auto_repair)"
                )
            endpoints.pop(name, None)
            if endpoint is not None:
                endpoints[name] = endpoint
        return Entries(self.reports, endpoints)


def _described(report: TensorReport) -> str:
    block = f", blocks {report.block}" if report.block else ""
    return f"{report.dtype} of shape {report.shape} laid out {report.layout.to_layout()}{block}"


def _entry(
    name: str,
    local: torch.Tensor | None,
    dtype: torch.dtype,
    layout: Layout,
    shape: tuple[int, ...],
    rank: int,
    side: str,
    block: tuple[int, ...] = (),
) -> tuple[TensorReport, Endpoint | None]:
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

    _local_tensor: torch.Tensor


def _is_dtensor(value: object) -> TypeGuard[_DTensorLike]:
    return hasattr(value, "_spec")


def local_tensor(value: object, name: str = "", rank: int = 0) -> torch.Tensor:
    """The local shard of a trainer's `DTensor` (the one it holds, not a view: `to_local()` under
    autograd makes a new one each call), `Sharded` or plain tensor."""
    if isinstance(value, Sharded):
        return value.local
    if _is_dtensor(value):
        return value._local_tensor
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


def trainer_entry(
    name: str, value: object, local: torch.Tensor, rank: int, num_trainers: int
) -> tuple[TensorReport, Endpoint | None]:
    """(report, endpoint or None) of trainer tensor `name` (`value`, resolved to `local`)."""
    layout = _layout(value, num_trainers)
    shape = tuple(cast("Sharded | _DTensorLike | torch.Tensor", value).shape)  # local_tensor took it
    return _entry(name, alias(local), local.dtype, layout, shape, rank, "trainer")


def trainer_entries(tensors: Mapping[str, object], rank: int, num_trainers: int) -> Entries:
    """The entries of a trainer's tensors at side rank `rank`."""
    reports, endpoints = [], {}
    for name, value in tensors.items():
        report, endpoint = trainer_entry(name, value, local_tensor(value, name, rank), rank, num_trainers)
        reports.append(report)
        if endpoint is not None:
            endpoints[name] = endpoint
    return Entries(reports, endpoints)


def checked_destination(name: str, dest: object, rank: int) -> Destination:
    """`dest`, or a `TypeError` naming rank and tensor when it is no `Destination`."""
    if not isinstance(dest, Destination):
        raise TypeError(f"worker rank {rank}: destination {name!r} is a {type(dest).__name__}; expected a Destination")
    return dest


def worker_entry(
    name: str, dest: Destination, local: torch.Tensor | None, rank: int
) -> tuple[TensorReport, Endpoint | None]:
    """(report, endpoint or None) of destination `name` (`dest`, resolved to `local`)."""
    view = None if local is None else alias(local)
    return _entry(name, view, dest.dtype, dest.layout, tuple(dest.shape), rank, "worker", dest.block)


def worker_entries(destinations: Mapping[str, Destination], rank: int) -> Entries:
    """The entries of a worker's destinations at side rank `rank`."""
    reports, endpoints = [], {}
    for name, dest in destinations.items():
        report, endpoint = worker_entry(name, checked_destination(name, dest, rank), dest.local, rank)
        reports.append(report)
        if endpoint is not None:
            endpoints[name] = endpoint
    check_disjoint({name: e.tensor for name, e in endpoints.items()}, rank)
    return Entries(reports, endpoints)


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over `tensor`'s memory with a version counter of its own (`Tensor.data`): what a
    round reads and writes, so rl-sync's writes move no version `rl_sync.rank.watch` reads (and
    autograd, which refuses in-place writes to a leaf that requires grad, is not involved)."""
    return tensor.data
