"""What a digest costs: tag rate per device, next to a copy of the same bytes.

For `--device cuda`: NH on the device (Triton, and the torch fallback), then
keyed BLAKE3 of its words on the host, against a device-to-device copy. For
`--device cpu`: keyed BLAKE3 of the payload (keyed and checksum modes are the
same work), and HMAC-SHA256 (the tag before 2026-12-06) and zlib's CRC-32 for
comparison, against a host copy.

    python benchmarks/digest_bench.py --device cuda --gib 1
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rich.console import Console
from rich.table import Table

from rl_sync.transport import nh
from rl_sync.transport.digest import Digester


def timed(fn, device: torch.device, repeat: int) -> float:
    """Median seconds of `fn` (device work included)."""
    times = []
    for _ in range(repeat + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def cases(buf: torch.Tensor, device: torch.device) -> dict[str, Callable[[], object]]:
    digester = Digester("keyed", b"k" * 32, label=b"bench")
    out = torch.empty_like(buf)
    rows: dict[str, Callable[[], object]] = {
        "copy (reference)": lambda: out.copy_(buf),
        "keyed tag (what a round runs)": lambda: digester.tag(0, 1, 0, [buf], float("inf")),
    }
    if device.type == "cuda":
        key = nh.nh_key(b"k" * 32, device)
        words = buf.view(torch.int32).view(-1, nh.BLOCK_WORDS)
        rows["NH, Triton kernel"] = lambda: nh.nh_compress(buf, key)
        rows["NH, torch fallback (64 MiB steps)"] = lambda: [
            nh._nh_torch(words[i : i + 65536], key) for i in range(0, words.shape[0], 65536)
        ]
    else:
        view = buf.numpy().data
        rows["HMAC-SHA256 (the tag before)"] = lambda: hmac.new(b"k" * 32, view, hashlib.sha256).digest()
        rows["CRC-32 (zlib)"] = lambda: zlib.crc32(view)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    nbytes = int(args.gib * (1 << 30)) // 1024 * 1024
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    table = Table(title=f"digest cost on {name}: {nbytes / 2**30:.2f} GiB, median of {args.repeat}")
    for column in ("case", "ms", "GB/s", "x copy time"):
        table.add_column(column, justify="right")
    results = {label: timed(fn, device, args.repeat) for label, fn in cases(buf, device).items()}
    copy = results["copy (reference)"]
    for label, seconds in results.items():
        table.add_row(label, f"{seconds * 1e3:.2f}", f"{nbytes / seconds / 1e9:.1f}", f"{seconds / copy:.2f}")
    Console(width=120).print(table)


if __name__ == "__main__":
    main()
