"""Which members' staged-round calls go to their actor's control group (`actors.members`):
as each worker's report says, one report per rank (an engine service answers for several),
kept across the members a regroup builds anew."""

from __future__ import annotations

from types import SimpleNamespace

from actors.members import ActorMember, ServiceMember, give_controls, note_controls
from rl_sync.rank.steps import CONTROL_GROUP
from rl_sync.wire.messages import RankReport


def _report(control: str) -> RankReport:
    return RankReport(0, "cpu", "", (), {}, 0, control_group=control)


def test_each_actor_member_takes_the_group_its_rank_reported_after_an_engine_services_ranks():
    service = ServiceMember(SimpleNamespace(host=object(), ranks=2), "vLLM service 0")
    lone, tp_rank = ActorMember("engine-a", "worker 2"), ActorMember("engine-b", "worker 3")
    controls: dict = {}
    note_controls([service, lone, tp_rank], [_report(""), _report(""), _report(CONTROL_GROUP), _report("")], controls)
    assert (lone.control, tp_rank.control) == (CONTROL_GROUP, None)
    again = [ActorMember("engine-a", "worker 0"), ActorMember("engine-c", "worker 1")]
    give_controls(again, controls)
    assert [m.control for m in again] == [CONTROL_GROUP, None], "kept by actor; a new actor has none until it reports"


class _Method:
    """An actor method as a member calls it: which concurrency group each call went to."""

    def __init__(self, calls: list, group: str | None = None):
        self.calls, self.group = calls, group

    def options(self, concurrency_group: str) -> _Method:
        return _Method(self.calls, concurrency_group)

    def remote(self, *args) -> None:
        self.calls.append(self.group)


def test_a_colocated_rounds_opening_and_closing_go_to_the_control_group_only_when_staged():
    calls: list = []
    handle = SimpleNamespace(_rl_sync_ipc_begin=_Method(calls), _rl_sync_ipc_end=_Method(calls))
    member = ActorMember(handle, "worker 0")
    member.control = CONTROL_GROUP
    for staged in (True, False):
        member.ipc_begin(1, 0, False, None, staged)
        member.ipc_end(1, None, None, staged)
    member.control = None
    member.ipc_begin(1, 0, False, None, True)
    assert calls == [CONTROL_GROUP, CONTROL_GROUP, None, None, None], "a blocking round's wait for a generation"
