"""Transports are found by name, each with its own rendezvous message; an unknown name lists the
known ones."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_sync.transport.base import Transport
from rl_sync.transport.local import LocalRendezvous
from rl_sync.transport.registry import TRANSPORTS, transport_class
from rl_sync.wire.codec import encode
from rl_sync.wire.messages import TRANSPORT_NAMES, check_transport

from .test_transport_messages import init_info


@pytest.mark.parametrize("name", sorted(TRANSPORTS))  # importing a module needs no CuPy: only joining NCCL does
def test_each_registered_transport_is_a_transport_with_its_own_frozen_message(name):
    cls = transport_class(name)
    assert issubclass(cls, Transport) and callable(cls.join)
    message = cls.rendezvous_type
    assert dataclasses.is_dataclass(message) and message.__dataclass_params__.frozen
    assert cls.__module__ == message.__module__ == TRANSPORTS[name][0], "a transport's message lives in its module"


def test_the_messages_are_distinct_types():
    """The envelope names the type, so one transport's message never decodes as another's."""
    assert len({transport_class(name).rendezvous_type.__name__ for name in TRANSPORTS}) == len(TRANSPORTS)


def test_a_one_rank_group_joins_the_local_transport():
    info = init_info("local", encode(LocalRendezvous()))
    joined = transport_class("local").join(
        info, LocalRendezvous(), bind_host="127.0.0.1", device=torch.device("cpu"), broadcast_ranks=[0]
    )
    assert (joined.rank, joined.world_size) == (0, 1)


@pytest.mark.parametrize("lookup", [transport_class, check_transport])
def test_an_unknown_transport_names_the_known_ones(lookup):
    with pytest.raises(ValueError, match=r"^unknown transport 'ucx'; known transports: cuda_ipc, gloo, local, nccl$"):
        lookup("ucx")


def test_the_registry_holds_every_name_the_wire_accepts_and_no_other():
    assert sorted(TRANSPORTS) == list(TRANSPORT_NAMES)
