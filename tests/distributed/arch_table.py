"""The table of vLLM architectures in `docs/architectures.md`, generated from the sweep's recorded results.

`tests.distributed.arch_sweep --run` records one outcome per architecture (JSON);
`write_table` turns them into the markdown between two markers of that page, so
the table always says what the last sweep saw.

Typical use::

    write_table("docs/architectures.json", "docs/architectures.md")
"""

from __future__ import annotations

import json

TABLE_START, TABLE_END = "<!-- architectures:start -->", "<!-- architectures:end -->"
STATUS = {
    "supported": "yes",
    "fallbacks": "with fallbacks",
    "differs": "**differs**",
    "excluded": "not built here",
}


def _notes(outcome: dict) -> str:
    if outcome["status"] == "excluded":
        return f"{outcome['stage']}: {outcome['error']}".replace("|", "\\|")
    if outcome["status"] == "differs":
        return f"{len(outcome['differ'])} tensors differ from vLLM's load, e.g. {outcome['differ'][0]}"
    return "; ".join(f"{len(names)} whole: {reason}" for reason, names in outcome["fallbacks"].items())


def _row(outcome: dict) -> str:
    cells = [outcome["architecture"], STATUS[outcome["status"]], "", "", _notes(outcome)]
    if outcome["status"] != "excluded":
        cells[2] = "named_parameters()" if outcome["names"] == "parameters" else "checkpoint (save_pretrained)"
        cells[3] = f"{outcome['tensors']} / {outcome['parts']} / {outcome['transposed']}"
    return "| " + " | ".join(cells) + " |"


def table(results: dict[str, dict]) -> str:
    """The support table (markdown) of recorded sweep results."""
    order = list(STATUS)
    rows = sorted(results.values(), key=lambda o: (order.index(o["status"]), o["architecture"]))
    counts = ", ".join(f"{sum(o['status'] == s for o in rows)} {STATUS[s].strip('*')}" for s in order)
    return "\n".join(
        [
            f"{len(rows)} architectures vLLM registers for text generation ({counts}), each a tiny random "
            "model bound from FSDP2 trainers' names into TP2 and checked parameter by parameter against "
            "vLLM's own load (`python -m tests.distributed.arch_sweep`).",
            "",
            "| Architecture | Zero fallbacks | Names the trainers send | Tensors / parts / transposed | Notes |",
            "|---|---|---|---|---|",
            *map(_row, rows),
        ]
    )


def write_table(results_path: str, page: str) -> None:
    """Replace what lies between `TABLE_START` and `TABLE_END` in `page` with `table(...)`."""
    with open(results_path) as f:
        results = json.load(f)
    with open(page) as f:
        text = f.read()
    if text.count(TABLE_START) != 1 or text.count(TABLE_END) != 1:
        raise ValueError(f"{page} must hold {TABLE_START!r} and {TABLE_END!r} once each, around the table")
    head, rest = text.split(TABLE_START, 1)
    _, tail = rest.split(TABLE_END, 1)
    with open(page, "w") as f:
        f.write(f"{head}{TABLE_START}\n{table(results)}\n{TABLE_END}{tail}")
