"""Config and CLI input is bounded before any work: YAML aliases, nesting and repeated keys are
refused, every count and size `rl-sync plan` takes is range-checked, and bad input is one line on
stderr with exit status 2."""

from __future__ import annotations

import operator
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actors.cli import main
from rl_sync.config.load import MAX_CONFIG_BYTES, MAX_DEPTH, load_config
from rl_sync.config.sync import MAX_BUCKET_BYTES
from rl_sync.models.config import MAX_COUNT, MAX_DIM
from rl_sync.models.plan_report import MAX_TRANSFERS, PlanReportConfig
from rl_sync.planning.layout import MAX_MESH_RANKS

PLAN = Path(__file__).parents[2] / "configs" / "plan_dense_8b.yaml"
FIELDS = {
    "trainer.ranks": ("TrainerParallel.ranks", 1, MAX_MESH_RANKS),
    "trainer.replicate": ("TrainerParallel.replicate", 1, 8),
    "trainer.expert_groups": ("TrainerParallel.expert_groups", 1, 8),
    "inference.engines": ("Parallel.engines", 1, MAX_MESH_RANKS),
    "inference.pp": ("Parallel.pp", 1, MAX_MESH_RANKS),
    "inference.tp": ("Parallel.tp", 1, MAX_MESH_RANKS),
    "inference.vocab_pad": ("Parallel.vocab_pad", 1, MAX_DIM),
    "model.layers": ("ModelConfig.layers", 1, MAX_COUNT),
    "model.heads": ("ModelConfig.heads", 1, MAX_COUNT),
    "model.kv_heads": ("ModelConfig.kv_heads", 0, MAX_COUNT),
    "model.experts": ("ModelConfig.experts", 0, MAX_COUNT),
    "model.first_dense_layers": ("ModelConfig.first_dense_layers", 0, MAX_COUNT),
    "model.hidden": ("ModelConfig.hidden", 1, MAX_DIM),
    "model.vocab": ("ModelConfig.vocab", 1, MAX_DIM),
    "model.intermediate": ("ModelConfig.intermediate", 1, MAX_DIM),
    "model.head_dim": ("ModelConfig.head_dim", 0, MAX_DIM),
    "model.kv_lora_rank": ("ModelConfig.kv_lora_rank", 0, MAX_DIM),
    "bucket_bytes": ("PlanReportConfig.bucket_bytes", 1, MAX_BUCKET_BYTES),
    "coalesce_bytes": ("PlanReportConfig.coalesce_bytes", 0, MAX_BUCKET_BYTES),
}
"""Each count or size `rl-sync plan configs/plan_dense_8b.yaml` takes: (label in errors, low, high)."""


def _outside(field: str) -> st.SearchStrategy[int]:
    _, low, high = FIELDS[field]
    return st.one_of(st.integers(max_value=low - 1), st.integers(min_value=high + 1), st.just(2**70))


@st.composite
def out_of_bounds(draw) -> tuple[str, int]:
    field = draw(st.sampled_from(sorted(FIELDS)))
    return field, draw(_outside(field))


