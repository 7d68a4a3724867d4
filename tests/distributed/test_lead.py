"""A group led in process by trainer rank 0 (`rl_sync.lead`), no Ray: the path vLLM's trainer API
and verl's checkpoint engine take. Every rank is a thread here (rl-sync's Gloo groups are per
object); the other trainer rank and the worker ranks follow the leader's posts in its store."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rl_sync.config.sync import SyncConfig
from rl_sync.lead.board import Posts
from rl_sync.lead.follower import Follower, LeaderClosed
from rl_sync.lead.handler import RankHandler
from rl_sync.lead.leader import Leader
from rl_sync.lead.ranks import HeldSources, WholeCopies
from rl_sync.planning.layout import Layout, Mesh, Shard
from rl_sync.rendezvous import MemberStore, new_secret
from rl_sync.storage import Sharded

CONFIG = SyncConfig(
    rendezvous_host="127.0.0.1", bind_host="127.0.0.1", init_timeout_s=20.0, round_timeout_s=20.0, bucket_bytes=4096
)
WORKERS = 2


def _shards(full: dict[str, torch.Tensor], rank: int) -> dict[str, Sharded]:
    """Trainer `rank`'s half of every tensor (rows), as FSDP holds it."""
    layout = Layout(Mesh((2,)), (Shard(0),))
    return {n: Sharded(t.chunk(2)[rank].clone(), layout, tuple(t.shape)) for n, t in full.items()}


class Group:
    """Trainer 0 leading, trainer 1 and two workers following."""

    def __init__(self, config: SyncConfig = CONFIG):
        self.trainers = [HeldSources(), HeldSources()]
        self.workers = [WholeCopies(WORKERS) for _ in range(WORKERS)]
        self.leader = Leader(self.trainers[0], config, new_secret())
        self.pool = ThreadPoolExecutor(1 + WORKERS)
        self.followers = [self._follower(self.trainers[1], "trainers", "trainer", 0)]
        self.followers += [self._follower(w, "workers", "worker", i) for i, w in enumerate(self.workers)]

    def _follower(self, rank, board: str, side, index: int) -> Follower:
        host, port = self.leader.address
        store = MemberStore(host, port, self.leader.secret, timeout_s=CONFIG.init_timeout_s)
        posts = Posts(store, f"{self.leader.reply.prefix}/{board}", self.leader.secret)
        return Follower(RankHandler(rank, side, index), posts, CONFIG.init_timeout_s)

    def step(self, lead, *ops):
        """`lead()` on trainer 0 while every follower handles posts up to one of `ops`."""
        waits = [self.pool.submit(f.until, *ops) for f in self.followers]
        try:
            return lead()
        finally:
            self.outcomes = [w.exception(timeout=60) for w in waits]

    def form(self):
        workers = self.leader.board("workers", WORKERS, "worker rank {}".format)
        return self.step(lambda: self.leader.form(2, workers), "connect")

    def close(self):
        self.step(self.leader.close, "close")
        self.pool.shutdown()


def _full(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 8, generator=gen), "b": torch.randn(6, generator=gen)}


def test_every_round_lands_bit_exactly_and_sparse_rounds_send_only_changes():
    group, full = Group(), _full(0)
    try:
        for t, rank in zip(group.trainers, range(2)):
            t.tensors = _shards(full, rank)
        summary = group.form()
        assert group.outcomes == [None] * 3 and summary.world_size == 4 and summary.transport == "gloo"
        for step, ran in enumerate(["m2n", "sparse", "sparse"], start=1):  # the first fills the baselines
            full["w"][step, :3] += 1.0
            for t, rank in zip(group.trainers, range(2)):
                t.tensors = _shards(full, rank)
            stats = group.step(lambda: group.leader.push("sparse"), "run")
            assert group.outcomes == [None] * 3 and (stats.version, stats.mode) == (step, ran)
            for w, worker in enumerate(group.workers):
                for name, tensor in full.items():
                    assert torch.equal(worker.copies[name], tensor), f"step {step}: worker {w}, {name}"
            sent = sum(r.sent_bytes for r in stats.ranks if r.role == "trainer")
            dense = WORKERS * sum(t.numel() * t.element_size() for t in full.values())
            assert sent == dense if step == 1 else sent < dense / 4, f"step {step} sent {sent} of {dense}"
    finally:
        group.close()


def test_posts_never_carry_the_groups_secret(monkeypatch):
    written: list[bytes] = []
    original = MemberStore.set

    def recording(self, key, value):
        written.append(bytes(value))
        original(self, key, value)

    monkeypatch.setattr(MemberStore, "set", recording)
    group, full = Group(), _full(1)
    try:
        for t, rank in zip(group.trainers, range(2)):
            t.tensors = _shards(full, rank)
        group.form()
        group.step(group.leader.push, "run")
        assert group.outcomes == [None] * 3
    finally:
        group.close()
    assert written and not [v for v in written if group.leader.secret in v]


def test_trainers_that_disagree_fail_forming_on_the_leader_and_close_the_followers():
    group, full = Group(), _full(2)
    group.trainers[0].tensors = _shards(full, 0)
    group.trainers[1].tensors = {
        **_shards(full, 1),
        "b": Sharded(torch.zeros(2), Layout(Mesh((2,)), (Shard(0),)), (4,)),
    }
    with pytest.raises(
        ValueError, match=r"trainers disagree on tensor 'b': rank 1 reports dtype float32, shape \(4,\)"
    ):
        group.form()
    assert [type(e) for e in group.outcomes] == [LeaderClosed] * 3
    with pytest.raises(RuntimeError, match=r"the group is broken by an earlier failure \(init: ValueError\)"):
        group.leader.push()
    group.leader.close()
    group.pool.shutdown()
