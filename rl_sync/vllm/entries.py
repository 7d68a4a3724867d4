"""From what every rank of an engine saw its loader do, to the tensors rl-sync plans.

Each rank reports, per checkpoint name (`local_report`): one merged box and
the parameter it lands in (`ok`), several pieces no single box covers
(`pieces`: e.g. the gate and up rows of a fused `gate_up_proj`), copies that
are no box at all (`unresolved`), or nothing (`none`). With every rank's
report, `plan_entries` (pure, the same on every rank) decides:

* a name every rank keeps as one box becomes one entry with the layout that
  gives those boxes;
* a name kept in pieces is cut into parts along a dim the trainers do not
  shard (`rl_sync.planning.parts`) where that leaves one box per rank and part;
* anything else falls back (vLLM's loader takes the whole tensor), with the
  reason (one of `REASONS`, so a summary can group names by it).

A name no rank's loader writes is an error: the engine's model lacks it.

Typical use::

    gathered = exchange(local_report(probe, checkpoint))
    entries, fallback, unmerged = plan_entries(checkpoint, gathered, probe.pieces, sharded, rank=0)
    fallback    # {name: reason}
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ..bind.infer import Merged, Piece, find_cuts, infer_layout, merge_pieces
from ..planning.layout import Box, Layout
from ..planning.parts import part_name, part_shape
from .probe import Probe

NO_LAYOUT = "no layout gives the boxes the engine's ranks keep of it"
NO_PARTS = "its pieces form one box per rank and part along no dim its senders' layout can be cut along"
UNMERGED = "a rank's pieces of it form no single strided view of one parameter"
UNCOVERED = (
    "a parameter of a module it feeds can be rebuilt neither from what the trainers send nor from its live value"
)
MODULE = "it feeds a module another fallback feeds (vLLM's layerwise reload takes whole modules)"
REASONS = (*Probe.REASONS, NO_LAYOUT, NO_PARTS, UNMERGED, UNCOVERED, MODULE)
"""Why a name falls back: every reason a binding gives."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the plan on this engine: a checkpoint name or a part of one."""

    name: str
    base: str
    shape: tuple[int, ...]
    layout: Layout
    """Over the engine's ranks `[0, size)`."""
    merged: Merged | None
    """This rank's box and its view of one parameter; None where the rank keeps none."""


def _inside(box: Box, dim: int, start: int, stop: int) -> bool:
    """Whether `box` lies within `[start, stop)` along `dim`."""
    return start <= box.offsets[dim] and box.ends[dim] <= stop


def _box(raw) -> Box:
    return Box(tuple(raw[0]), tuple(raw[1]))


def local_report(probe: Probe, checkpoint: Mapping) -> dict[str, tuple]:
    """Per name: `(status, parameters it touches, the merged box or the probe's reason, every
    piece's box)`, plain data for the exchange. Parts are cut from the pieces' boxes: a rank whose
    pieces happen to merge (Falcon's k and v rows after its half of the q rows) still says where
    they lie apart."""
    out: dict[str, tuple] = {}
    for name in checkpoint:
        pieces = probe.pieces.get(name, [])
        params = sorted({p.param for p in pieces})
        boxes = [(p.src.offsets, p.src.sizes) for p in pieces]
        merged = merge_pieces(pieces) if pieces else None
        if name in probe.unresolved:
            out[name] = ("unresolved", params, probe.unresolved[name], [])
        elif not pieces:
            out[name] = ("none", params, [], [])
        elif merged is not None:
            out[name] = ("ok", params, [(merged.box.offsets, merged.box.sizes)], boxes)
        else:
            out[name] = ("pieces", params, [], boxes)
    return out


def _shift(piece: Piece, dim: int, start: int) -> Piece:
    offsets = tuple(o - start if d == dim else o for d, o in enumerate(piece.src.offsets))
    return Piece(piece.param, Box(offsets, piece.src.sizes), piece.dst)


