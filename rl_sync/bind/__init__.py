"""Bind checkpoint names to live inference storage with declarative rules."""

from .binder import Binder, Binding
from .rules import BUILTIN, DENSE_RULES, FUSED, MOE_RULES, Rule

__all__ = ["BUILTIN", "DENSE_RULES", "FUSED", "MOE_RULES", "Binder", "Binding", "Rule"]
