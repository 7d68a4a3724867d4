"""The calls the coordinator makes on a rank, as one typed seam.

Every kind of rank implements them: a Ray actor (`actors`: one actor, one
rank), a vLLM rank that is itself a Ray actor (external launcher), and a vLLM
engine run as a service, whose ranks live in vLLM's worker processes and are
reached through vLLM's weight-transfer calls (`rl_sync.vllm.backend`, driven
by `actors.members.ServiceMember`). Arguments and results are plain data or
bytes of `rl_sync.wire.codec` messages, so any of them may cross a process.

Order (the coordinator's contract, the same on every rank of a group):
`_rl_sync_ping` (before a repair), `_rl_sync_describe` for each side the rank
plays, `_rl_sync_nccl_ids` (trainer 0, NCCL only), `_rl_sync_ipc_export`
(workers, colocated CUDA IPC only: each export is its trainer's `cuda_ipc`
rendezvous message), `_rl_sync_connect`; then per round `_rl_sync_run` on
the group's ranks, in a colocated (CUDA IPC) group at the same time as
`_rl_sync_ipc_round` on every worker (its `_rl_sync_ipc_begin`, a wait for its
trainer's writes on their shared page, `rl_sync.transport.doorbell`, and its
`_rl_sync_ipc_end`; a worker whose memory moved answers a new export instead,
every trainer skips the round, and the coordinator has each map the new one
with `_rl_sync_ipc_remap` and runs the round again), or, for an engine
service's workers, `_rl_sync_ipc_begin` before `_rl_sync_run` and
`_rl_sync_ipc_end` after it; `_rl_sync_commit` (double buffering only) and, on
workers, once the coordinator decided the round counts, `_rl_sync_record`
(the coordinator does not wait for its answer, only for its next call's: a
worker takes its calls in order); or, for a staged
round (workers only, double buffering), `_rl_sync_stage` (returns once the
round runs on a thread of its own), `_rl_sync_staged` (waits for it),
`_rl_sync_commit` and `_rl_sync_record`. A worker actor that declares a
control group (`WorkerRank.rl_sync_control_group`) takes `_rl_sync_stage`,
`_rl_sync_staged`, its `_rl_sync_ipc_begin` / `_rl_sync_ipc_end` of a staged
round, `_rl_sync_commit` and `_rl_sync_record` there, in the order sent, beside
its generation (`rl_sync.rank.steps`: the commit lands between two of the
engine's steps; the ranks of a tensor-parallel engine take `_rl_sync_arm`
first, all of them, then `_rl_sync_commit` with the step they agree on, or
`_rl_sync_disarm` where the commit will not come); every other call waits for a generation to end, as before,
and describe and close also wait for a control call still running
(`rl_sync.rank.serial`); `_rl_sync_version_of`,
`_rl_sync_apply_patches` (then `_rl_sync_record`) and `_rl_sync_close`
between rounds. An engine joining or leaving (between rounds):
`_rl_sync_describe` on the joining ranks, then `_rl_sync_regroup` on every
rank that stays or joins, `_rl_sync_catch_up` on a peer replica's ranks and
the joining ones, `_rl_sync_switch`, and `_rl_sync_record` on the joining
ones once the coordinator decided the join counts.

Membership (`rl_sync.rank.claim`): describe's options
(`rl_sync.rank.side.DescribeOptions`) carry the group's `GroupTag`; a rank
held by another live group refuses it, and `_rl_sync_close` names the group
closing, so a group that no longer holds the rank changes nothing.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from .side import DescribeOptions


@runtime_checkable
class SyncRank(Protocol):
    def _rl_sync_ping(self) -> None: ...

    def _rl_sync_describe(
        self, side: str, side_rank: int, side_size: int, options: DescribeOptions | None = None
    ) -> bytes: ...

    def _rl_sync_nccl_ids(self) -> tuple[list[int], list[int]]: ...

    def _rl_sync_connect(self, init: bytes, plan: bytes, bind_host: str | None, device: str) -> None: ...

    def _rl_sync_run(self, round_blob: bytes) -> bytes: ...

    def _rl_sync_commit(self, version: int, timeout_s: float = 30.0, at_step: int | None = None) -> float: ...

    def _rl_sync_arm(self, version: int, timeout_s: float) -> int: ...

    def _rl_sync_disarm(self, version: int) -> None: ...

    def _rl_sync_stage(self, round_blob: bytes) -> None: ...

    def _rl_sync_staged(self, version: int, timeout_s: float) -> bytes: ...

    def _rl_sync_record(self, version: int) -> bool: ...

    def _rl_sync_version_of(self) -> int | None: ...

    def _rl_sync_apply_patches(self, version: int, patches: dict) -> int: ...

    def _rl_sync_ipc_export(self, device: str, timeout_s: float = 120.0) -> bytes: ...

    def _rl_sync_ipc_begin(self, ticket: int, writes_all: bool = False) -> bytes | None: ...

    def _rl_sync_ipc_round(
        self, version: int, names: tuple[str, ...] | None, ticket: int, timeout_s: float, writes_all: bool = False
    ) -> bytes | None: ...

    def _rl_sync_ipc_remap(self, ipc: bytes) -> None: ...

    def _rl_sync_ipc_end(self, version: int, names: tuple[str, ...] | None = None) -> None: ...

    def _rl_sync_regroup(self, init: bytes, plan: bytes, bind_host: str | None, device: str) -> None: ...

    def _rl_sync_switch(self, keep: bool) -> None: ...

    def _rl_sync_catch_up(self, plan: bytes, round_blob: bytes) -> bytes: ...

    def _rl_sync_close(self, abort: bool = False, group: str | None = None) -> None: ...
