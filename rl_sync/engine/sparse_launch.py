"""A step's launches of the fused sparse codec, for its sender (`sparse_fused`) and its receivers
(`sparse_receiver`) alike: the rows of a step grouped into one launch per (key, density class),
carried inline or uploaded (`sparse_table.Upload`), which kernels each launch takes (`kernels_for`:
`sparse_cuda`'s where they are usable and the launch is on their path, else `sparse_triton`'s),
and the launches prepared once and run.

Typical use::

    up = Upload()
    found = launches(rows, up, on_cuda("compact", cuda))         # rows: (key, density class, programs, row)
    run("compact", found, up.send(device), words, starts, blocks, cuda=cuda)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import sparse_cuda, sparse_triton
from .sparse_table import Key, Upload, starts

Row = tuple[Key, "int | None", int, list[int]]
"""(key, density class or None (a kernel without the choice), programs, table row): one box of a
launch."""


@dataclass(frozen=True)
class Launch:
    """One kernel launch's rows and their program starts: `table[rows]` and `table[firsts]` of the
    uploaded `table` (slices), or host values its kernel carries inline (`sparse_cuda.Rows`)."""

    key: Key
    density: int | None
    rows: slice | list[int]
    firsts: slice | list[int]
    boxes: int
    total: int


def launches(rows: list[Row], up: Upload, inline: Callable[[Key, int | None], bool] = lambda *_: False) -> list[Launch]:
    """One launch per (key, density class) of `rows`, in that order: its table and starts carried
    inline where `inline(key, density class)` says its kernel takes them so and they fit
    (`sparse_cuda.fits_inline`), else added to `up`."""
    groups: dict[tuple[Key, int | None], tuple[list[int], list[list[int]]]] = {}
    for key, density_, count, row in rows:
        group = groups.get((key, density_))
        if group is None:
            group = groups[key, density_] = ([], [])
        group[0].append(count)
        group[1].append(row)
    out = []
    for key, density_ in sorted(groups, key=launch_order):
        programs, table = groups[key, density_]
        firsts = starts(programs)
        if inline(key, density_) and sparse_cuda.fits_inline(len(table), len(table[0])):
            out.append(Launch(key, density_, [*itertools.chain.from_iterable(table)], firsts, len(table), firsts[-1]))
        else:
            at = up.add_rows(table)
            out.append(Launch(key, density_, at, up.add(firsts), len(table), firsts[-1]))
    return out


def launch_order(launch: tuple[Key, int | None]) -> tuple[Key, bool, int]:
    """The order of launches `(key, density class or None)`: by key, then by density class, a
    launch without one (a receiver's `blocked_apply`) last."""
    key, density_ = launch
    return key, density_ is None, density_ or 0


def kernels_for(name: str, key: Key, density_: int | None, cuda: bool):
    """The module whose kernel `name` (`diff`, `compact` or `expand`) a launch of `key` and density
    class `density_` takes: with `cuda` (`sparse_cuda.usable`, asked once per sender or receiver),
    `sparse_cuda` for launches on the vectorized path (every `diff` and `compact`, busy `expand`s),
    else `sparse_triton`."""
    return sparse_cuda if cuda and key[1] and (name != "expand" or bool(density_)) else sparse_triton


def kernel(name: str, key: Key, density_: int | None, cuda: bool):
    """Kernel `name` for a launch of `key` and density class `density_` (`kernels_for`' choice)."""
    return getattr(kernels_for(name, key, density_, cuda), name)


Prepared = tuple[Callable[..., None], tuple, tuple]
"""A launch ready to run: (kernel, its arguments up to its key, its density class when it has
one): `kernel(*head, *args, *choice)`."""


def prepared(name: str, launches: list[Launch], dev: torch.Tensor | None, cuda: bool) -> list[Prepared]:
    """Each launch of kernel `name` with programs (`kernel`'s choice, with `cuda`), its table and
    starts sliced from the uploaded `dev` (or carried inline)."""
    return [
        (
            kernel(name, launch.key, launch.density, cuda),
            (part(dev, launch.rows), part(dev, launch.firsts), launch.boxes, launch.total, launch.key),
            () if launch.density is None else (launch.density,),
        )
        for launch in launches
        if launch.total
    ]


def part(dev: torch.Tensor | None, where: slice | list[int]) -> torch.Tensor | list[int]:
    """`where` of the uploaded `dev`, or the host values of a launch that carries them inline."""
    if isinstance(where, list):
        return where
    assert dev is not None  # (something was uploaded)
    return dev[where]


def on_cuda(name: str, cuda: bool) -> Callable[[Key, int | None], bool]:
    """Whether a launch of kernel `name`, key and density class takes `sparse_cuda`'s kernel (which
    can carry its rows inline), with `cuda` (`sparse_cuda.usable`)."""
    return lambda key, density_: kernels_for(name, key, density_, cuda) is sparse_cuda


def run(name: str, launches: list[Launch], dev: torch.Tensor | None, *args, cuda: bool) -> None:
    """Each launch of kernel `name` (`prepared`), with `args` after its key."""
    for kernel, head, choice in prepared(name, launches, dev, cuda):
        kernel(*head, *args, *choice)
