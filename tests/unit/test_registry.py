"""Transports are found by name; an unknown name lists the known ones."""

from __future__ import annotations

import pytest
import torch

from rl_sync.transport.base import Transport
from rl_sync.transport.registry import TRANSPORTS, transport_class


@pytest.mark.parametrize("name", ["gloo", "local"])  # nccl needs CuPy to import: tests/gpu joins it
def test_each_registered_transport_is_a_transport_that_joins(name):
    cls = transport_class(name)
    assert issubclass(cls, Transport) and callable(cls.join)


def test_a_one_rank_group_joins_the_local_transport():
    joined = transport_class("local").join(None, bind_host="127.0.0.1", device=torch.device("cpu"), broadcast_ranks=[0])
    assert (joined.rank, joined.world_size) == (0, 1)


def test_an_unknown_transport_names_the_known_ones():
    with pytest.raises(ValueError, match=r"^unknown transport 'ucx'; known transports: gloo, local, nccl$"):
        transport_class("ucx")
    assert set(TRANSPORTS) == {"gloo", "local", "nccl"}
