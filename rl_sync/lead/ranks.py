"""Ranks for frameworks that hand rl-sync tensors per call instead of owning a model it reads.

`HeldSources`: a trainer rank whose tensors are set before each round (a
framework's weight generator, walked by the caller). `WholeCopies`: a worker
rank that keeps one whole copy of every checkpoint tensor, for a framework
that loads whole tensors into its engine itself (verl's server adapters);
the copies persist from round to round, so sparse rounds patch them.

Typical use::

    trainer = HeldSources()
    trainer.tensors = dict(weights)          # before each round
    worker = WholeCopies(workers=2)          # after a round: worker.copies[name]
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..planning.layout import Layout, Mesh
from ..rank import TrainerRank, WorkerRank
from ..storage import Destination


class HeldSources(TrainerRank):
    """A trainer rank sending `tensors` (DTensors keep their layout; whole tensors are taken as
    held by every trainer rank)."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def rl_sync_sources(self) -> dict[str, torch.Tensor]:
        return self.tensors


class WholeCopies(WorkerRank):
    """A worker rank, one of `workers`, keeping every tensor whole on `device` (default: the
    current CUDA device, else the CPU)."""

    def __init__(self, workers: int, device: torch.device | None = None):
        self.workers = workers
        self.copies: dict[str, torch.Tensor] = {}
        cuda = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        self.device = device or cuda or torch.device("cpu")

    def rl_sync_destinations(self, checkpoint: Mapping[str, tuple[torch.dtype, tuple[int, ...]]]) -> dict:
        layout = Layout.replicated(Mesh((self.workers,)))
        for name, (dtype, shape) in checkpoint.items():
            kept = self.copies.get(name)
            if kept is None or kept.dtype != dtype or tuple(kept.shape) != tuple(shape):
                self.copies[name] = torch.empty(shape, dtype=dtype, device=self.device)
        return {n: Destination(self.copies[n], layout, tuple(s), d) for n, (d, s) in checkpoint.items()}