@settings(max_examples=150, deadline=None)
@given(field=st.sampled_from(sorted(FIELDS)), value=st.integers(-(2**80), 2**80) | st.integers(-4, 1 << 12))
def test_every_count_and_size_is_taken_in_bounds_and_refused_outside(field, value):
    label, low, high = FIELDS[field]
    if not low <= value <= high:
        with pytest.raises(ValueError) as refused:
            load_config(PLAN, PlanReportConfig, [f"{field}={value}"])
        assert str(refused.value) == f"{PLAN}: {label} must be in [{low}, {high}], got {value}"
        return
    try:
        cfg = load_config(PLAN, PlanReportConfig, [f"{field}={value}"])
    except ValueError as exc:  # another rule (a product of fields, GQA needing heads) refused it
        assert "\n" not in str(exc)
        return
    assert operator.attrgetter(field)(cfg) == value


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=out_of_bounds())
def test_the_plan_command_refuses_any_count_out_of_bounds_in_one_line(case, capsys):
    field, value = case
    label, low, high = FIELDS[field]
    assert main(["plan", str(PLAN), f"{field}={value}"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"rl-sync plan: {PLAN}: {label} must be in [{low}, {high}], got {value}\n"
    assert captured.out == ""


@settings(max_examples=50, deadline=None)
@given(field=st.sampled_from(sorted(FIELDS)), text=st.text(max_size=40) | st.sampled_from(["true", "1.5", "[1]", "{}"]))
def test_any_override_text_is_taken_or_refused_in_one_line_naming_the_field(field, text):
    try:
        load_config(PLAN, PlanReportConfig, [f"{field}={text}"])
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message and field.split(".")[-1] in message, message


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "trainer.ranks=1000000",
            f"{PLAN}: trainer.ranks x inference ranks (engines x pp x tp) = 1000000 x 8 = 8000000, more than the "
            "1048576 rl-sync plan takes; plan fewer ranks on one side",
        ),
        ("model.layers=10000000", f"{PLAN}: ModelConfig.layers must be in [1, 4096], got 10000000"),
        (
            "inference.engines=1000000",
            f"{PLAN}: Parallel: engines x pp x tp = 1000000 x 1 x 4 = 4000000 ranks, more than the 1048576 a "
            "mesh may hold",
        ),
        (
            "bucket_bytes=1180591620717411303424",
            f"{PLAN}: PlanReportConfig.bucket_bytes must be in [1, {2**40}], got 1180591620717411303424",
        ),
        ("trainer.ranks=true", f"{PLAN}: TrainerParallel.ranks must be an int, got True (bool)"),
        ("model.rope_theta=.nan", f"{PLAN}: ModelConfig.rope_theta must be finite and > 0, got nan"),
    ],
)
def test_the_reported_inputs_are_refused_before_planning(override, message, capsys):
    """The issue's inputs, each a hang or a traceback before."""
    assert main(["plan", str(PLAN), override]) == 2
    assert capsys.readouterr().err == f"rl-sync plan: {message}\n"


def test_layers_times_experts_is_bounded():
    with pytest.raises(ValueError) as refused:
        load_config(PLAN, PlanReportConfig, ["model.experts=384", "model.moe_intermediate=2048", "model.layers=200"])
    assert str(refused.value) == (
        f"{PLAN}: model.layers x model.experts = 200 x 384 = 76800, more than the 65536 rl-sync plan takes"
    )


def test_a_plan_of_too_many_transfers_is_refused_before_it_is_scheduled(capsys):
    """128 trainers split rows, 128 engines x TP64 split columns: every trainer shard meets
    every worker shard (1M rank pairs, within bounds), 145M transfers in all."""
    overrides = ["trainer.ranks=128", "inference.engines=128", "inference.tp=64"]
    assert main(["plan", str(PLAN), *overrides]) == 2
    assert capsys.readouterr().err == (
        f"rl-sync plan: this plan holds 145260544 transfers, more than the {MAX_TRANSFERS} rl-sync plan "
        "schedules; plan fewer trainer or inference ranks\n"
    )


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:
        return True


def _depth(value) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 1


SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8)
KEYS = st.from_regex(r"k[a-z_]{0,7}", fullmatch=True)
"""Plain keys (none of YAML's null and boolean words, which a dump would quote)."""


