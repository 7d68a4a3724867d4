"""The fused sparse codec's Triton kernels, run on CPU by Triton's interpreter in a fresh process
(the interpreter is chosen when the kernels are defined): bit-exact payloads, baselines and live
weights against the torch codec, for strided boxes of 1, 2, 4 and 8 bytes in every encoding,
and an out-of-order payload refused before any write. The GPU runs the same in
`tests/gpu/test_sparse_triton.py`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_kernels_match_the_torch_codec_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(Path(__file__).parents[2])}
    done = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("sparse_interpreted.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
