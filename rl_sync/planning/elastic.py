"""Engines that join and leave a live group: the workers' layouts, grown and shrunk.

A group's workers are engine replicas, laid out along mesh axis 0 (`Replicate` there: each
replica holds the whole model, split among its own ranks) or wholly replicated. When an
engine of `n` ranks joins `N` workers, its ranks bind for `N + n` workers and report the
grown layouts; `check_grown` refuses them unless every existing worker keeps exactly the
boxes it holds (existing ranks keep their bindings). `engine_layout` is one replica's part
of a layout, over that replica's ranks in position order: a peer replica laid out so sends
the newcomer what it holds (catch-up by relay). When an engine leaves, `shrunk` is the layout
over the workers left, renumbered, with each keeping its boxes.

Typical use::

    check_grown("w", shape, old, new, old_size=4)               # ValueError if a worker's box moved
    peer, newcomer = engine_layout(new, [0, 1]), engine_layout(new, [4, 5])
    left = shrunk(old, removed={2, 3}, size=6)                   # over ranks 0..3, or None
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np

from .layout import Layout, Mesh, Replicate


def check_grown(name: str, shape: tuple[int, ...], old: Layout, new: Layout, old_size: int) -> None:
    """`ValueError` naming the tensor and worker unless `new` (over the grown workers) gives each
    of the `old_size` existing workers the box `old` gives it."""
    for rank in range(old_size):
        had, gets = old.local_box(shape, rank), new.local_box(shape, rank)
        if had != gets:
            raise ValueError(
                f"tensor {name!r}: the joining engine lays it out as {new}, which gives worker rank {rank} "
                f"the box {gets} where it keeps {had}; an engine joins a live group only when the others "
                "keep their boxes (replicas laid out along mesh axis 0, each binding for the grown count)"
            )


def _rows(layout: Layout) -> list[list[int]] | None:
    """The replicas of `layout` as rank rows in position order, or None when it does not lay
    replicas out along mesh axis 0."""
    mesh = layout.mesh
    if all(isinstance(p, Replicate) for p in layout.placements) and mesh.ndim == 1:
        return [[r] for r in mesh.ranks]
    if mesh.ndim < 2 or not isinstance(layout.placements[0], Replicate):
        return None
    return np.asarray(mesh.ranks).reshape(mesh.shape[0], -1).tolist()


def engine_layout(layout: Layout, ranks: Sequence[int]) -> Layout | None:
    """`layout`'s part on one replica's `ranks` (a mesh axis 0 row, or for a wholly replicated 1-D
    layout any ranks in it), over those ranks in the mesh's order; None when `layout` does not
    hold them so."""
    mesh, wanted = layout.mesh, set(ranks)
    if all(isinstance(p, Replicate) for p in layout.placements) and mesh.ndim == 1:
        return Layout.replicated(Mesh.from_ranks(list(ranks))) if wanted <= set(mesh.ranks) else None
    rows = _rows(layout)
    for row in rows or []:
        if set(row) == wanted:
            inner = np.asarray(row).reshape(mesh.shape[1:]).tolist()
            return Layout(Mesh.from_ranks(inner), layout.placements[1:])
    return None


def shrunk(layout: Layout, removed: Collection[int], size: int) -> Layout | None:
    """`layout` over the workers left when the ranks `removed` (one replica) leave `size` workers,
    renumbered to `[0, size - len(removed))` in order; None unless `removed` are whole replicas of
    it (mesh axis 0 rows, or ranks of a wholly replicated 1-D layout) and some stay."""
    rows, gone = _rows(layout), set(removed)
    if rows is None:
        return None
    kept = [row for row in rows if not gone & set(row)]
    if not kept or sum(len(row) for row in rows) - sum(len(row) for row in kept) != len(gone):
        return None
    renumber = {r: i for i, r in enumerate(r for r in range(size) if r not in gone)}
    if layout.mesh.ndim == 1:
        return Layout.replicated(Mesh.from_ranks([renumber[row[0]] for row in kept]))
    flat = [renumber[r] for row in kept for r in row]
    return Layout(Mesh((len(kept),) + layout.mesh.shape[1:], ranks=flat), layout.placements)
