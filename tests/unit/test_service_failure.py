"""A vLLM engine service's ranks report failures to the driver (type, message and traceback), and
answer the steps of colocated rounds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rl_sync.vllm import service
from rl_sync.vllm.driver import ServiceDriver
from rl_sync.vllm.service import ERROR, DescribeRequest, IpcRequest, Rendezvous, reply_key, store_client, unpack
from rl_sync.wire.codec import decode, encode
from rl_sync.wire.failure import RankFailure, RemoteTraceback


@pytest.fixture
def reply(served):
    server, secret = served
    return Rendezvous("127.0.0.1", server.port, "g", 2.0, secret)


def _failure(exc: Exception) -> bytes:
    """What a rank answers when `exc` is raised in it (with a frame of its own)."""

    def bind_checkpoint():
        raise exc

    with pytest.raises(type(exc)) as raised:
        bind_checkpoint()
    return ERROR + encode(RankFailure.of(raised.value))


class Ranks:
    """vLLM's weight-transfer call as the engine runs it: every rank answers through the store."""

    def __init__(self, reply: Rendezvous, answers: list[bytes]):
        self.reply, self.answers = reply, answers

    def init(self, info: dict) -> None:
        store = store_client(self.reply)
        for rank, answer in enumerate(self.answers):
            store.set(reply_key(self.reply.prefix, "describe", 0, rank), answer)
        store.close()

    def update(self, info: dict) -> None:
        raise AssertionError("not called")

    stage = commit = update

    def reset_prefix_cache(self) -> None:
        raise AssertionError("not called")


def _describe(reply: Rendezvous, answers: list[bytes]) -> list[bytes]:
    request = DescribeRequest(0, len(answers), {}, {}, False, reply, node="")
    return ServiceDriver(Ranks(reply, answers), len(answers)).describe(request)


def test_a_ranks_value_error_stays_a_value_error_with_its_traceback(reply):
    refused = ValueError("checkpoint tensor 'model.x' is refused")
    with pytest.raises(ValueError) as caught:
        _describe(reply, [b"fine", _failure(refused)])
    assert str(caught.value) == (
        "vLLM engine service, describe: vLLM rank 1: ValueError: checkpoint tensor 'model.x' is refused"
    )
    cause = caught.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert str(cause).startswith("vLLM rank 1:\nTraceback (most recent call last):")
    assert "in bind_checkpoint" in str(cause)


def test_ranks_failing_with_different_types_raise_runtime_error_naming_each(reply):
    answers = [_failure(TypeError("dtype name 7")), _failure(KeyError("w"))]
    with pytest.raises(RuntimeError) as caught:
        _describe(reply, answers)
    assert str(caught.value) == (
        "vLLM engine service, describe: vLLM rank 0: TypeError: dtype name 7; vLLM rank 1: KeyError: 'w'"
    )
    assert str(caught.value.__cause__).count("Traceback (most recent call last):") == 2


def test_an_unreadable_failure_report_is_named_as_such(reply):
    with pytest.raises(RuntimeError, match=r"^vLLM engine service, describe: vLLM rank 0: RuntimeError: an unreadable"):
        _describe(reply, [ERROR + b"\xc1 not msgpack"])


def test_answers_pass_through_when_every_rank_succeeds(reply):
    assert _describe(reply, [b"a", b"b"]) == [b"a", b"b"]


class Colocated:
    """An engine whose ranks share GPUs with trainers: each call's op answered per rank from
    `answers[op]`, the prefix-cache resets counted."""

    def __init__(self, reply: Rendezvous, answers: dict[str, list[bytes]]):
        self.reply, self.answers, self.resets = reply, answers, 0
        self.calls: list[str] = []

    def _answer(self, info: dict) -> None:
        op, payload = unpack(info)
        tag = decode(IpcRequest, payload).version
        self.calls.append(op)
        store = store_client(self.reply)
        for rank, answer in enumerate(self.answers[op]):
            store.set(reply_key(self.reply.prefix, op, tag, rank), answer)
        store.close()

    init = update = _answer

    def stage(self, info: dict) -> None:
        raise AssertionError("not called")

    commit = stage

    def reset_prefix_cache(self) -> None:
        self.resets += 1


