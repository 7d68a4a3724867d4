"""rl-sync on the trainer side of vLLM's weight-transfer API (vLLM 0.29+): backend `rl_sync`.

A framework that drives vLLM through its trainer API (SkyRL, TRL's async
GRPO, vLLM's own RLHF examples) selects rl-sync by configuration alone: the
engine is built with `weight_transfer_config={"backend": "rl_sync"}` and
every trainer rank builds its trainer engine from `RlSyncTrainerInitInfo`
through vLLM's factory, then calls `send_weights()` once per sync. Each
round reshards the trainers' DTensor shards straight into the engine ranks'
live weights (M2N, or only what changed: `SyncConfig.mode`), with no gather
on the trainer side.

How it is reached: trainer rank 0 leads the group in process
(`rl_sync.lead.Leader`), hosting the rendezvous store; the engine's ranks
(rl-sync's worker backend, `rl_sync.vllm.backend`) are reached through the
framework's client (`VLLMWeightSyncClient`), the other trainer ranks through
posts in the store. Those ranks learn the store's address and secret once, at
`trainer_init`, over the trainers' own process group (`trainer_group`).

Sources: a `WeightSource` whose iteration yields DTensors (`ShardedModuleSource`)
is read shard by shard; one yielding whole tensors (vLLM's `ModuleSource`
gathers each FSDP parameter) is taken as replicated on every trainer, each
sending part of it.

The prefix cache: the client's `reset_prefix_cache()` runs after each round
when the client has one; vLLM's own clients do not, so a framework resets it
as it does for vLLM's backends (`reset_prefix_cache()`, or pausing with
`clear_cache=True`).

Typical use (on every trainer rank)::

    from vllm.distributed.weight_transfer import RayVLLMWeightSyncClient, WeightTransferTrainerFactory

    engine = WeightTransferTrainerFactory.trainer_init(
        RlSyncTrainerInitInfo(rank=rank, num_trainer_ranks=world, engine_ranks=2),
        client=RayVLLMWeightSyncClient(llm_actor),
        source=ShardedModuleSource(model),
    )
    for batch in data:
        train_step(batch)
        engine.send_weights()
    engine.shutdown()
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from ..config.sync import SyncConfig
from ..lead.board import Posts
from ..lead.follower import Follower, LeaderClosed
from ..lead.handler import RankHandler
from ..lead.leader import Leader
from ..rank import TrainerRank
from ..rendezvous import MemberStore, new_secret
from ..wire.stats import RoundStats, SyncSummary
from .driver import ServiceDriver
from .plugin import BACKEND, register


class ShardedModuleSource(WeightSource):
    """`ModuleSource` without the gather: `module.named_parameters()` as they are (an FSDP2
    parameter stays a DTensor, whose layout rl-sync reads)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, p.dtype, tuple(p.shape)) for name, p in self.module.named_parameters()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.module.named_parameters()


class ClientControl:
    """vLLM's trainer-side client as the `EngineControl` a `ServiceDriver` calls through."""

    def __init__(self, client: VLLMWeightSyncClient):
        self.client = client

    def init(self, info: dict) -> None:
        self.client.init_weight_transfer_engine(info)

    def update(self, info: dict) -> None:
        self.client.start_weight_update()
        self.client.update_weights(info)
        self.client.finish_weight_update()

    def reset_prefix_cache(self) -> None:
        """The client's own, where it has one (see the module docstring)."""
        reset = getattr(self.client, "reset_prefix_cache", None)
        if callable(reset):
            reset()


def _count(label: str, value: object, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"RlSyncTrainerInitInfo.{label} must be an int, got {value!r}")
    if value < low:
        raise ValueError(f"RlSyncTrainerInitInfo.{label} must be at least {low}, got {value}")
    return value


@dataclass(kw_only=True)
class RlSyncTrainerInitInfo(TrainerInitInfo):
    """What selects rl-sync on the trainer side; the same on every trainer rank but `rank`.
    Building one registers the backend with vLLM's trainer factory."""

    backend: ClassVar[str] = BACKEND
    num_trainer_ranks: int = 1
    """Trainer ranks calling `trainer_init` and `send_weights`; `rank` is this one's, and a
    DTensor's mesh must name the same ranks."""
    engine_ranks: int = 1
    """Ranks of the vLLM engine behind the client (tensor x pipeline parallel size): one engine
    per trainer engine."""
    sync: SyncConfig = field(default_factory=SyncConfig)
    """Mode, buckets, transport, timeouts (`rendezvous_host` / `rendezvous_port`: where trainer
    rank 0 hosts the store; `bind_host`: what each rank's Gloo device binds)."""
    trainer_group: Any = None
    """The trainers' `torch.distributed` process group, used once at `trainer_init` to hand rank
    0's store address and secret to the others (None: the default group, which FSDP trainers
    have); unused with one trainer rank."""

    def __post_init__(self) -> None:
        _count("num_trainer_ranks", self.num_trainer_ranks, 1)
        _count("engine_ranks", self.engine_ranks, 1)
        if not 0 <= _count("rank", self.rank, 0) < self.num_trainer_ranks:
            raise ValueError(
                f"RlSyncTrainerInitInfo.rank must be in [0, {self.num_trainer_ranks}) (num_trainer_ranks), "
                f"got {self.rank}"
            )
        if not isinstance(self.sync, SyncConfig):
            raise TypeError(f"RlSyncTrainerInitInfo.sync must be a SyncConfig, got {type(self.sync).__name__}")
        register()


