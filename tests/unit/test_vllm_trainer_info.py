"""`RlSyncTrainerInitInfo`: what selects rl-sync through vLLM's trainer factory, and bad input."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm.distributed.weight_transfer.factory")

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory

from rl_sync.config.sync import SyncConfig
from rl_sync.vllm.trainer import RlSyncTrainerEngine, RlSyncTrainerInitInfo, ShardedModuleSource


def test_building_the_init_info_registers_the_trainer_engine_with_vllms_factory():
    RlSyncTrainerInitInfo(rank=0)
    assert WeightTransferTrainerFactory._registry["rl_sync"]() is RlSyncTrainerEngine


@pytest.mark.parametrize(
    "fields, error, message",
    [
        (dict(rank=2, num_trainer_ranks=2), ValueError, r"rank must be in \[0, 2\) \(num_trainer_ranks\), got 2"),
        (dict(rank=0, num_trainer_ranks=0), ValueError, r"num_trainer_ranks must be at least 1, got 0"),
        (dict(rank=0, engine_ranks=True), TypeError, r"engine_ranks must be an int, got True"),
        (dict(rank=0, sync={"mode": "auto"}), TypeError, r"sync must be a SyncConfig, got dict"),
    ],
)
def test_bad_init_info_is_refused_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        RlSyncTrainerInitInfo(**fields)


def test_a_source_that_is_not_a_weight_source_is_refused_before_anything_starts():
    with pytest.raises(TypeError, match=r"source must be a vLLM WeightSource .* got dict"):
        WeightTransferTrainerFactory.trainer_init(
            RlSyncTrainerInitInfo(rank=0, sync=SyncConfig(rendezvous_host="127.0.0.1")), client=object(), source={}
        )


def test_the_sharded_source_yields_parameters_as_they_are_with_global_metadata():
    model = torch.nn.Linear(4, 3)
    source = ShardedModuleSource(model)
    assert [(m.name, m.shape) for m in source.metadata()] == [("weight", (3, 4)), ("bias", (3,))]
    assert [t for _, t in source] == [model.weight, model.bias]
    assert [m.name for m in ModuleSource(model).metadata()] == [m.name for m in source.metadata()]
