"""Transports: Gloo (CPU), NCCL through CuPy (GPU); see `base.Transport`."""

from .base import Pending, Transport

__all__ = ["Pending", "Transport"]
