"""Transports: Gloo (CPU), NCCL through CuPy (GPU), `local` (one rank) and `cuda_ipc` (colocated
pairs); see `base.Transport`, and `registry` for joining one by name from its rendezvous message."""

from .base import Pending, Transport

__all__ = ["Pending", "Transport"]