class SourceRank(TrainerRank):
    """A trainer rank whose tensors are what `source` yields, every round."""

    def __init__(self, source: WeightSource):
        self.source = source

    def rl_sync_sources(self) -> dict[str, torch.Tensor]:
        return dict(iter(self.source))


def _share_store(info: RlSyncTrainerInitInfo, leader: Leader | None) -> tuple[str, int, str, bytes]:
    """Trainer rank 0's store address, key prefix and secret, on every trainer rank (one
    broadcast over `info.trainer_group`: all trainer ranks, once, at `trainer_init`)."""
    import torch.distributed as dist

    if leader is not None and info.num_trainer_ranks == 1:
        return (*leader.address, leader.reply.prefix, leader.secret)
    if not dist.is_initialized():
        raise ValueError(
            f"rl_sync trainer engine: {info.num_trainer_ranks} trainer ranks need torch.distributed initialized "
            "(rank 0 hands its store address and secret to the others over the trainers' process group)"
        )
    group_rank = dist.get_rank(info.trainer_group)
    if group_rank != info.rank:
        raise ValueError(
            f"rl_sync trainer engine: RlSyncTrainerInitInfo.rank is {info.rank} but this process is rank "
            f"{group_rank} of trainer_group; pass each trainer's rank in that group"
        )
    shared = [None if leader is None else (*leader.address, leader.reply.prefix, leader.secret)]
    dist.broadcast_object_list(shared, group=info.trainer_group, group_src=0)
    assert shared[0] is not None  # rank 0 sent it
    return shared[0]


class RlSyncTrainerEngine(TrainerWeightTransferEngine[RlSyncTrainerInitInfo]):
    """One trainer rank's end of an rl-sync group (see the module docstring). On rank 0,
    `summary` says what forming the group decided and `stats` what the last round did."""

    init_info_cls = RlSyncTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, info: RlSyncTrainerInitInfo):
        super().__init__(client=client, source=source, is_sender=info.is_sender)
        self.rank = SourceRank(source)
        self.leader = Leader(self.rank, info.sync, new_secret()) if info.is_sender else None
        self.follower: Follower | None = None
        self.summary: SyncSummary | None = None
        self.stats: RoundStats | None = None

    @classmethod
    def trainer_init(
        cls, init_info: RlSyncTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        """Form the group: rank 0 plans and connects every rank; the others follow. Collective
        over the trainer ranks; bounded by the config's init timeouts."""
        if not isinstance(init_info, RlSyncTrainerInitInfo):
            raise TypeError(f"rl_sync trainer engine: init_info must be RlSyncTrainerInitInfo, got {init_info!r:.80}")
        if not isinstance(source, WeightSource):
            raise TypeError(
                f"rl_sync trainer engine: source must be a vLLM WeightSource (e.g. ShardedModuleSource(model)), "
                f"got {type(source).__name__}"
            )
        engine = cls(client=client, source=source, info=init_info)
        try:
            host, port, prefix, secret = _share_store(init_info, engine.leader)
            if engine.leader is not None:
                workers = ServiceDriver(ClientControl(client), init_info.engine_ranks)
                engine.summary = engine.leader.form(init_info.num_trainer_ranks, workers)
            else:
                engine._follow(init_info, host, port, prefix, secret)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def _follow(self, info: RlSyncTrainerInitInfo, host: str, port: int, prefix: str, secret: bytes) -> None:
        store = MemberStore(host, port, secret, timeout_s=info.sync.init_timeout_s)
        posts = Posts(store, f"{prefix}/trainers", secret)
        follower = Follower(RankHandler(self.rank, "trainer", info.rank - 1), posts, info.sync.init_budget_s)
        follower.until("connect")
        self.follower, follower.timeout_s = follower, info.sync.round_timeout_s

    def send_weights(self, mode: str | None = None) -> None:
        """One round of every tensor on every rank (collective over the trainer ranks and the
        engine's); `mode` overrides the config's for this round."""
        if self.leader is not None:
            self.stats = self.leader.push(mode)
        elif self.follower is not None:
            try:
                self.follower.until("run")
            except LeaderClosed:
                self.follower = None  # the group is gone: nothing left to close
                raise
        else:
            raise RuntimeError("rl_sync trainer engine: shut down (or never formed); call trainer_init again")

    def shutdown(self) -> None:
        """Leave the group (collective: every trainer rank calls it); a second call does nothing."""
        leader, follower, self.leader, self.follower = self.leader, self.follower, None, None
        if leader is not None:
            leader.close()
        elif follower is not None:
            follower.until("close")
