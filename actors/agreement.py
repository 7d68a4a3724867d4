"""Init-time checks on what ranks report: workers agree, trainers are consistent."""

from __future__ import annotations

from collections.abc import Sequence

from rl_sync.planning.parts import check_parts, parse_part, part_layout, part_name, part_shape
from rl_sync.planning.plan import SideSpec
from rl_sync.wire.messages import RankReport, TensorReport


def _describe(t: TensorReport) -> str:
    return f"dtype {t.dtype}, shape {t.shape}, layout {t.layout.to_layout()}"


def check_agreement(workers: Sequence[RankReport], ranks: Sequence[int]) -> None:
    """Every worker must resolve the same (name, dtype, shape, layout) list as worker 0.

    Raises `ValueError` naming the first worker and tensor that differ.
    """
    first = workers[0].tensors
    by_name = {t.name: t for t in first}
    for report in workers[1:]:
        mine = {t.name: t for t in report.tensors}
        rank = ranks[report.rank]
        for name in list(by_name) + [n for n in mine if n not in by_name]:
            a, b = by_name.get(name), mine.get(name)
            if a != b:
                theirs = "does not bind it" if b is None else f"resolved {_describe(b)}"
                ours = "does not bind it" if a is None else f"resolved {_describe(a)}"
                raise ValueError(
                    f"inference workers disagree on tensor {name!r}: worker rank {rank} {theirs}, but worker rank "
                    f"{ranks[0]} {ours}; all workers must run the same model and parallel config"
                )


def merge_sources(trainers: Sequence[RankReport]) -> list[SideSpec]:
    """Union of the trainers' tensors in first-seen order; conflicting reports are refused."""
    seen: dict[str, tuple[TensorReport, int]] = {}
    for report in trainers:
        for t in report.tensors:
            if max(t.layout.ranks) >= len(trainers):
                raise ValueError(
                    f"trainer rank {report.rank}: tensor {t.name!r} is laid out over ranks "
                    f"{list(t.layout.ranks)[:8]}, past the {len(trainers)} trainers passed to WeightSync"
                )
            if t.name in seen and seen[t.name][0] != t:
                first, rank = seen[t.name]
                raise ValueError(
                    f"trainers disagree on tensor {t.name!r}: rank {report.rank} reports {_describe(t)}, rank {rank} "
                    f"reports {_describe(first)}"
                )
            seen.setdefault(t.name, (t, report.rank))
    return [SideSpec(t.name, t.dtype, t.shape, t.layout.to_layout()) for t, _ in seen.values()]


def colocated_mates(trainers: Sequence[RankReport], workers: Sequence[RankReport]) -> list[int] | None:
    """The trainer rank sharing each worker's GPU, or None unless every worker has exactly one
    and no trainer has two."""
    if not workers or not all(w.gpu for w in workers):
        return None
    by_gpu: dict[str, list[int]] = {}
    for t in trainers:
        if t.gpu:
            by_gpu.setdefault(t.gpu, []).append(t.rank)
    mates = [by_gpu.get(w.gpu, []) for w in workers]
    if any(len(m) != 1 for m in mates):
        return None
    ranks = [m[0] for m in mates]
    return ranks if len(set(ranks)) == len(ranks) else None


def split_sources(sources: Sequence[SideSpec], worker_names: Sequence[str]) -> list[SideSpec]:
    """Sources with every tensor the workers bind in parts (`rl_sync.planning.parts`) replaced by those
    parts, each with the trainers' layout of the whole cut to it (`part_layout`); refused when the
    parts do not tile the tensor or cut a dim the trainers' layout cannot be cut along."""
    parts: dict[str, list[tuple[int, int, int]]] = {}
    for name in worker_names:
        found = parse_part(name)
        if found is not None:
            parts.setdefault(found[0], []).append(found[1:])
    out = []
    for spec in sources:
        if spec.name not in parts:
            out.append(spec)
            continue
        check_parts(spec.name, spec.shape, spec.layout, parts[spec.name])
        for dim, start, stop in sorted(parts[spec.name], key=lambda p: p[1]):
            out.append(
                SideSpec(
                    part_name(spec.name, dim, start, stop),
                    spec.dtype,
                    part_shape(spec.shape, dim, start, stop),
                    part_layout(spec.layout, spec.shape, dim, start, stop),
                )
            )
    return out
