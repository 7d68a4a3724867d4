"""One rank's side of a sync group: its schedule, transport, staging and rounds.

Typical use (what the Ray mixins do)::

    session = RankSession(init_info, plan_info, bind_host="127.0.0.1", device=torch.device("cpu"))
    stats = session.run(round_info, sources={...}, dests={...})   # every round
    session.close()

The transport is the one `init_info` names, joined from its rendezvous message
(`rl_sync.transport.registry`); one that reaches this rank's destinations itself
(`cuda_ipc`: a colocated worker's mapped memory) supplies them in place of `dests`.

Ordering contract: every rank of the group runs the same rounds in the same
order; within a round, buckets go in schedule order (`runner.run_buckets`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config.sync import SPARSE_MODES
from ..planning.parts import parse_part
from ..planning.plan import ModelPlan
from ..planning.quant import is_scale_name, scale_name, scaled_name
from ..planning.schedule import RankSchedule
from ..rendezvous import derive
from ..transport.base import Transport
from ..transport.digest import Digester, DigestTransport
from ..transport.registry import join
from ..wire.messages import InitInfo, RankStats, Role, RoundInfo
from ..wire.plan_info import PlanInfo
from .broadcast import ROOT, BroadcastStaging, gather_schedule, run_broadcast
from .endpoint import Endpoint
from .quantize import QuantStage
from .runner import BucketError, BucketIO, Counters, Program, compile_program, deadline_in, run_program
from .sparse_round import BucketViews, SparseCounters, SparseIO, run_sparse_bucket

MAX_PROGRAMS = 4
"""Subsets a session keeps compiled rounds (per face, `FACES`) and expanded rank slices for: the
full round plus recent subsets."""
FACES = 2
"""Mappings of the transport's own destinations a session keeps endpoints for: a colocated worker
whose commits swap alternates between two (`rl_sync.transport.cuda_ipc`)."""


def join_group(info: InitInfo, bind_host: str, device: torch.device) -> Transport:
    """Join the group `info` describes with the transport it names, from its rendezvous message."""
    return join(
        info.transport,
        info.rendezvous,
        info,
        bind_host=bind_host,
        device=device,
        broadcast_ranks=sorted({ROOT, *info.worker_ranks}),
    )


def checked(transport: Transport, info: InitInfo) -> Transport:
    """`transport` with the digest `info.integrity` asks for on every transfer (none in a
    one-rank group: nothing travels)."""
    if info.integrity == "off" or info.world_size == 1:
        return transport
    key = derive(info.secret, b"digest", info.prefix.encode())
    return DigestTransport(transport, Digester(info.integrity, key, label=info.prefix.encode()))


def part_endpoint(endpoints: Mapping[str, Endpoint], name: str) -> Endpoint | None:
    """A source endpoint for part `name` (`rl_sync.planning.parts`): the view of the whole tensor's
    shard that lies in the part, in the part's coordinates (the shard's rows of a cut dim the
    trainers shard; the part's rows where the shard holds that dim whole); None where the shard
    holds none of it."""
    found = parse_part(name)
    whole = None if found is None else endpoints.get(found[0])
    if found is None or whole is None:
        return None
    _, dim, start, stop = found
    first = whole.origin[dim]
    lo, hi = max(start, first), min(stop, first + whole.tensor.shape[dim])
    if hi <= lo:
        return None
    origin = whole.origin[:dim] + (lo - start,) + whole.origin[dim + 1 :]
    return Endpoint(whole.tensor.narrow(dim, lo - first, hi - lo), origin)


def plan_endpoints(plan: ModelPlan, rank: int, endpoints: Mapping[str, Endpoint], side: str) -> dict[int, Endpoint]:
    """`rank`'s endpoints by tensor index of `plan` (`side`: "source" or "destination"); refused,
    naming the tensor, where one the plan needs is missing or covers another box."""
    out = {}
    for i, spec in enumerate(plan.specs):
        layout = spec.src if side == "source" else spec.dst
        box = layout.local_box(spec.shape, rank)
        if box is None or box.is_empty():
            continue
        endpoint = endpoints.get(spec.name)
        if endpoint is None and side == "source":
            endpoint = part_endpoint(endpoints, spec.name)
        if endpoint is None:
            raise ValueError(f"rank {rank}: the plan needs {side} tensor {spec.name!r} here, but it was not provided")
        if endpoint.origin != box.offsets or tuple(endpoint.tensor.shape) != box.sizes:
            raise ValueError(
                f"rank {rank}: {side} tensor {spec.name!r} covers {tuple(endpoint.tensor.shape)} at "
                f"{endpoint.origin}, the plan expects {box}"
            )
        out[i] = endpoint
    return out


@dataclass
class _SparseKept:
    """What a subset's sparse rounds keep while `sources`, `dests` and `baselines` stay the same
    objects: the endpoints by tensor index (`src`, `dst`) and each bucket's views."""

    sources: Mapping
    dests: Mapping
    baselines: dict[int, Endpoint] | None
    src: dict[int, Endpoint]
    dst: dict[int, Endpoint]
    views: list[BucketViews | None]


