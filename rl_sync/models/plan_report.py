"""The planner report: plan a synthetic model and measure what planning costs.

`rl-sync plan configs/plan_kimi_k2.yaml` runs `plan_report` and prints
`format_report`: seconds and peak memory to plan, the size of the message
every rank receives, how long the busiest rank takes to expand its slice, and
the plan statistics (bytes per rank, transfer counts, busiest source against
its lower bound, and what the broadcast baseline would move). With `--links
LINKS.yaml` (a `simulate.LinkModel`) it adds the predicted round seconds and
the bottleneck, sent directly and relayed among engine replicas (`rl_sync.planning.relay`).
"""

from __future__ import annotations

import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from ..config.sync import MAX_BUCKET_BYTES, check_int
from ..planning.plan import PlanStats, plan_model
from ..planning.schedule import Schedule, build_schedule
from ..planning.simulate import LinkModel, Prediction, predict
from ..wire.codec import decode, encode
from ..wire.plan_info import PlanInfo
from .config import ModelConfig, Parallel
from .synthetic import TrainerParallel, model_specs


@dataclass(frozen=True, kw_only=True)
class PlanReportConfig:
    """A synthetic model and its two parallel layouts."""

    model: ModelConfig
    """Architecture shapes (its `family` picks the binding rules that lay the engines out)."""
    trainer: TrainerParallel
    """Trainer ranks and their sharding."""
    inference: Parallel
    """Engines, pipeline stages, tensor and expert parallelism."""
    bucket_bytes: int = 256 << 20
    """Per-rank bytes (sent + received) in one bucket."""
    coalesce_bytes: int = 1 << 20
    """Segments under this size share one packed message per peer."""

    def __post_init__(self) -> None:
        """Bounded before any planning: the fields, and the products planning time grows with."""
        check_int("PlanReportConfig.bucket_bytes", self.bucket_bytes, 1, MAX_BUCKET_BYTES)
        check_int("PlanReportConfig.coalesce_bytes", self.coalesce_bytes, 0, MAX_BUCKET_BYTES)
        pairs = self.trainer.ranks * self.inference.size
        if pairs > MAX_RANK_PAIRS:
            raise ValueError(
                f"trainer.ranks x inference ranks (engines x pp x tp) = {self.trainer.ranks} x "
                f"{self.inference.size} = {pairs}, more than the {MAX_RANK_PAIRS} rl-sync plan takes; plan "
                "fewer ranks on one side"
            )
        per_layer = max(1, self.model.experts)
        if self.model.layers * per_layer > MAX_LAYER_EXPERTS:
            raise ValueError(
                f"model.layers x model.experts = {self.model.layers} x {per_layer} = "
                f"{self.model.layers * per_layer}, more than the {MAX_LAYER_EXPERTS} rl-sync plan takes"
            )


MAX_RANK_PAIRS = 1 << 20
"""Bound on trainer ranks x inference ranks: one template holds up to that many transfers."""
MAX_LAYER_EXPERTS = 1 << 16
"""Bound on layers x routed experts (each expert of each layer is three checkpoint tensors); a
Kimi-K2-shaped model has 61 x 384."""
MAX_TRANSFERS = 1 << 26
"""Bound on a plan's transfers before it is scheduled, encoded and expanded (Kimi-K2 on 256 + 128
ranks: 23M)."""


@dataclass(frozen=True)
class PlanReport:
    """Measured figures of one planner run."""

    parameters: int
    tensors: int
    templates: int
    buckets: int
    plan_seconds: float
    schedule_seconds: float
    peak_rss_bytes: int
    added_rss_bytes: int
    message_bytes: int
    uncompressed_message_bytes: int
    decode_seconds: float
    slice_rank: int
    slice_seconds: float
    slice_segments: int
    stats: PlanStats
    prediction: Prediction | None = None
    """The round under `plan_report`'s `links`, when given."""
    relay_prediction: Prediction | None = None
    """The same round relayed among engine replicas (`rl_sync.planning.relay`), when the plan can."""
    replicas: int = 1
    """Engine replicas the relay chains run through."""

    @property
    def total_seconds(self) -> float:
        return self.plan_seconds + self.schedule_seconds


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


STEPS = ("model specs", "plan + statistics", "schedule", "encode", "decode + rebuild on a rank", "expand its slice")