def test_colocated_rounds_reach_a_services_ranks_through_vllms_calls(reply):
    """The CUDA IPC steps of a colocated round: exports, a new export only from a rank whose memory
    moved, and a fresh prefix cache once the round ended."""
    engine = Colocated(reply, {"ipc_export": [b"e0", b"e1"], "ipc_begin": [b"", b"moved1"], "ipc_end": [b"", b""]})
    driver = ServiceDriver(engine, 2)
    assert driver.ipc_export(IpcRequest(0, None, 30.0, reply)) == [b"e0", b"e1"]
    assert driver.ipc_begin(IpcRequest(3, None, 1.0, reply)) == [None, b"moved1"]
    assert engine.resets == 0
    driver.ipc_end(IpcRequest(3, ("w",), 1.0, reply))
    assert engine.resets == 1 and engine.calls == ["ipc_export", "ipc_begin", "ipc_end"]


class Staging:
    """An engine whose ranks take staged rounds: `stage` returns at once (each rank answers when
    its round ends: `finish`); a rank in `refuses` answers at once with its refusal."""

    def __init__(self, reply: Rendezvous, refuses: dict[int, Exception] | None = None):
        self.reply, self.refuses = reply, refuses or {}
        self.calls: list[str] = []

    def _put(self, op: str, tag: int, answers: dict[int, bytes]) -> None:
        store = store_client(self.reply)
        for rank, answer in answers.items():
            store.set(reply_key(self.reply.prefix, op, tag, rank), answer)
        store.close()

    def stage(self, info: dict) -> None:
        op, payload = unpack(info)
        self.calls.append(op)
        if self.refuses:
            failures = {r: _failure(e) for r, e in self.refuses.items()}
            self._put(op, decode(service.RoundRequest, payload).version, failures)
            raise RuntimeError("Worker failed with error: see the ranks' answers")

    def finish(self, version: int, answers: dict[int, bytes]) -> None:
        self._put("stage", version, answers)

    def commit(self, info: dict) -> None:
        op, payload = unpack(info)
        self.calls.append(op)
        self._put(op, decode(service.RoundRequest, payload).version, {0: b"", 1: b""})

    def init(self, info: dict) -> None:
        raise AssertionError("not called")

    update = init

    def reset_prefix_cache(self) -> None:
        raise AssertionError("not called")


def test_a_staged_round_starts_at_once_its_answers_are_collected_when_it_ended_then_it_commits(reply):
    engine = Staging(reply)
    driver = ServiceDriver(engine, 2)
    driver.stage(service.RoundRequest(b"round", 4, reply))  # nothing answered yet: it returns all the same
    engine.finish(4, {0: b"stats0", 1: b"stats1"})
    assert driver.staged(service.RoundRequest(b"", 4, reply)) == [b"stats0", b"stats1"]
    driver.commit(service.RoundRequest(b"", 4, reply))
    assert engine.calls == ["stage", "commit"]


def test_a_rank_refusing_a_staged_round_is_named_and_one_never_answering_fails_in_time(reply):
    refusals = {r: ValueError(f"worker rank {2 + r}: a staged round lands in shadow copies") for r in (0, 1)}
    driver = ServiceDriver(Staging(reply, refusals), 2)
    with pytest.raises(
        ValueError,
        match=r"^vLLM engine service, stage: vLLM rank 0: ValueError: worker rank 2: a staged round lands in "
        r"shadow copies; vLLM rank 1: ValueError: worker rank 3: a staged round lands in shadow copies$",
    ):
        driver.stage(service.RoundRequest(b"round", 5, reply))
    engine = Staging(reply)
    driver = ServiceDriver(engine, 2)
    driver.stage(service.RoundRequest(b"round", 6, reply))
    engine.finish(6, {0: b"stats0"})
    with pytest.raises(RuntimeError, match=r"^vLLM engine service, stage: vLLM rank 1: RuntimeError: no answer to"):
        driver.staged(service.RoundRequest(b"", 6, replace(reply, timeout_s=0.5)))