@st.composite
def _nested(draw, levels: int):
    """A value nested exactly `levels` deep (a scalar is one level): at each level a list or a
    mapping holding the next level beside a few scalars."""
    value = draw(SCALARS)
    for _ in range(levels - 1):
        siblings = draw(st.lists(SCALARS, max_size=2))
        if draw(st.booleans()):
            value = [*siblings, value]
        else:
            value = {**{f"k{i}": s for i, s in enumerate(siblings)}, draw(KEYS): value}
    return value


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(levels=st.integers(2, MAX_DEPTH + 8), data=st.data(), flow=st.booleans())
def test_yaml_nesting_is_bounded(levels, data, flow, tmp_path):
    """Any document nested deeper than MAX_DEPTH is refused naming the bound; any other parses
    (and, not being a plan, fails as one in one line)."""
    document = {"model": data.draw(_nested(levels - 1))}
    assert _depth(document) == levels
    path = tmp_path / "c.yaml"
    path.write_text(yaml.dump(document, Dumper=_NoAliases, default_flow_style=flow))
    with pytest.raises(ValueError) as refused:
        load_config(path, PlanReportConfig)
    message = str(refused.value)
    assert "\n" not in message
    assert (f"nested deeper than {MAX_DEPTH} levels" in message) == (levels > MAX_DEPTH), message


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.dictionaries(KEYS, _nested(2), min_size=1, max_size=6), data=st.data(), nested=st.booleans())
def test_a_key_given_twice_is_refused_naming_it_and_both_lines(document, data, nested, tmp_path):
    key = data.draw(st.sampled_from(sorted(document)))
    text = yaml.dump(document, Dumper=_NoAliases, default_flow_style=False, sort_keys=True)
    if nested:  # the same mapping one level down, under `model:`
        text = "model:\n" + "".join(f"  {line}\n" for line in text.splitlines())
    lines = text.splitlines()
    indent = "  " if nested else ""
    first = next(i for i, line in enumerate(lines) if line.startswith(f"{indent}{key}:")) + 1
    path = tmp_path / "c.yaml"
    path.write_text(text + f"{indent}{key}: 1\n")
    with pytest.raises(ValueError) as refused:
        load_config(path, PlanReportConfig)
    assert str(refused.value) == (
        f"{path}, line {len(lines) + 1}, column {len(indent) + 1}: key {key!r} given twice (first on line "
        f"{first}); give each key once"
    )


@pytest.mark.timeout(60)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(levels=st.integers(1, 12), width=st.integers(1, 10), under=st.sampled_from(["", "trainer.replicate"]))
def test_yaml_aliases_are_refused_before_anything_expands(levels, width, under, tmp_path):
    """Nested aliases (10 levels of 10 would be 10**10 values) are refused at the first alias."""
    lines = ["a0: &a0 [x, x]"] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]" for i in range(1, levels + 1)]
    text = "\n".join(lines) + "\n"
    if under:
        text = PLAN.read_text().replace(
            "  ranks: 8", f"  ranks: 8\n  replicate: {{{text.strip().replace(chr(10), ', ')}}}"
        )
    path = tmp_path / "c.yaml"
    path.write_text(text)
    first = next(i for i, line in enumerate(text.splitlines()) if "*a0" in line)
    column = text.splitlines()[first].index("*a0") + 1
    with pytest.raises(ValueError) as refused:
        load_config(path, PlanReportConfig)
    assert str(refused.value) == (
        f"{path}, line {first + 1}, column {column}: alias *a0: configs take no YAML aliases, write the value out"
    )


def test_a_config_file_is_bounded_in_size(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(PLAN.read_text() + "#" * MAX_CONFIG_BYTES)
    with pytest.raises(ValueError, match=rf"^{path}: larger than the {MAX_CONFIG_BYTES} bytes a config may hold$"):
        load_config(path, PlanReportConfig)


def test_override_keys_are_bounded_in_depth():
    key = ".".join(["a"] * (MAX_DEPTH + 1))
    with pytest.raises(ValueError, match=rf"^override key '{key}' is nested deeper than {MAX_DEPTH} levels$"):
        load_config(PLAN, PlanReportConfig, [f"{key}=1"])
    with pytest.raises(ValueError, match=r"^override 'a..b=1' has an empty key$"):
        load_config(PLAN, PlanReportConfig, ["a..b=1"])