def plan_report(
    cfg: PlanReportConfig, step: Callable[[str], None] = lambda name: None, links: LinkModel | None = None
) -> PlanReport:
    """Plan `cfg`'s model as the coordinator would, then expand the busiest rank, and predict
    the round under `links` if given.

    `step(name)` is called as each of `STEPS` starts (for a progress display)."""
    step(STEPS[0])
    specs = model_specs(cfg.model, cfg.trainer, cfg.inference)
    rss_before = _rss_bytes()
    step(STEPS[1])
    start = time.perf_counter()
    plan = plan_model(specs)
    stats = plan.stats
    if stats.num_transfers > MAX_TRANSFERS:
        raise ValueError(
            f"this plan holds {stats.num_transfers} transfers, more than the {MAX_TRANSFERS} rl-sync plan "
            "schedules; plan fewer trainer or inference ranks"
        )
    planned = time.perf_counter()
    step(STEPS[2])
    schedule = build_schedule(plan, cfg.bucket_bytes, cfg.coalesce_bytes)
    scheduled = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    step(STEPS[3])
    info = PlanInfo.from_schedule(schedule)
    blob, raw = encode(info, compress=True), encode(info)
    busiest = max(stats.recv_bytes, key=stats.recv_bytes.__getitem__, default=0)
    step(STEPS[4])
    begin = time.perf_counter()
    rebuilt = decode(PlanInfo, blob).to_schedule()
    decoded = time.perf_counter()
    step(STEPS[5])
    mine = rebuilt.rank_slice(busiest)
    sliced = time.perf_counter()
    return PlanReport(
        parameters=sum(math.prod(s.shape) for s in specs),
        tensors=len(specs),
        templates=len(plan.templates),
        buckets=schedule.num_buckets,
        plan_seconds=planned - start,
        schedule_seconds=scheduled - planned,
        peak_rss_bytes=peak,
        added_rss_bytes=max(0, peak - rss_before),
        message_bytes=len(blob),
        uncompressed_message_bytes=len(raw),
        decode_seconds=decoded - begin,
        slice_rank=busiest,
        slice_seconds=sliced - decoded,
        slice_segments=sum(len(m.segments) for b in mine.buckets for m in b.sends + b.recvs),
        stats=stats,
        **(_predictions(schedule, cfg, links) if links else {}),
    )


class _Predictions(TypedDict, total=False):
    """`PlanReport`'s prediction fields, as `_predictions` fills them."""

    prediction: Prediction
    relay_prediction: Prediction
    replicas: int


def _predictions(schedule: Schedule, cfg: PlanReportConfig, links: LinkModel) -> _Predictions:
    """The round under `links` sent directly (`schedule`), and relayed when the plan has engine replicas."""
    plan = schedule.plan
    out: _Predictions = {"prediction": predict(schedule, links, cfg.trainer.ranks)}
    relayed = Schedule(plan, cfg.bucket_bytes, cfg.coalesce_bytes, relay=True)
    if relayed.relay is not None:
        out["relay_prediction"] = predict(relayed, links, cfg.trainer.ranks)
        out["replicas"] = relayed.relay.replicas
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB"


def format_report(name: str, r: PlanReport) -> str:
    """Human-readable lines for `plan_report`'s result."""
    s = r.stats
    recv = sorted(s.recv_bytes.values()) or [0]
    send = sorted(s.send_bytes.values()) or [0]
    rows = [
        ("model", f"{name}: {r.parameters / 1e9:,.2f}B parameters, {r.tensors:,} tensors, {r.templates} templates"),
        ("plan + stats", f"{r.plan_seconds:.3f} s"),
        ("schedule", f"{r.schedule_seconds:.3f} s ({r.buckets} buckets)"),
        ("total", f"{r.total_seconds:.3f} s"),
        (
            "peak memory",
            f"{r.peak_rss_bytes / 2**20:,.0f} MiB RSS ({r.added_rss_bytes / 2**20:,.0f} MiB added by planning)",
        ),
        (
            "plan message",
            f"{r.message_bytes / 2**20:.2f} MiB to every rank ({r.uncompressed_message_bytes / 2**20:.2f} MiB "
            f"uncompressed)",
        ),
        (
            "rank expansion",
            f"rank {r.slice_rank}: decode + rebuild {r.decode_seconds:.3f} s, "
            f"own slice {r.slice_seconds:.3f} s, {r.slice_segments:,} segments",
        ),
        ("transfers", f"{s.num_transfers:,} ({_gb(s.total_bytes)} on the wire)"),
        ("send per rank", f"max {_gb(send[-1])}, min {_gb(send[0])}, over {len(send)} ranks"),
        ("recv per rank", f"max {_gb(recv[-1])}, min {_gb(recv[0])}, over {len(recv)} ranks"),
        (
            "transfer counts",
            f"max sent {max(s.send_counts.values(), default=0):,}, "
            f"max received {max(s.recv_counts.values(), default=0):,}",
        ),
        ("busiest source", f"{_gb(s.busiest_source_bytes)} = {s.busiest_over_bound:.3f} x lower bound"),
        (
            "broadcast would",
            f"move {_gb(s.broadcast_bytes)} ({s.broadcast_bytes / max(1, s.total_bytes):.1f}x), "
            f"{_gb(s.broadcast_recv_bytes)} into the busiest worker",
        ),
    ]
    if r.prediction:
        rows.append(
            (
                "predicted round",
                f"{r.prediction.seconds:.3f} s over {len(r.prediction.bucket_seconds)} buckets, "
                f"direct; bottleneck {r.prediction.bottleneck}",
            )
        )
        relayed = r.relay_prediction
        rows.append(
            (
                "relayed round",
                "no tensor is replicated over engine replicas"
                if relayed is None
                else f"{relayed.seconds:.3f} s over {len(relayed.bucket_seconds)} buckets, relayed through "
                f"{r.replicas} replicas; bottleneck {relayed.bottleneck}",
            )
        )
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
