"""An inference-style model written for rl-sync's tests and examples: fused
qkv and gate_up projections, column/row-parallel linears, vocab-parallel
embedding and head, expert-parallel MoE, pipeline stages (`tp_model`); synthetic models
planned without weights (`synthetic`) and the planner report on them (`plan_report`)."""

from .config import ModelConfig, Parallel
from .tp_model import TPModel

__all__ = ["ModelConfig", "Parallel", "TPModel"]
