"""Deterministic tensors for distributed tests: every rank can rebuild any version."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from rl_sync.engine.sources import Destination, Sharded
from rl_sync.planning.layout import Layout

POISON = {torch.bool: True}


@dataclass(frozen=True)
class Recipe:
    """A tensor: name, dtype, global shape, trainer-side and worker-side layouts."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    src: Layout
    dst: Layout


def full_value(recipe: Recipe, version: int) -> torch.Tensor:
    """The whole tensor at `version` (a pure function of name and version)."""
    gen = torch.Generator().manual_seed(zlib.crc32(recipe.name.encode()) * 1009 + version)
    if recipe.dtype.is_floating_point:
        return torch.randn(recipe.shape, generator=gen).to(recipe.dtype)
    if recipe.dtype == torch.bool:
        return torch.randint(0, 2, recipe.shape, generator=gen).bool()
    return torch.randint(-1000, 1000, recipe.shape, generator=gen).to(recipe.dtype)


def _box_slices(box):
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def trainer_build(recipes):
    def build(rank: int, size: int):
        out = {}
        for r in recipes:
            box = r.src.local_box(r.shape, rank)
            if box is not None:
                out[r.name] = Sharded(full_value(r, 0)[_box_slices(box)].clone(), r.src, r.shape)
        return out

    return build


def worker_build(recipes):
    def build(rank: int, size: int):
        out = {}
        for r in recipes:
            box = r.dst.local_box(r.shape, rank)
            view = None
            if box is not None:
                view = (
                    torch.full(box.sizes, float("nan")).to(r.dtype)
                    if r.dtype.is_floating_point
                    else torch.full(box.sizes, -7, dtype=r.dtype)
                )
            out[r.name] = Destination(view, r.dst, r.shape, r.dtype)
        return out

    return build


def set_version(actor, recipes, version: int) -> None:
    """Run inside a trainer actor: overwrite its shards with `version`'s values, in place."""
    for r in recipes:
        box = r.src.local_box(r.shape, actor.rank)
        if box is not None:
            actor.held[r.name].local.copy_(full_value(r, version)[_box_slices(box)])


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (any dtype, fp8 included, pickles through Ray)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).clone()


def read_all(actor) -> dict:
    """Run inside a worker actor: the bytes of its live destination tensors."""
    return {name: as_bytes(d.local) for name, d in actor.held.items() if d.local is not None}


def expected(recipes, rank: int, version: int) -> dict:
    out = {}
    for r in recipes:
        box = r.dst.local_box(r.shape, rank)
        if box is not None:
            out[r.name] = full_value(r, version)[_box_slices(box)]
    return out
