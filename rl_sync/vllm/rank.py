"""One rank of a running vLLM engine as a sync destination (no Ray here).

`VllmDestinations` binds the trainers' checkpoint to the engine rank's live
model (`rl_sync.vllm.binding`) and, after each round, runs what vLLM would run
after loading those weights (`rl_sync.vllm.reload`). It is used inside a Ray
actor that owns an `LLM` with one tensor-parallel rank (external launcher,
`actors.vllm`) and inside vLLM's own worker processes (the weight-transfer
backend, `rl_sync.vllm.backend`).

Side ranks: the workers of a sync group are listed engine by engine, each
engine's ranks in tensor-parallel order, so worker `side_rank` of `side_size`
is TP rank `side_rank % tp` of engine `side_rank // tp`.

Typical use::

    dests = VllmDestinations(model, vllm_config)
    destinations = dests.bind(checkpoint, side_rank=1, side_size=2)   # collective over the engine
    ...   # a round writes into destinations
    dests.after_update(names=None)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from ..storage import Destination
from .binding import Checkpoint, EngineRank, ParamReport, VllmBinding


def engine_rank() -> EngineRank:
    """This process's rank in its vLLM engine's tensor-parallel group, with an all-gather of
    Python objects over that group's CPU (Gloo) communicator."""
    import torch.distributed as dist
    from vllm.distributed import get_tp_group

    group = get_tp_group()

    def exchange(obj: object) -> list:
        if group.world_size == 1:
            return [obj]
        out: list = [None] * group.world_size
        dist.all_gather_object(out, obj, group=group.cpu_group)
        return out

    return EngineRank(group.rank_in_group, group.world_size, exchange)


def engine_rank_of(vllm_config, side_rank: int, side_size: int) -> EngineRank:
    """This process's `engine_rank()`, checked against worker `side_rank` of `side_size` (see
    the module docstring); `ValueError` for a pipeline-parallel engine or workers out of order."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            f"vLLM worker {side_rank}: pipeline parallel engines (size "
            f"{parallel.pipeline_parallel_size}) are not supported; use tensor parallelism"
        )
    where = engine_rank()
    if side_size % where.size or side_rank % where.size != where.rank:
        raise ValueError(
            f"vLLM worker {side_rank} of {side_size} is TP rank {where.rank} of {where.size}; pass "
            "the workers engine by engine, each engine's ranks in tensor-parallel order"
        )
    return where


class VllmDestinations:
    """Destinations in one vLLM rank's live model and the processing after each round."""

    def __init__(self, model: torch.nn.Module, vllm_config):
        self.model, self.vllm_config = model, vllm_config
        self.binding: VllmBinding | None = None

    @classmethod
    def of_llm(cls, llm) -> VllmDestinations:
        """For an `LLM` whose worker runs in this process (external launcher, or
        `VLLM_ENABLE_V1_MULTIPROCESSING=0` with one rank)."""
        return cls(llm.collective_rpc("get_model")[0], llm.llm_engine.vllm_config)

    def _context(self):
        from vllm.config import set_current_vllm_config

        return set_current_vllm_config(self.vllm_config)

    def bind(
        self,
        checkpoint: Checkpoint,
        side_rank: int,
        side_size: int,
        sharded: Mapping[str, Sequence[int]] | None = None,
        next_writes_all: bool = False,
    ) -> dict[str, Destination]:
        """Resolve every checkpoint name (collective over the engine's ranks; see the module
        docstring for how side ranks map to engines). `sharded[name]`: the dims a fused tensor is
        never cut along (`rl_sync.planning.parts.uncuttable_dims`); `next_writes_all`: the next
        round writes every bound element (`DescribeOptions.next_writes_all`)."""
        where = engine_rank_of(self.vllm_config, side_rank, side_size)
        with self._context():
            self.binding = VllmBinding.build(
                self.model,
                self.vllm_config.model_config,
                checkpoint,
                where,
                engines=side_size // where.size,
                sharded=sharded,
                seeded=not next_writes_all,
            )
        return self.binding.destinations

    @property
    def reports(self) -> list[ParamReport]:
        """How each checkpoint name is written on this rank (direct, reload, fallback)."""
        return [] if self.binding is None else list(self.binding.reports)

    def write_modes(self) -> dict[str, str]:
        """`{name: "direct" | "reload" | "fallback"}` on this rank."""
        return {r.name: r.mode for r in self.reports}

    def swappable(self) -> list[str]:
        """The names a double-buffered commit may swap with their shadows (`rl_sync.rank.shadow`):
        those received into rl-sync's own loader-form buffers (`reload`: only rl-sync reads them),
        and those written in place (`direct`) when the engine runs eagerly without sleep mode (no
        CUDA graph holds their addresses, no allocator of vLLM's tracks their memory)."""
        eager = self._addresses_free()
        return [r.name for r in self.reports if r.mode == "reload" or (r.mode == "direct" and eager)]

    def _addresses_free(self) -> bool:
        """Whether the engine runs eagerly without sleep mode: no CUDA graph holds its weights'
        addresses and no allocator of vLLM's tracks their memory, so it may be swapped."""
        config = self.vllm_config.model_config
        return config.enforce_eager and not config.enable_sleep_mode

    def load_fallbacks(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        assert self.binding is not None  # rounds follow `bind`
        with self._context():
            self.binding.processor.load_fallbacks(pairs)

    def prepare(self, names: Collection[str] | None, spare: Callable[[torch.Tensor], torch.Tensor | None]) -> int:
        """Before a double-buffered round's commit: process twins of the modules it touches from
        their buffers' next values (`rl_sync.vllm.reload.Processor.prepare`)."""
        assert self.binding is not None  # rounds follow `bind`
        with self._context():
            return self.binding.processor.prepare(names, spare)

    def after_update(self, names: Collection[str] | None) -> int:
        """vLLM's post-load processing for what a round wrote; returns modules processed."""
        assert self.binding is not None  # rounds follow `bind`
        with self._context():
            return self.binding.processor.after_update(names, swap=self._addresses_free())
