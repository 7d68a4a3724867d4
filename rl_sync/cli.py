"""The `rl-sync` command.

    rl-sync plan configs/plan_kimi_k2.yaml [key=value ...]

Each subcommand reads a YAML config from `configs/`; trailing `key=value` or
`--key value` arguments override its fields (`trainer.ranks=512`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .config import load_config


def _plan(args: argparse.Namespace) -> int:
    from .report import PlanReportConfig, format_report, plan_report

    cfg = load_config(args.config, PlanReportConfig, args.overrides)
    print(format_report(Path(args.config).stem, plan_report(cfg)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rl-sync",
        description="Move trainer weights into inference workers on a Ray cluster, resharded, every step.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan",
        help="plan a synthetic model and report time, memory, message sizes and transfer statistics",
        description="Plan a synthetic model from CONFIG (no Ray, no communication) and print what planning "
        "costs and what the plan moves, against the broadcast baseline.",
    )
    plan.add_argument("config", help="YAML file, e.g. configs/plan_kimi_k2.yaml")
    plan.add_argument("overrides", nargs=argparse.REMAINDER, help="key=value or --key value overrides")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as exc:
        print(f"rl-sync {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