class RankSession:
    """Joined to the group; runs rounds between `sources` and `dests` endpoints."""

    def __init__(self, info: InitInfo, plan: PlanInfo, *, bind_host: str, device: torch.device):
        self.info, self.rank = info, info.rank
        self.schedule = plan.to_schedule()
        self.plan = self.schedule.plan
        sends = info.rank < info.num_trainers
        self.role: Role = "both" if sends and info.rank in info.worker_ranks else "trainer" if sends else "worker"
        self.names = [s.name for s in self.plan.specs]
        self.dtypes = [getattr(torch, s.dtype) for s in self.plan.specs]
        self.device = torch.device(device)
        self._gather = None
        self._programs: dict[tuple, tuple[Mapping, Mapping, Program]] = {}
        self._slices: dict[tuple | None, RankSchedule] = {}
        self._sparse: dict[tuple, _SparseKept] = {}
        self.compiles = 0
        """Rounds compiled so far; replayed rounds do not count."""
        self.baselines: dict[int, Endpoint] | None = None
        self.broadcast_staging = BroadcastStaging(self.device)
        self.quant = QuantStage(self.plan, self.plan.blocks, self.rank) if sends and self.plan.blocks else None
        """Trainers quantize block-quantized tensors before every round (`engine.quantize`)."""
        self.joined = join_group(info, bind_host, device)
        """The transport as joined; `transport` is it with the digest `info.integrity` asks for."""
        self.transport = checked(self.joined, info)
        self._reached: dict[int, tuple[Mapping[str, torch.Tensor], dict[str, Endpoint]]] = {}
        """The transport's own destinations (`Transport.destinations`: at most `FACES` mappings that
        alternate) and the endpoints over each, by the mapping's `id`."""

    def _destinations(self, dests: Mapping[str, Endpoint]) -> Mapping[str, Endpoint]:
        """`dests`, unless the transport reaches this rank's destinations itself: then endpoints
        over those, built once per mapping so the compiled round replays."""
        views = self.transport.destinations()
        if not views:
            return dests
        reached = self._reached.get(id(views))
        if reached is None or reached[0] is not views:
            if len(self._reached) >= FACES:
                self._reached.pop(next(iter(self._reached)))
            reached = self._reached[id(views)] = (views, self._endpoints_over(views))
        return reached[1]

    def _endpoints_over(self, views: Mapping[str, torch.Tensor]) -> dict[str, Endpoint]:
        """Endpoints for live views of this rank's destination boxes."""
        out = {}
        for name, view in views.items():
            spec = self.plan.specs[self.plan.index[name]]
            box = spec.dst.local_box(spec.shape, self.rank)
            if box is not None:
                out[name] = Endpoint(view, box.offsets)
        return out

    def _indices(self, endpoints: Mapping[str, Endpoint], side: str) -> dict[int, Endpoint]:
        return plan_endpoints(self.plan, self.rank, endpoints, side)

    def run(self, round_info: RoundInfo, sources: Mapping[str, Endpoint], dests: Mapping[str, Endpoint]) -> RankStats:
        """Run one round between the transport's `begin_round` and `end_round`; raises
        `BucketError` naming the round, bucket and tensors on failure.

        Any failure aborts this rank's transport first, so its peers fail fast
        instead of waiting out their timeout."""
        start = time.perf_counter()
        context = f"round {round_info.version} ({round_info.mode})"
        try:
            self.transport.begin_round()
            counters = self._run(round_info, sources, self._destinations(dests), context)
            self.transport.end_round()
        except Exception as exc:
            self.transport.abort()
            if isinstance(exc, BucketError):
                raise
            raise BucketError(f"rank {self.rank}, {context}: {type(exc).__name__}: {exc}") from exc
        return self.stats(round_info, counters, time.perf_counter() - start)

    def stats(self, round_info: RoundInfo, counters: Counters, seconds: float) -> RankStats:
        """What this rank did in `round_info`'s round: `counters` over `seconds`."""
        sparse = counters if isinstance(counters, SparseCounters) else SparseCounters()
        return RankStats(
            rank=self.rank,
            role=self.role,
            version=round_info.version,
            mode=round_info.mode,
            seconds=seconds,
            sent_bytes=counters.sent_bytes,
            received_bytes=counters.received_bytes,
            zero_copy_bytes=counters.zero_copy_bytes,
            staged_bytes=counters.staged_bytes,
            local_bytes=counters.local_bytes,
            messages=counters.messages,
            buckets=counters.buckets,
            staging_bytes=self.staging_bytes,
            baseline_bytes=self.baseline_bytes,
            dense_bytes=sparse.dense_bytes,
            changed_elements=sparse.changed,
            encodings=sparse.encodings,
            placed_buckets=sparse.placed,
        )

    @property
    def baseline_bytes(self) -> int:
        return sum(e.tensor.numel() * e.tensor.element_size() for e in (self.baselines or {}).values())

    @property
    def staging_bytes(self) -> int:
        return self.broadcast_staging.nbytes + sum(p.staging_bytes for _, _, p in self._programs.values())

    def _run(self, round_info: RoundInfo, sources, dests, context: str) -> Counters:
        deadline = deadline_in(round_info.timeout_s)
        unknown = [n for n in round_info.names or () if n not in self.plan.index]
        if unknown:
            raise ValueError(
                f"rank {self.rank}: round {round_info.version} names tensors {unknown[:4]} the plan does not hold"
            )
        wanted = None if round_info.names is None else self._paired({self.plan.index[n] for n in round_info.names})
        if self.quant is not None:
            shards, sources = sources, self.quant.endpoints(sources)
            self.quant.run(shards, self.transport, deadline, wanted)
        if round_info.mode in SPARSE_MODES:
            return self._run_sparse(round_info, wanted, sources, dests, deadline, context)
        if round_info.mode == "broadcast":
            src, dst = self._indices(sources, "source"), self._indices(dests, "destination")
            counters = run_broadcast(
                self._gather_schedule(),
                self.plan,
                self.rank,
                src,
                dst,
                self.dtypes,
                self.transport,
                self.broadcast_staging,
                deadline,
                wanted,
            )
        else:
            counters = run_program(
                self._program(wanted, sources, dests), self.transport, deadline, names=self.names, context=context
            )
        if round_info.baseline:
            self._refresh_baselines(self._indices(sources, "source"), wanted)
        return counters

    def _paired(self, wanted: set[int]) -> tuple[int, ...]:
        """A round's tensors with each block-quantized tensor's values and scales together (the
        scales change with the values, and are computed only with them)."""
        for i in list(wanted):
            name = self.plan.specs[i].name
            if i in self.plan.blocks:
                wanted.add(self.plan.index[scale_name(name)])
            elif is_scale_name(name) and scaled_name(name) in self.plan.index:
                wanted.add(self.plan.index[scaled_name(name)])
        return tuple(sorted(wanted))

    def _refresh_baselines(self, src: dict[int, Endpoint], wanted: tuple[int, ...] | None) -> None:
        """After a dense round: the last synced values are the current ones."""
        if self.baselines is None:
            self.baselines = {
                i: Endpoint(self._baseline_like(e.tensor, self.dtypes[i]), e.origin) for i, e in src.items()
            }
        for i, endpoint in src.items():
            if wanted is None or i in wanted:
                self.baselines[i].tensor.copy_(endpoint.tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _baseline_like(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A baseline of a source shard, in the wire's dtype (what the receivers hold)."""
        if self.info.sparse_baseline == "pinned_cpu" and tensor.is_cuda:
            return torch.empty(tensor.shape, dtype=dtype, pin_memory=True)
        return torch.empty(tensor.shape, dtype=dtype, device=tensor.device)

    def _run_sparse(
        self, round_info: RoundInfo, wanted, sources, dests, deadline: float, context: str
    ) -> SparseCounters:
        kept = self._sparse_kept(wanted, sources, dests)
        if kept.src and self.baselines is None:
            raise ValueError(
                f"rank {self.rank}: a {round_info.mode} round needs the baselines a dense round leaves; "
                "the coordinator runs the first round dense"
            )
        mine = self._slice(wanted)
        forwards = frozenset(m.relay for b in mine.buckets for m in b.sends if m.relay is not None)
        auto = round_info.mode == "auto"
        io = SparseIO(kept.src, self.baselines or {}, kept.dst, self.dtypes, allow_dense=auto, forwards=forwards)
        counters = SparseCounters()
        for i, bucket in enumerate(mine.buckets):
            views = kept.views[i] = kept.views[i] or BucketViews.of(bucket, io)
            run_sparse_bucket(bucket, io, self.transport, deadline, counters, self.names, views)
        self.transport.finish(deadline)
        return counters

    def _sparse_kept(self, wanted: tuple[int, ...] | None, sources: Mapping, dests: Mapping) -> _SparseKept:
        """This subset's endpoints by tensor index and each bucket's views (None until its first round
        builds them), kept while the endpoint mappings and the baselines are the same objects, as
        compiled rounds are: a sparse round then neither walks the plan's tensors nor slices a view."""
        key = self._key(wanted, dests)
        kept = self._sparse.get(key)
        if kept is not None and kept.sources is sources and kept.dests is dests and kept.baselines is self.baselines:
            return kept
        self._sparse.pop(key, None)
        src, dst = self._indices(sources, "source"), self._indices(dests, "destination")
        kept = _SparseKept(sources, dests, self.baselines, src, dst, [None] * len(self._slice(wanted).buckets))
        if len(self._sparse) >= MAX_PROGRAMS * FACES:
            self._sparse.pop(next(iter(self._sparse)))
        self._sparse[key] = kept
        return kept

    def _key(self, wanted: tuple[int, ...] | None, dests: Mapping) -> tuple:
        """What a subset's compiled round is kept under: the subset, and which face of the
        transport's own destinations it writes (they alternate, `FACES`), if it writes those."""
        return (wanted, id(dests) if any(dests is e for _, e in self._reached.values()) else None)

    def _slice(self, wanted: tuple[int, ...] | None) -> RankSchedule:
        """This rank's buckets for a tensor subset, expanded once (sparse rounds replay it)."""
        if wanted not in self._slices:
            if len(self._slices) >= MAX_PROGRAMS:
                self._slices.pop(next(iter(self._slices)))
            self._slices[wanted] = self.schedule.rank_slice(self.rank, wanted)
        return self._slices[wanted]

    def _program(self, wanted: tuple[int, ...] | None, sources: Mapping, dests: Mapping) -> Program:
        """The compiled round for this subset, rebuilt only when the endpoint mappings change (one
        per face of the transport's own destinations, which alternate)."""
        key = self._key(wanted, dests)
        cached = self._programs.get(key)
        if cached is not None and cached[0] is sources and cached[1] is dests:
            return cached[2]
        self._programs.pop(key, None)
        src, dst = self._indices(sources, "source"), self._indices(dests, "destination")
        io = BucketIO(lambda _b, t: src[t], lambda _b, t: dst[t], self.dtypes)
        program = compile_program(self._slice(wanted).buckets, io, self.device)
        self.compiles += 1
        if len(self._programs) >= MAX_PROGRAMS * FACES:
            self._programs.pop(next(iter(self._programs)))
        self._programs[key] = (sources, dests, program)
        return program

    def _gather_schedule(self):
        if self._gather is None:
            self._gather = gather_schedule(self.plan, self.schedule.bucket_bytes, self.schedule.coalesce_bytes)
        return self._gather

    def close(self) -> None:
        self.transport.close()
        self._programs.clear()
        self._sparse.clear()
