"""Each transport's rendezvous message: strict round trips, and joining selects the message type by name."""

from __future__ import annotations

import re

import msgpack
import pytest
import torch

from rl_sync.transport.cuda_ipc import IpcExport, IpcRegion, IpcRendezvous, IpcTensor
from rl_sync.transport.gloo import GlooRendezvous
from rl_sync.transport.local import LocalRendezvous
from rl_sync.transport.nccl import NcclRendezvous
from rl_sync.transport.registry import join
from rl_sync.wire.codec import decode, encode
from rl_sync.wire.messages import InitInfo

EXPORT = IpcExport(
    "GPU-0",
    (IpcRegion("legacy", 1024, handle=b"\x01" * 64),),
    (IpcTensor("w", 0, 0, (4, 2), (2, 1), "bfloat16"),),
    b"r" * 64,
    b"d" * 64,
    "/tmp/rl-sync-fds-x/s",
    b"t" * 32,
)
GLOO = GlooRendezvous("127.0.0.1", 29500)
NCCL = NcclRendezvous(tuple(range(128)), tuple(255 - x for x in range(128)))
MESSAGES = [GLOO, NCCL, LocalRendezvous(), IpcRendezvous(EXPORT, "nccl", encode(NCCL))]
KNOWN = "cuda_ipc, gloo, local, nccl"


def init_info(transport: str, rendezvous: bytes, world_size: int = 1) -> InitInfo:
    """A rank's `InitInfo` for a one-trainer group joining `transport`."""
    return InitInfo(
        rank=0,
        world_size=world_size,
        num_trainers=1,
        worker_ranks=(0,),
        transport=transport,
        rendezvous=rendezvous,
        prefix="p",
        timeout_s=5.0,
        join_timeout_s=4.0,
        sparse_baseline="device",
        integrity="off",
        interface="",
        secret=b"s" * 32,
    )


def _with_body(message, **changes) -> bytes:
    """`message` encoded, its body's fields changed (`None` drops one)."""
    envelope = msgpack.unpackb(encode(message), raw=False)
    body = dict(envelope["body"], **changes)
    envelope["body"] = {k: v for k, v in body.items() if v is not None}
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message):
    assert decode(type(message), encode(message)) == message


@pytest.mark.parametrize(
    "cls, body, error",
    [
        (GlooRendezvous, {"store_port": None}, "GlooRendezvous: missing fields ['store_port'], unexpected fields []"),
        (
            GlooRendezvous,
            {"store_port": None, "port": 1},
            "GlooRendezvous: missing fields ['store_port'], unexpected fields ['port']",
        ),
        (GlooRendezvous, {"store_port": "29500"}, "GlooRendezvous.store_port: expected int, got str"),
        (
            GlooRendezvous,
            {"store_port": 0},
            "GlooRendezvous: GlooRendezvous.store_port must be a port in [1, 65535], got 0",
        ),
        (
            GlooRendezvous,
            {"store_host": ""},
            "GlooRendezvous: GlooRendezvous.store_host must name the store's address, got ''",
        ),
        (
            NcclRendezvous,
            {"broadcast_id": None},
            "NcclRendezvous: missing fields ['broadcast_id'], unexpected fields []",
        ),
        (
            NcclRendezvous,
            {"unique_id": [1, 2]},
            "NcclRendezvous: NcclRendezvous.unique_id must be 128 ints in [0, 256) (new_unique_id), got 2 ints",
        ),
        (
            NcclRendezvous,
            {"unique_id": [256] * 128},
            "NcclRendezvous: NcclRendezvous.unique_id must be 128 ints in [0, 256) (new_unique_id), got 128 ints",
        ),
        (NcclRendezvous, {"unique_id": ["x"] * 128}, "NcclRendezvous.unique_id[0]: expected int, got str"),
        (LocalRendezvous, {"extra": 1}, "LocalRendezvous: missing fields [], unexpected fields ['extra']"),
        (IpcRendezvous, {"group": None}, "IpcRendezvous: missing fields ['group'], unexpected fields []"),
        (IpcRendezvous, {"group": "ucx"}, f"IpcRendezvous: unknown transport 'ucx'; known transports: {KNOWN}"),
        (
            IpcRendezvous,
            {"group": "cuda_ipc"},
            "IpcRendezvous: IpcRendezvous.group must name the trainers' own transport, not 'cuda_ipc'",
        ),
        (IpcRendezvous, {"group_rendezvous": "bytes"}, "IpcRendezvous.group_rendezvous: expected bytes, got str"),
    ],
)
def test_a_missing_extra_or_ill_typed_field_is_refused_by_name(cls, body, error):
    sample = next(m for m in MESSAGES if type(m) is cls)
    with pytest.raises(ValueError, match=f"^{re.escape(error)}$"):
        decode(cls, _with_body(sample, **body))


def test_a_nested_export_field_is_checked_too():
    body = msgpack.unpackb(encode(MESSAGES[-1]), raw=False)["body"]
    del body["export"]["ready_event"]
    with pytest.raises(
        ValueError, match=re.escape("IpcRendezvous.export: missing fields ['ready_event'], unexpected fields []")
    ):
        decode(IpcRendezvous, _with_body(MESSAGES[-1], export=body["export"]))


def test_init_info_names_a_registered_transport():
    with pytest.raises(ValueError, match=f"^InitInfo: unknown transport 'ucx'; known transports: {KNOWN}$"):
        decode(InitInfo, _with_body(init_info("local", encode(LocalRendezvous())), transport="ucx"))


def test_joining_decodes_the_message_the_name_selects():
    info = init_info("local", encode(LocalRendezvous()))
    joined = join(
        info.transport, info.rendezvous, info, bind_host="127.0.0.1", device=torch.device("cpu"), broadcast_ranks=[0]
    )
    assert (joined.rank, joined.world_size, dict(joined.destinations())) == (0, 1, {})
    with pytest.raises(ValueError, match=r"^expected a NcclRendezvous message, got type 'GlooRendezvous'$"):
        join("nccl", encode(GLOO), info, bind_host="127.0.0.1", device=torch.device("cpu"), broadcast_ranks=[0])
    with pytest.raises(ValueError, match=r"^LocalRendezvous: missing fields \[\], unexpected fields \['extra'\]$"):
        join(
            "local",
            _with_body(LocalRendezvous(), extra=1),
            info,
            bind_host="127.0.0.1",
            device=torch.device("cpu"),
            broadcast_ranks=[0],
        )


def test_cuda_ipc_joins_its_group_through_the_registry_first():
    """The group's message is decoded as the group's type before any memory is mapped."""
    bad = encode(IpcRendezvous(EXPORT, "nccl", encode(GLOO)))
    with pytest.raises(ValueError, match=r"^expected a NcclRendezvous message, got type 'GlooRendezvous'$"):
        join(
            "cuda_ipc",
            bad,
            init_info("cuda_ipc", bad),
            bind_host="127.0.0.1",
            device=torch.device("cpu"),
            broadcast_ranks=[0],
        )


def test_local_joins_one_rank_groups_only():
    info = init_info("local", encode(LocalRendezvous()), world_size=2)
    with pytest.raises(ValueError, match=r"^transport 'local' joins one-rank groups only; this group has 2 ranks$"):
        join("local", info.rendezvous, info, bind_host="127.0.0.1", device=torch.device("cpu"), broadcast_ranks=[0])