def _whole(name: str, shape: tuple[int, ...], reports: list, pieces: Sequence[Piece]) -> Entry | None:
    layout = infer_layout(shape, [_box(r[2][0]) if r[0] == "ok" else None for r in reports])
    return None if layout is None else Entry(name, name, shape, layout, merge_pieces(pieces) if pieces else None)


def _parts(
    name: str, shape: tuple[int, ...], reports: list, pieces: Sequence[Piece], forbidden: Collection[int]
) -> list[Entry] | None:
    """The entries of `name` cut into parts, or None; an entry whose local merge fails has
    `merged=None` while the rank holds pieces of it (`plan_entries` reports it)."""
    boxes = [[_box(raw) for raw in r[3]] for r in reports]
    found = find_cuts(shape, boxes, forbidden)
    if found is None:
        return None
    dim, cuts = found
    bounds = [0, *cuts, shape[dim]]
    entries = []
    for start, stop in itertools.pairwise(bounds):
        rank_boxes = [[_box(raw) for raw in r[3] if _inside(_box(raw), dim, start, stop)] for r in reports]
        sub_shape = part_shape(shape, dim, start, stop)
        per_rank = [None if not bs else _bound_in_part(bs, dim, start) for bs in rank_boxes]
        layout = infer_layout(sub_shape, per_rank)
        if layout is None:
            return None
        mine = [_shift(p, dim, start) for p in pieces if _inside(p.src, dim, start, stop)]
        entries.append(
            Entry(part_name(name, dim, start, stop), name, sub_shape, layout, merge_pieces(mine) if mine else None)
        )
    return entries


def _bound_in_part(boxes: Sequence[Box], dim: int, start: int) -> Box:
    lo = [min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim)]
    hi = [max(b.ends[d] for b in boxes) for d in range(boxes[0].ndim)]
    lo_shifted = [v - start if d == dim else v for d, v in enumerate(lo)]
    return Box(tuple(lo_shifted), tuple(h - v for h, v in zip(hi, lo)))


def _keeps(entry: Entry, rank: int) -> bool:
    box = entry.layout.local_box(entry.shape, rank)
    return box is not None and not box.is_empty()


def plan_entries(
    checkpoint: Mapping,
    gathered: Sequence[Mapping],
    pieces: Mapping[str, Sequence[Piece]],
    sharded: Mapping[str, Collection[int]],
    rank: int,
) -> tuple[list[Entry], dict[str, str], set[str]]:
    """(entries, names that fall back with their reasons, names whose pieces this rank could not
    merge into the part everyone else expects); raises for a name no rank's loader writes.
    `sharded[name]`: dims never cut (`rl_sync.planning.parts.uncuttable_dims`)."""
    entries: list[Entry] = []
    fallback: dict[str, str] = {}
    unmerged = set()
    for name, (_, shape) in checkpoint.items():
        shape = tuple(shape)
        reports = [g[name] for g in gathered]
        statuses = {r[0] for r in reports}
        if statuses == {"none"}:
            raise ValueError(
                f"vLLM rank {rank}: checkpoint tensor {name!r} {shape} is written nowhere by vLLM's loader "
                f"on any of the engine's {len(gathered)} ranks; the engine's model has no parameter for it"
            )
        mine = list(pieces.get(name, []))
        if "unresolved" in statuses:
            fallback[name] = next(r[2] for r in reports if r[0] == "unresolved")
            continue
        if "pieces" in statuses:
            found, reason = _parts(name, shape, reports, mine, sharded.get(name, ())), NO_PARTS
        else:
            whole = _whole(name, shape, reports, mine)
            found, reason = None if whole is None else [whole], NO_LAYOUT
        if not found:
            fallback[name] = reason
            continue
        if any(e.merged is None and _keeps(e, rank) for e in found):
            unmerged.add(name)
        entries.extend(found)
    return entries, fallback, unmerged
