"""YAML configs into dataclasses, overrides, and the `rl-sync` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.cli import main
from rl_sync.config.load import load_config, parse_overrides
from rl_sync.models.plan_report import PlanReportConfig

CONFIGS = Path(__file__).parents[2] / "configs"


@pytest.mark.parametrize(
    "name", ["plan_dense_8b", "plan_qwen3_235b", "plan_kimi_k2", "plan_deepseek_v3", "plan_llama_70b_fleet"]
)
def test_shipped_plan_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml", PlanReportConfig)
    assert cfg.trainer.ranks > 0 and cfg.inference.engines > 0


def test_unknown_keys_name_the_key_and_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text((CONFIGS / "plan_dense_8b.yaml").read_text() + "\nbucket_byts: 5\n")
    with pytest.raises(ValueError, match=rf"{path}: unknown key\(s\) bucket_byts"):
        load_config(path, PlanReportConfig)
    path.write_text((CONFIGS / "plan_dense_8b.yaml").read_text().replace("layers: 32", "layers: 32\n  layerz: 2"))
    with pytest.raises(ValueError, match=r"unknown key\(s\) model.layerz"):
        load_config(path, PlanReportConfig)
    path.write_text((CONFIGS / "plan_dense_8b.yaml").read_text().replace("  tp: 4", "  tensor_parallel: 4"))
    with pytest.raises(ValueError, match=r"unknown key\(s\) inference.tensor_parallel \(not fields of PlanReport"):
        load_config(path, PlanReportConfig)
    path.write_text((CONFIGS / "plan_dense_8b.yaml").read_text().replace("family: llama", "family: gpt2"))
    with pytest.raises(ValueError, match=r'wrong value type for field "model.family" - should be "Literal"'):
        load_config(path, PlanReportConfig)


def test_ill_typed_values_are_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text((CONFIGS / "plan_dense_8b.yaml").read_text().replace("ranks: 8", "ranks: eight"))
    with pytest.raises(ValueError, match=r'wrong value type for field "trainer.ranks"'):
        load_config(path, PlanReportConfig)


def test_overrides_in_both_forms():
    assert parse_overrides(["a.b=1", "--c", "x", "--d-e=2.5"]) == [(["a", "b"], 1), (["c"], "x"), (["d_e"], 2.5)]
    cfg = load_config(
        CONFIGS / "plan_dense_8b.yaml", PlanReportConfig, ["trainer.ranks=16", "--inference.engines", "4"]
    )
    assert cfg.trainer.ranks == 16 and cfg.inference.engines == 4
    with pytest.raises(ValueError, match="cannot read override 'oops'"):
        parse_overrides(["oops"])


def test_off_on_yes_no_stay_strings_and_only_true_false_are_booleans(tmp_path):
    from rl_sync.config.sync import SyncConfig

    path = tmp_path / "sync.yaml"
    path.write_text("integrity: off\ncolocate: off\ndouble_buffer: true\nname: yes\n")
    cfg = load_config(path, SyncConfig, ["auto_repair=false"])
    assert (cfg.integrity, cfg.colocate, cfg.double_buffer, cfg.name, cfg.auto_repair) == (
        "off",
        "off",
        True,
        "yes",
        False,
    )


def test_an_interface_resolves_to_its_address_or_names_the_ones_there_are():
    from rl_sync.rank.address import interface_address

    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(
        ValueError,
        match=r"^SyncConfig.interface 'nope0' has no IPv4 address on .* \(No such device\); "
        r"interfaces here: .*\blo\b",
    ):
        interface_address("nope0")


def test_plan_command_prints_the_report(capsys):
    assert main(["plan", str(CONFIGS / "plan_dense_8b.yaml")]) == 0
    out = capsys.readouterr().out
    assert "plan_dense_8b: 8.03B parameters, 291 tensors" in out
    assert "busiest source   4.02 GB = 1.000 x lower bound" in out


def test_plan_command_predicts_a_round_on_given_links(capsys):
    """8 trainers on one node send 4.02 GB each to 2 engines on other nodes: at 50 GB/s per NIC,
    0.0803 s plus 10 us per message."""
    assert main(["plan", str(CONFIGS / "plan_dense_8b.yaml"), "--links", str(CONFIGS / "links_h200_ib.yaml")]) == 0
    out = capsys.readouterr().out
    assert ("predicted round  0.082 s over 16 buckets, direct; bottleneck rank 0 NIC out (0.0815 s of 0.0815 s)") in out
    assert "relayed round    0.094 s over 37 buckets, relayed through 2 replicas; bottleneck rank 8 NIC in" in out


def test_plan_command_runs_without_importing_ray():
    """`rl-sync plan` needs no cluster: a fresh interpreter plans and never imports Ray."""
    code = (
        "import sys; from actors.cli import main; code = main(['plan', sys.argv[1]]); "
        "print('ray imported' if 'ray' in sys.modules else 'no ray'); sys.exit(code)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(CONFIGS / "plan_dense_8b.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("no ray")


def test_plan_command_reports_bad_config(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: {}\n")
    assert main(["plan", str(path)]) == 2
    assert 'missing value for field "model.family"' in capsys.readouterr().err


def test_demo_config_takes_user_binding_rules(tmp_path):
    from actors.demo import DemoConfig

    path = tmp_path / "demo.yaml"
    path.write_text(
        (CONFIGS / "demo.yaml")
        .read_text()
        .replace("rules: []", "rules:\n  - {pattern: 'x\\\\.w', target: 'x.w', split: row}")
    )
    cfg = load_config(path, DemoConfig)
    assert cfg.rules[0].split == "row" and cfg.rules[0].pattern == r"x\\.w"
    path.write_text(
        (CONFIGS / "demo.yaml")
        .read_text()
        .replace("rules: []", "rules:\n  - {pattern: 'x', target: 'x', split: sideways}")
    )
    with pytest.raises(ValueError, match=r'wrong value type for field "rules'):
        load_config(path, DemoConfig)


def test_bench_chart_is_a_png(tmp_path):
    from actors.bench import chart
    from rl_sync.wire.messages import RankStats
    from rl_sync.wire.stats import RoundStats

    def rank(role, received):
        return RankStats(
            rank=0,
            role=role,
            version=1,
            mode="m2n",
            seconds=0.1,
            sent_bytes=0,
            received_bytes=received,
            zero_copy_bytes=0,
            staged_bytes=0,
            local_bytes=0,
            messages=0,
            buckets=0,
            staging_bytes=0,
            baseline_bytes=0,
            dense_bytes=0,
            changed_elements=0,
            encodings={},
        )

    rounds = {m: [RoundStats(v, m, 0.1 * v, (rank("worker", 10**6 * v),)) for v in (1, 2)] for m in ("m2n", "sparse")}
    chart(rounds, str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("name", ["links_h200_ib", "links_gb200_nvl72", "links_cpu_loopback", "links_h200_x2"])
def test_shipped_link_models_load(name):
    from rl_sync.planning.simulate import LinkModel

    links = load_config(CONFIGS / f"{name}.yaml", LinkModel)
    assert links.gpus_per_node > 0 and links.nic_gbs > 0
