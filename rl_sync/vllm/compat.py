"""What differs between the vLLM releases rl-sync supports, in one place.

rl-sync is written against vLLM 0.32 (the CPU build CI runs) and runs on 0.26
too (the CUDA build the offline GPU machines carry). Four differences matter,
each detected by what the installed vLLM has, never by its version string:

* **Tensors loaded but never put on meta.** 0.32 splits the names its layerwise
  reload skips into `SKIP_LOAD_TENSORS` (never loaded) and `SKIP_TENSORS` (never
  moved to meta: those plus a linear layer's `bias`, made after its weights);
  0.26 has only `SKIP_TENSORS`, and moves `bias` to meta with the rest.
* **Attention layers processed after the rest.** 0.32 asks
  `is_deferred_attention_layer`; 0.26 processes `Attention` and `MLAAttention`
  last.
* **The renames a LoRA adapter's names go through.** 0.32's LoRA loader takes
  the model's `hf_to_vllm_mapper.get_rename_mapper()`; 0.26's takes
  `get_unstacked_mapper()` (stacked maps dropped, as the later one drops them).
* **A backend's trainer-side call.** 0.26 declares
  `WeightTransferEngine.trainer_send_weights` abstract, so every backend class
  defines it (`TRAINER_SEND_REFUSED` says what rl-sync's does instead); 0.29+
  has a trainer-side factory instead (`trainer_factory`), where rl-sync's
  trainer engine (`rl_sync.vllm.trainer`, 0.29+ only) registers.

Typical use::

    from rl_sync.vllm import compat
    for attr in compat.loaded_never_on_meta(): ...
    layers = [m for m in model.modules() if compat.deferred_attention(m)]
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import torch

TRAINER_SEND_REFUSED = (
    "rl_sync weight transfer: the trainers send through rl-sync's own group (actors.WeightSync, or the "
    "rl_sync trainer engine on vLLM 0.29+), not through WeightTransferEngine.trainer_send_weights"
)


@cache
def loaded_never_on_meta() -> frozenset[str]:
    """Parameter names vLLM's loaders fill that its layerwise reload never puts back on meta, so
    its recorded loader forms leave them out (empty on 0.26, which moves them like the rest)."""
    from vllm.model_executor.model_loader.reload import meta

    never_loaded = getattr(meta, "SKIP_LOAD_TENSORS", None)
    return frozenset() if never_loaded is None else frozenset(meta.SKIP_TENSORS - never_loaded)


def trainer_factory() -> type | None:
    """vLLM's trainer-side weight-transfer factory (0.29+), or None where there is none (0.26)."""
    from vllm.distributed.weight_transfer import factory

    return getattr(factory, "WeightTransferTrainerFactory", None)


@cache
def _deferred_attention_test() -> Callable[[torch.nn.Module], bool]:
    from vllm.model_executor.layers import attention

    test = getattr(attention, "is_deferred_attention_layer", None)
    if test is not None:
        return test
    kinds = (attention.Attention, attention.MLAAttention)
    return lambda module: isinstance(module, kinds)


def deferred_attention(module: torch.nn.Module) -> bool:
    """Whether vLLM processes `module` after every other layer (attention layers, which may derive
    state from other modules' weights)."""
    return _deferred_attention_test()(module)


def lora_name_mapper(mapper: Any) -> Any:
    """What vLLM's LoRA loader maps an adapter's module names with, from a model's
    `hf_to_vllm_mapper`: its renames only (0.32's `get_rename_mapper`, 0.26's
    `get_unstacked_mapper`)."""
    renames = getattr(mapper, "get_rename_mapper", None) or mapper.get_unstacked_mapper
    return renames()
