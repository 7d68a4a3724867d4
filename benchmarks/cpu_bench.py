"""CPU benchmark: M2N, sparse and broadcast on a ~106M-parameter model over Gloo.

Same as `rl-sync bench configs/bench.yaml`; extra arguments are passed on
(`--chart bench.png`, `repeat=9`, `--address auto`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from actors.cli import main

if __name__ == "__main__":
    config = str(Path(__file__).resolve().parents[1] / "configs" / "bench.yaml")
    sys.exit(main(["bench", config, *sys.argv[1:]]))
