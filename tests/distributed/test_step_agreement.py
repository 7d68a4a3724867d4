"""The coordinator's agreement on a step for each tensor-parallel engine (`actors.steps`), on
small Ray actors that hold a `StepGate` each: the largest boundary an engine's ranks answer,
and the others released when one rank refuses."""

from __future__ import annotations

import pytest
import ray

from actors.calls import SyncError
from actors.members import ActorMember
from actors.steps import agreed_steps
from rl_sync.rank.steps import CONTROL_GROUP, StepGate


@ray.remote(num_cpus=0.05, concurrency_groups={CONTROL_GROUP: 1})  # type: ignore[call-overload]
class GateRank:
    """A worker's arming calls on a gate that has passed `steps` boundaries."""

    def __init__(self, steps: int, refuse: bool = False):
        self.gate, self.refuse = StepGate(lambda version: None), refuse
        for _ in range(steps):
            self.gate.boundary()

    def _rl_sync_arm(self, version: int, timeout_s: float) -> int:
        if self.refuse:
            raise ValueError(f"rank refuses to arm version {version}")
        return self.gate.arm(version, timeout_s)

    def _rl_sync_disarm(self, version: int) -> None:
        self.gate.disarm(version)

    def armed(self) -> int:
        return self.gate._armed


def _members(ranks: list, engines: list[str]) -> list[ActorMember]:
    """Members of `ranks`, each of the engine named in `engines` (its size: how often it appears)."""
    members = []
    for at, (rank, engine) in enumerate(zip(ranks, engines)):
        member = ActorMember(rank, f"worker {at}")
        member.control, member.engine_ranks, member.engine = CONTROL_GROUP, engines.count(engine), engine
        members.append(member)
    return members


def test_each_tensor_parallel_engine_commits_before_the_largest_step_its_ranks_answered(ray_session):
    ranks = [GateRank.remote(s) for s in (7, 8, 3, 5, 5)]
    members = _members(ranks, ["a", "a", "lone", "b", "b"])
    steps = agreed_steps(members, version=4, timeout_s=30.0, what="round 4 commit")
    assert [steps.get(id(m)) for m in members] == [8, 8, None, 5, 5], "the lone rank takes no agreed step"
    assert ray.get([r.armed.remote() for r in ranks], timeout=30) == [4, 4, -1, 4, 4]


def test_a_rank_that_refuses_to_arm_fails_the_commit_and_its_engines_other_ranks_are_released(ray_session):
    ranks = [GateRank.remote(2), GateRank.remote(2, refuse=True), GateRank.remote(2), GateRank.remote(2)]
    members = _members(ranks, ["a", "a", "b", "b"])
    with pytest.raises(ValueError) as raised:
        agreed_steps(members, version=6, timeout_s=30.0, what="round 6 commit")
    assert str(raised.value).startswith(
        "round 6 commit (agreeing on a step of each tensor-parallel engine) failed on 1 of 4 members:\n"
        "  worker 1: ValueError: rank refuses to arm version 6"
    )
    assert ray.get([r.armed.remote() for r in ranks], timeout=30) == [-1, -1, -1, -1], "none left held"


@pytest.mark.parametrize("engines", [["a", "lone", "a"], ["a", "b", "b", "a"]])
def test_workers_not_listed_engine_by_engine_are_refused_by_name(ray_session, engines):
    ranks = [GateRank.remote(0) for _ in engines]
    with pytest.raises(SyncError) as raised:
        agreed_steps(_members(ranks, engines), version=1, timeout_s=30.0, what="round 1 commit")
    assert str(raised.value) == (
        "worker 0 reports an engine of 2 tensor-parallel ranks, but it and the workers after it (worker 0, worker 1) "
        "are not one engine's ranks; list the workers engine by engine"
    )
