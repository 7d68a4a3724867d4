"""The `rl-sync` command.

    rl-sync plan configs/plan_kimi_k2.yaml            plan a synthetic model, report cost and traffic
    rl-sync plan CONFIG --links configs/links_h200_ib.yaml   ... and predict a round on those links
    rl-sync demo [configs/demo.yaml]                  FSDP2 trainers -> TP engines, bit-exact, M2N vs broadcast
    rl-sync bench [configs/bench.yaml] --chart b.png  M2N, sparse and broadcast rounds side by side

Every subcommand reads a YAML file from `configs/` into the project's
dataclasses; trailing `key=value` or `--key value` arguments override fields
(`trainer.ranks=512`, `--sync.bucket_bytes 1048576`). `--address` joins an
existing Ray cluster (default: `RAY_ADDRESS`, else a local Ray on loopback).
Bad input (a config or override out of bounds: see `rl_sync.config.load`)
is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from rl_sync.config.load import apply_overrides, from_dict, load_config

COMMANDS = {
    "plan": "plan a synthetic model (no Ray, no communication); print planning time, memory, message size, "
    "and bytes per rank against the broadcast baseline",
    "demo": "run the quickstart: FSDP2 trainers push a transformers model into tensor-parallel engines, "
    "every tensor checked bit-exact, M2N and broadcast side by side",
    "bench": "time M2N, sparse and broadcast rounds on a synthetic model over Ray actors; optional PNG chart",
}


def _config(cls, path: str | None, overrides: Sequence[str]):
    if path is None:
        return from_dict(cls, apply_overrides({}, overrides), f"defaults of {cls.__name__}")
    return load_config(path, cls, overrides)


def _plan(args, overrides) -> int:
    from rich.progress import Progress

    from rl_sync.models.plan_report import STEPS, PlanReportConfig, format_report, plan_report
    from rl_sync.planning.simulate import LinkModel

    if args.config is None:
        raise ValueError("plan needs a CONFIG, e.g. configs/plan_kimi_k2.yaml")
    cfg = load_config(args.config, PlanReportConfig, overrides)
    links = load_config(args.links, LinkModel, ()) if args.links else None
    with Progress(transient=True) as progress:
        task = progress.add_task("planning", total=len(STEPS))
        report = plan_report(
            cfg, lambda name: progress.update(task, description=name, completed=STEPS.index(name)), links
        )
    print(format_report(Path(args.config).stem, report))
    return 0


def _demo(args, overrides) -> int:
    from .cluster import connect
    from .demo import DemoConfig, run

    cfg = _config(DemoConfig, args.config, overrides)
    connect(args.address)
    run(cfg)
    return 0


def _bench(args, overrides) -> int:
    from .bench import BenchConfig, chart, run
    from .cluster import connect

    cfg = _config(BenchConfig, args.config, overrides)
    connect(args.address)
    rounds = run(cfg)
    if args.chart:
        chart(rounds, args.chart)
        print(f"chart written to {args.chart}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl-sync", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, run in (("plan", _plan), ("demo", _demo), ("bench", _bench)):
        sub = commands.add_parser(name, help=COMMANDS[name], description=COMMANDS[name])
        sub.add_argument(
            "config", nargs="?", help=f"YAML file (e.g. configs/{'plan_dense_8b' if name == 'plan' else name}.yaml)"
        )
        if name == "plan":
            sub.add_argument(
                "--links", default=None, help="YAML link model (rl_sync.planning.simulate.LinkModel): predict a round"
            )
        if name != "plan":
            sub.add_argument("--address", default=None, help="Ray cluster to join (default: RAY_ADDRESS, else local)")
        if name == "bench":
            sub.add_argument("--chart", default=None, help="write a PNG chart of bytes and seconds per round")
        sub.set_defaults(run=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, overrides = parser.parse_known_args(argv)
    if args.config is not None and "=" in args.config:
        overrides, args.config = [args.config, *overrides], None
    try:
        return args.run(args, overrides)
    except (ValueError, TypeError) as exc:
        lines = (line.strip() for line in str(exc).splitlines())
        print(f"rl-sync {args.command}: {'; '.join(filter(None, lines))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
