"""vLLM's decoder architectures bound from FSDP2 trainers' names into TP2 (`arch_sweep`).

The default run binds a representative subset (`arch_sweep.SUBSET`: heads regrouped,
tied, MoE with shared experts, MLA, vLLM's transformers backend; fused in the checkpoint
and transposed weights are `test_vllm.py`'s); `slow` binds every architecture the recorded sweep
(`docs/architectures.json`) found supported. Each must bind with no fallback and
hold, in every parameter on both ranks, exactly what vLLM's own loader loads. The
table in `docs/architectures.md` must be the one generated from the recorded sweep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .arch_sweep import SUBSET, candidates, sweep
from .arch_table import TABLE_END, TABLE_START, table

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "docs" / "architectures.json"


def _recorded() -> dict[str, dict]:
    return json.loads(RECORDED.read_text())


def _check_supported(architectures: list[str], root: str) -> None:
    found = candidates()
    outcomes = sweep({a: found[a] for a in architectures}, root)
    for architecture in architectures:
        outcome = outcomes[architecture]
        assert outcome["status"] == "supported", (
            f"{architecture}: {outcome['status']} at {outcome['stage']} ({outcome['error']}); fallbacks "
            f"{outcome['fallbacks']}; differing {outcome['differ'][:4]}"
        )
        assert outcome["tensors"] > 0 and outcome["fallbacks"] == {}


def test_a_representative_subset_binds_with_no_fallback_and_holds_what_vllm_loads(tmp_path):
    _check_supported(list(SUBSET), str(tmp_path))


@pytest.mark.slow  # every supported architecture: several minutes on a 2-core machine
def test_every_architecture_recorded_as_supported_still_is(tmp_path):
    supported = [a for a, outcome in _recorded().items() if outcome["status"] == "supported"]
    assert len(supported) >= 25, f"the recorded sweep supports {len(supported)} architectures"
    _check_supported(supported, str(tmp_path))


def test_the_architectures_table_is_generated_from_the_recorded_sweep():
    recorded = _recorded()
    assert set(SUBSET) <= {a for a, o in recorded.items() if o["status"] == "supported"}
    page = (ROOT / "docs" / "architectures.md").read_text()
    between = page.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0]
    assert between.strip() == table(recorded), "run `python -m tests.distributed.arch_sweep --table ...`"
