"""vLLM engines whose tensor-parallel ranks are Ray actors (vLLM's external launcher).

Large RL frameworks run vLLM this way: every TP rank of an engine is one Ray
actor holding an `LLM` built with `distributed_executor_backend=
"external_launcher"`, so the trainer-side driver places, drives and syncs
them like any other actor. Two ways in:

* `VllmWorkerMixin`: your rollout actor already holds such an `LLM`; inherit
  the mixin and define `rl_sync_llm()`.
* `VllmEngine.launch(...)`: ready actors (`VllmRankActor`), one per TP rank,
  started together, with `generate` for greedy or sampled token ids.

Either way the workers passed to `WeightSync` are the engines' rank actors,
engine by engine, each engine's ranks in TP order. Layouts come from vLLM's
own loader (`rl_sync.vllm.binding`); after each round the ranks run vLLM's
post-load processing for what changed and forget the engine's cached
prefixes (`rl_sync.vllm.prefix`: a prefix cached with the old weights would
otherwise be served after the update).

Typical use::

    engine = VllmEngine.launch("/models/qwen2", tp=2, llm_kwargs={"dtype": "bfloat16"})
    sync = WeightSync.create(trainers, engine.ranks, config)
    sync.push()
    outputs = engine.generate([[1, 2, 3]], max_tokens=8)
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
import socket
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import ray

from rl_sync.rank.steps import CONTROL_GROUP, StepGate
from rl_sync.vllm.lora import LoraSlots
from rl_sync.vllm.prefix import Ahead, forget_cached_prefixes, forgets_in_place, hash_ahead
from rl_sync.vllm.rank import VllmDestinations, engine_rank_of

from .worker_mixin import SyncWorkerMixin

LOG = logging.getLogger(__name__)

if TYPE_CHECKING:
    from torch.distributed import TCPStore
    from vllm import LLM


class VllmWorkerMixin(SyncWorkerMixin):
    """Inherit in a Ray actor that holds one TP rank of a vLLM engine; define `rl_sync_llm()`
    returning that `LLM`. A group created with `lora=LoraSpec(...)` writes the trainers' adapter
    into one LoRA slot of the engine instead of its weights (`rl_sync.vllm.lora`)."""

    _rl_sync_vllm: VllmDestinations | None = None
    _rl_sync_lora: LoraSlots | None = None
    _rl_sync_engine_id = ""
    _rl_sync_ahead: Ahead | None = None
    rl_sync_takes_lora = True
    rl_sync_llm: Callable[[], LLM]
    """The subclass's: the `LLM` holding this rank."""

    def rl_sync_destinations(self, checkpoint):
        side = self._rl_sync_sides["worker"]
        self._rl_sync_vllm, self._rl_sync_lora = VllmDestinations.of_llm(self.rl_sync_llm()), None
        where = engine_rank_of(self._rl_sync_vllm.vllm_config, side.rank, side.size)
        self._rl_sync_engine_id = where.exchange(secrets.token_hex(8))[0]  # (one name for the engine's ranks)
        if side.options.lora is None:
            options = side.options
            return self._rl_sync_vllm.bind(checkpoint, side.rank, side.size, options.sharded, options.next_writes_all)
        self._rl_sync_lora = LoraSlots(self._rl_sync_vllm.model, side.options.lora)
        return self._rl_sync_lora.bind(checkpoint, where, side.size // where.size)

    def _rl_sync_bound(self) -> VllmDestinations:
        assert self._rl_sync_vllm is not None  # the hooks below run only once the rank is bound
        return self._rl_sync_vllm

    def _rl_sync_follow(self, unfilled) -> bool:
        """A LoRA group first checks that its adapter still holds its slot (`LoraSlots.check`):
        every path that writes or commits (a round, a colocated round's opening, a commit, patches)
        follows the engine's weights here first. A slot lost holds no version any more."""
        if self._rl_sync_lora is not None:
            try:
                self._rl_sync_lora.check()
            except ValueError:
                self._rl_sync_version = None
                raise
        return super()._rl_sync_follow(unfilled)

    def _rl_sync_version_of(self) -> int | None:
        """None as well once a LoRA group's adapter lost its slot (a relay never sends from it)."""
        if self._rl_sync_lora is not None and not self._rl_sync_lora.holds_slot():
            return None
        return super()._rl_sync_version_of()

    def rl_sync_load_fallbacks(self, pairs) -> None:
        self._rl_sync_bound().load_fallbacks(pairs)

    def rl_sync_weights_updated(self, names) -> None:
        """vLLM's post-load processing for what changed (a LoRA group: the adapter's scaling),
        then no prefix cached before is served (`rl_sync.vllm.prefix`)."""
        if self._rl_sync_lora is not None:
            self._rl_sync_lora.after_update(names)
        else:
            self._rl_sync_bound().after_update(names)
        ahead, self._rl_sync_ahead = self._rl_sync_ahead, None
        forget_cached_prefixes(self.rl_sync_llm(), ahead)

    def _rl_sync_before_commit(self) -> None:
        """The waiting requests' block hashes under the prefix root the commit gives, computed
        beside the engine's steps rather than inside its stall (`prefix.hash_ahead`); where that
        fails, the commit hashes them itself (a warning says why)."""
        try:
            self._rl_sync_ahead = hash_ahead(self.rl_sync_llm())
        except Exception as exc:  # (an optimisation: never the commit's failure)
            self._rl_sync_ahead = None
            LOG.warning("rl-sync: hashing waiting requests ahead of a commit failed (%r); the commit hashes them", exc)

    def rl_sync_write_modes(self) -> dict[str, str]:
        if self._rl_sync_lora is not None:
            return self._rl_sync_lora.write_modes()
        return self._rl_sync_bound().write_modes()

    def rl_sync_swappable(self) -> list[str]:
        """None of a LoRA group's (a slot's box is part of a tensor every slot shares)."""
        return [] if self._rl_sync_lora is not None else self._rl_sync_bound().swappable()

    def rl_sync_generating(self) -> AbstractContextManager[None]:
        """Run whatever runs the engine's steps (its generation) inside this: a staged round's
        commit then lands between two of them (`rl_sync.rank.steps`), or, where requests in
        flight could not keep their KV (`rl_sync.vllm.prefix.forgets_in_place`: a KV connector,
        say), once the generation ends. Required of an actor that declares
        `rl_sync_control_group` (whose commits arrive beside its generation); every rank of a
        tensor-parallel engine runs each generation through it, so their step numbers, counted
        from their binding, agree."""
        gate, llm = self._rl_sync_steps(), self.rl_sync_llm()
        engine = llm.llm_engine
        if getattr(engine, "_rl_sync_gate", None) is not gate:
            engine.step = _stepping(type(engine).step.__get__(engine), gate)  # type: ignore[method-assign]
            engine._rl_sync_gate = gate  # type: ignore[attr-defined]
        return gate.generating(at_steps=forgets_in_place(llm))

    def _rl_sync_control_of(self, side: str) -> str:
        """None for a tensor-parallel engine whose generations hold commits over to their end
        (`forgets_in_place`): its ranks take every call in order, between two generations, so
        they never run one with two versions."""
        control = super()._rl_sync_control_of(side)
        if control and self._rl_sync_engine()[0] > 1 and not forgets_in_place(self.rl_sync_llm()):
            return ""
        return control

    def _rl_sync_engine(self) -> tuple[int, str]:
        """The engine's tensor-parallel size and the name its ranks drew at binding: they run their
        steps in lockstep, and switch before the same one (`rl_sync.rank.steps`)."""
        return self._rl_sync_bound().vllm_config.parallel_config.tensor_parallel_size, self._rl_sync_engine_id

    def rl_sync_prepare(self, names, spare) -> None:
        """A LoRA group prepares nothing: its scaling runs at the commit, on the slot."""
        if self._rl_sync_lora is None:
            self._rl_sync_bound().prepare(names, spare)


def _stepping(step: Callable, gate: StepGate) -> Callable:
    """vLLM's `LLMEngine.step` with the gate's boundary before each step."""

    def stepped(*args, **kwargs):
        gate.boundary()
        return step(*args, **kwargs)

    return stepped


def completions(llm, prompts: Sequence[Sequence[int]], sampling: dict[str, Any], lora_request=None) -> list[dict]:
    """Per token-id prompt: the first completion's `tokens` and `logprobs` (of the chosen tokens,
    None unless asked for), and every completion's token ids as `samples` (`sampling`:
    `SamplingParams` fields, `n` included; `lora_request`: vLLM's `LoRARequest` of the adapter
    to generate with)."""
    from vllm import SamplingParams

    prompted = [{"prompt_token_ids": list(p)} for p in prompts]
    outputs = llm.generate(prompted, SamplingParams(**sampling), use_tqdm=False, lora_request=lora_request)
    out = []
    for output in outputs:
        completion = output.outputs[0]
        logprobs = (
            None
            if completion.logprobs is None
            else [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]
        )
        out.append(
            {
                "tokens": list(completion.token_ids),
                "logprobs": logprobs,
                "samples": [list(c.token_ids) for c in output.outputs],
            }
        )
    return out


def _name_groups(launch: int) -> None:
    """Number this process's next vLLM process groups from `launch`, the number the engine's rank 0
    drew for this start (`VllmRankActor.rendezvous`).

    vLLM's CPU build backs a tensor- or pipeline-parallel group with shared memory named after
    the init method and the group's per-process number ("tp:0"). Under the external launcher the
    init method is always `env://`, so two TP engines on one host, or one started where an earlier
    one left its segments behind (killed, or stopped by a restart whose segments outlived it),
    would open the same names and fail ("create shm in SHMManager failed. errno: 17"). Every rank
    of an engine gets the same number, and each start draws a new one (the rendezvous port alone
    repeats once the operating system hands it out again), so the names agree within an engine and
    differ between engines and starts."""
    from vllm.distributed import parallel_state

    for kind in ("tp", "pp"):
        parallel_state._group_name_counter[kind] = launch


def _forget_groups(launch: int) -> None:
    """Remove the shared memory of the process groups named after `launch` (`_name_groups`), once
    every rank released them: vLLM's CPU build leaves a 4 MiB segment per rank of each group in
    `/dev/shm` when an engine stops. The number is this start's alone, so nothing else matches."""
    for path in glob.glob(f"/dev/shm/*:{launch}-*cpushm_*"):
        with contextlib.suppress(FileNotFoundError):  # (another rank of the engine removed it)
            os.unlink(path)


def _listen(host: str) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


RANK_GROUPS = {CONTROL_GROUP: 1}
"""The Ray concurrency groups of a `VllmRankActor`: its control calls (a staged round's) on a thread
of their own."""


class VllmRankActor(VllmWorkerMixin):
    """One TP rank of a vLLM engine (wrap with `ray.remote(concurrency_groups=RANK_GROUPS)` and pass
    `control_group=CONTROL_GROUP`; `VllmEngine.launch` does): the rank then takes a staged
    round's calls beside `generate`, and its commit lands between two of the engine's steps,
    the same one on every rank (`rl_sync.rank.steps`).

    Rank 0 hosts the engine's torch.distributed rendezvous on `host` (its Ray node
    address by default, never every interface); `start` builds the `LLM` on every rank
    at once and `stop` releases it. `env` adds environment variables (e.g.
    `GLOO_SOCKET_IFNAME`)."""

    def __init__(
        self,
        tp_rank: int,
        tp_size: int,
        host: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 120.0,
        control_group: str | None = None,
    ):
        self.tp_rank, self.tp_size, self.timeout_s = tp_rank, tp_size, timeout_s
        self.rl_sync_control_group = control_group
        """`CONTROL_GROUP` where the actor was declared with `RANK_GROUPS` (Ray kills an actor
        asked to run a call in a group it lacks); None: a staged round's calls, its commit
        included, wait for a generation to end."""
        self.llm: LLM | None = None
        self.host = host or ray.util.get_node_ip_address()
        os.environ.update(env or {})
        self._store: TCPStore | None = None
        self._launch: int | None = None
        """The number the current start's process groups are named after (`_name_groups`)."""

    def rendezvous(self) -> tuple[str, int, int]:
        """Rank 0: open a fresh meeting point for the engine's ranks (one per `start`): its host and
        port, and a number drawn for this start that names its process groups (`_name_groups`)."""
        import torch.distributed as dist

        sock = _listen(self.host)
        self._store = dist.TCPStore(
            self.host,
            sock.getsockname()[1],
            self.tp_size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=self.timeout_s),
            master_listen_fd=sock.fileno(),
        )
        sock.detach()
        return self.host, self._store.port, secrets.randbits(30)

    def stop(self) -> None:
        """Release this rank's engine and its distributed state (every rank at once); `start`
        may build a new one in this process."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        self._rl_sync_close(abort=True)
        self.llm = None
        cleanup_dist_env_and_memory()
        if self._launch is not None:
            _forget_groups(self._launch)
            self._launch = None

    def start(self, model: str, address: tuple[str, int, int], llm_kwargs: dict[str, Any]) -> None:
        """Build this rank's `LLM` (every rank of the engine at once)."""
        from vllm import LLM

        os.environ.update(
            {
                "RANK": str(self.tp_rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(self.tp_size),
                "MASTER_ADDR": address[0],
                "MASTER_PORT": str(address[1]),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            }
        )
        self._launch = address[2]
        _name_groups(self._launch)
        self.llm = LLM(
            model=model,
            tensor_parallel_size=self.tp_size,
            distributed_executor_backend="external_launcher",
            **llm_kwargs,
        )

    def rl_sync_llm(self):
        return self.llm

    def generate(self, prompts: Sequence[Sequence[int]], sampling: dict[str, Any], lora_request=None) -> list[dict]:
        """Token ids and their log-probabilities for each prompt (every rank of the engine
        calls it with the same arguments; `lora_request`: the adapter to generate with)."""
        with self.rl_sync_generating():
            return completions(self.llm, prompts, sampling, lora_request)

    def version(self) -> int | None:
        """The weight version this rank's live weights hold (rl-sync's, None before a sync)."""
        return self._rl_sync_version_of()

    def call(self, fn, *args, **kwargs):
        """Run `fn(self, *args, **kwargs)` in this actor (as a generation: a commit waits for it to
        end, or for a step it runs, `rl_sync_generating`)."""
        if self.llm is None:
            return fn(self, *args, **kwargs)
        with self.rl_sync_generating():
            return fn(self, *args, **kwargs)


class VllmEngine:
    """A vLLM engine as `tp` `VllmRankActor`s; `ranks` go to `WeightSync` as workers."""

    def __init__(self, ranks: list):
        self.ranks = ranks

    @classmethod
    def launch(
        cls,
        model: str,
        tp: int = 1,
        *,
        llm_kwargs: dict[str, Any] | None = None,
        actor_options: Sequence[dict[str, Any]] | None = None,
        host: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: float = 300.0,
    ) -> VllmEngine:
        """Start the ranks (`actor_options[i]` are rank i's Ray options, e.g. a placement
        group bundle) and build the engine on all of them; bounded by `timeout_s`."""
        Rank = ray.remote(concurrency_groups=RANK_GROUPS)(VllmRankActor)  # type: ignore[call-overload]
        options = list(actor_options or [{"num_cpus": 1}] * tp)
        ranks = [Rank.options(**options[r]).remote(r, tp, host, env, control_group=CONTROL_GROUP) for r in range(tp)]
        engine = cls(ranks)
        try:
            engine.start(model, llm_kwargs, timeout_s)
        except BaseException:
            engine.shutdown()
            raise
        return engine

    def start(self, model: str, llm_kwargs: dict[str, Any] | None = None, timeout_s: float = 300.0) -> None:
        """Build the engine on every rank from `model` (a fresh `LLM`, loaded from disk)."""
        address = ray.get(self.ranks[0].rendezvous.remote(), timeout=timeout_s)
        ray.get([r.start.remote(model, address, dict(llm_kwargs or {})) for r in self.ranks], timeout=timeout_s)

    def restart(self, model: str, llm_kwargs: dict[str, Any] | None = None, timeout_s: float = 300.0) -> None:
        """A fresh engine from `model` in the same rank actors (vLLM is already imported there):
        the old one is released on every rank first."""
        ray.get([r.stop.remote() for r in self.ranks], timeout=timeout_s)
        self.start(model, llm_kwargs, timeout_s)

    def generate(
        self, prompts: Sequence[Sequence[int]], timeout_s: float = 300.0, lora_request=None, **sampling
    ) -> list[dict]:
        """Generate on every rank together; rank 0's outputs (`sampling`: `SamplingParams` fields;
        `lora_request`: vLLM's `LoRARequest` of an adapter, e.g. `WeightSync.lora_request()`)."""
        calls = [r.generate.remote(prompts, sampling, lora_request) for r in self.ranks]
        return ray.get(calls, timeout=timeout_s)[0]

    def versions(self, timeout_s: float = 60.0) -> list[int | None]:
        return ray.get([r.version.remote() for r in self.ranks], timeout=timeout_s)

    def shutdown(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)
