"""Quickstart: FSDP2 trainers push a ~66M-parameter transformer into TP engines.

Four trainer actors hold a Llama-shaped `transformers` model sharded with
FSDP2; two engines of two tensor-parallel workers hold the inference model
(fused qkv / gate_up, column / row / vocab-parallel shards). Each round takes
a real AdamW step, pushes with M2N and with the broadcast baseline, checks
every bound tensor bit-exact and, at the end, the engines' logits against the
trainer model's.

    python examples/quickstart.py                          # local Ray on loopback
    python examples/quickstart.py --address auto rounds=5  # an existing cluster
"""

from __future__ import annotations

import sys
from pathlib import Path

from actors.cli import main

if __name__ == "__main__":
    config = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    sys.exit(main(["demo", config, *sys.argv[1:]]))
