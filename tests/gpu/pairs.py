"""Trainer / worker actor pairs for the GPU tests, and checks of what the workers hold."""

from __future__ import annotations

import torch

from . import builders

CONFIG = dict(rendezvous_host="127.0.0.1", bind_host="127.0.0.1", init_timeout_s=120.0, round_timeout_s=120.0)
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def check(ray, workers, size: int, version: int) -> None:
    for rank, w in enumerate(workers):
        got = ray.get(w.call.remote(builders.read))
        for name, want in builders.expected(rank, size, version).items():
            assert torch.equal(got[name], want), f"worker {rank}: {name} differs at version {version}"


def set_versions(ray, trainers, version: int) -> None:
    """Every trainer's shards at `version` (`builders.set_version`)."""
    ray.get([t.call.remote(builders.set_version, version) for t in trainers])


def pushed(ray, sync, trainers, workers, version: int) -> str:
    """Every trainer at `version`, one `push(mode="sparse")`, every worker checked bit-exact; the
    mode that ran."""
    set_versions(ray, trainers, version)
    mode = sync.push(mode="sparse").mode
    check(ray, workers, len(workers), version)
    return mode


def sparse_rounds(ray, sync, trainers, workers, versions=(1, 2, 3)) -> list[str]:
    """`pushed` for each version; the modes that ran."""
    return [pushed(ray, sync, trainers, workers, version) for version in versions]


def release(ray, pg, actors) -> None:
    for actor in actors:
        ray.kill(actor)
    ray.util.remove_placement_group(pg)


def pairs(
    ray,
    gpus_each: float,
    count: int,
    same_gpu: bool,
    worker_build=builders.worker_build,
    trainer_env: dict | None = None,
    worker_env: dict | None = None,
):
    """`count` trainers and workers: worker i on trainer i's GPU (`same_gpu`) or on one of its own;
    `*_env` sets environment variables of one side's processes (e.g. `EXPANDABLE`)."""
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from actors.ready import InferenceWorker, TrainerActor

    bundles = [{"GPU": 1, "CPU": 1} for _ in range(count if same_gpu else 2 * count)]
    pg = placement_group(bundles, strategy="PACK")
    ray.get(pg.ready(), timeout=120)

    def opts(i, env):
        out = {
            "num_gpus": gpus_each,
            "num_cpus": 0.25,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
        }
        if env:
            out["runtime_env"] = {"env_vars": env}
        return out

    Trainer, Worker = ray.remote(TrainerActor), ray.remote(InferenceWorker)
    trainers = [
        Trainer.options(**opts(i, trainer_env)).remote(i, count, builders.trainer_build()) for i in range(count)
    ]
    workers = [
        Worker.options(**opts(i if same_gpu else count + i, worker_env)).remote(i, count, worker_build)
        for i in range(count)
    ]
    return pg, trainers, workers
