"""The sparse codec's kernels in CUDA (`sparse_kernels.cu`): replacements of their Triton versions
(`sparse_triton`: the same arguments and tables, and the same payloads, baselines and live
tensors at the end of a round, bit for bit; but the CUDA `diff` advances the baselines that
Triton's `compact` would, `sparse_fused` sets each row's SEND_UPDATE to match) whose launches
cost the host tens of microseconds less, on the round's critical path. On an H200, 1 GiB of bf16
(`docs/benchmarks.md`):
- for launches whose boxes are all on the vectorized path (contiguous, 16-byte aligned): `diff`,
  which also advances the baseline and stages the values of runs with few changes (0.62 ms at 1%,
  0.78 at 10%), then `compact_sparse` for sparse rows (0.15 ms at 1%), `compact_staged` for busy
  ones (0.22 ms at 10%), both from that stage where it holds a tile, and `compact` for busier ones
  (0.47 ms at 30%): the sender's kernels 0.79 ms at 1% and 1.01 at 10%, against Triton's 1.03
  and 1.58 (`diff` 0.66, `compact` 0.37 and 0.92); and the busy `expand` (0.61 against 0.85 ms
  at 10%);
- for any row: `starts`, a receiver's checks of every row, bitmap or blocked, in one launch where
  Triton takes two (`sparse_triton.bitmap_counts`, then `sparse_triton.scan`); `blocked_check`
  and `blocked_apply` for blocked rows (0.017 against 0.025 ms, 0.22 against 0.21 ms at 1%).

`sparse_fused` sends a launch here when `usable(device)` (asked once per sender or receiver) and,
for `diff`, `compact` and `expand`, its key is on the vectorized path (and, for `expand`, its
density class busy or busier); every other launch, and every launch where CuPy is missing (the
`cuda12` / `cuda13` extras) or `RL_SYNC_SPARSE_KERNELS=triton` is set, takes the Triton kernels.
The file is compiled once per process and device by NVRTC through CuPy, with the table columns
passed as macros, and the kernels are queued through the CUDA driver (`cuLaunchKernel`, their
arguments in one int64 array) on torch's current stream, so they queue behind and ahead of the
Triton launches of the same bucket with no synchronization in between. All but `diff` take their
table and program starts either uploaded (pointers) or, up to `INLINE_VALUES` values, in their
parameters (`Rows`: host values), which spares the host an upload; their buffers come as tensors
or as `Address`es; a bucket's `diff` is bound once (`BoundDiff`).
"""

from __future__ import annotations

import functools
import importlib.resources
import os
import threading
import warnings
from typing import Any, NamedTuple

import numpy as np
import torch

from ..sparse.encodings import ALIGN, BITMAP, BLOCK, BLOCKED, DENSE, INDICES, MAX_INDEX
from . import sparse_table
from .sparse_table import BUSIER, BUSY, INT32_INDEX, NONE, TILE, UINT16_OFFSET, anchor_address

C_TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int", 8: "unsigned long long"}
"""The CUDA type a kernel moves elements of each width as (bits, like `sparse_table.BITS_TORCH`)."""
DIFF_PARTS = 2
"""Programs a tile of the CUDA `diff` (the Triton one takes `sparse_triton.DIFF_PARTS`): on an H200,
1 GiB of bf16, 0.516 ms with 2 or 1 (about 0.9x the copy: it reads, where the copy also writes),
0.519 ms with 4, 0.674 ms with 8."""
_DIFF_PART = TILE // DIFF_PARTS
"""Elements a program of the CUDA `diff` compares."""
STAGE_SHARE = 8
"""A warp of the CUDA `diff` whose changes are at most this fraction of its elements (an eighth)
stages their values, so that `compact` reads them from there rather than from the source: a stage
takes `1 / STAGE_SHARE` of the bytes of a bucket's boxes on the vectorized path, each round,
beside the bitmap words (a sixteenth of bf16 bytes)."""


def stage_run(width: int) -> int:
    """Elements of a warp's run in the CUDA `diff` of `width`-byte elements: the unit a stage holds
    the values of, when at most `1 / STAGE_SHARE` of them changed."""
    return _DIFF_PART // WARPS["diff"][width]


def stage_bytes(tiles: int, width: int) -> int:
    """Bytes of the stage of a box of `tiles` tiles of `width`-byte elements (16-byte multiples)."""
    return tiles * TILE // STAGE_SHARE * width


WARPS = {
    "diff": {1: 4, 2: 8, 4: 8, 8: 16},
    "compact": {1: 8, 2: 8, 4: 8, 8: 8},
    "compact_staged": {1: 8, 2: 8, 4: 8, 8: 8},
    "compact_sparse": {1: 8, 2: 8, 4: 8, 8: 8},
    "expand": {1: 8, 2: 8, 4: 8, 8: 4},
}
"""Warps a program, by kernel and element width (`diff` holds at most 8 of its 16-byte pairs a
thread in registers, and each of its warps stages the values of its own run of elements,
`stage_run`, which `compact` finds by the same split; `expand` stages 1,024 values a warp in
shared memory, so wider elements take fewer warps)."""
STARTS_WARPS = 4
"""Warps a program of `starts`, each counting one tile of a bitmap row (a tile's 512 words are 128
runs of 16 bytes: 4 a lane, all read before the first count); the row's last program scans its
tile counts, 1,024 a pass. On an H200, 1 GiB of bf16 at 10% (64 MiB of bitmap): 0.033-0.035 ms,
0.037-0.039 ms with 8 warps, against 0.067-0.069 ms when each program counted a single tile
(bound by the programs' count, whatever their warps)."""
_ENV = "RL_SYNC_SPARSE_KERNELS"


def usable(device: torch.device | int) -> bool:
    """Whether launches on `device` (or the device numbered so, as `Tensor.get_device` numbers it:
    -1 is the CPU) may take these kernels: a CUDA device, CuPy imports, the file compiles for the
    device (a failed compile warns once and leaves the Triton kernels in place), and
    `RL_SYNC_SPARSE_KERNELS` is not `triton`. A sender or receiver asks once, before its first
    launch, and keeps the answer for all of them."""
    if _choice(os.environ.get(_ENV, "")) == "triton":
        return False
    if isinstance(device, int):
        return device >= 0 and _source_compiles(device)
    if device.type != "cuda":
        return False
    return _source_compiles(torch.cuda.current_device() if device.index is None else device.index)


@functools.cache
def _choice(value: str) -> str:
    """`RL_SYNC_SPARSE_KERNELS`'s value `value`, checked: 'cuda' (the default) or 'triton'."""
    choice = value.strip().lower() or "cuda"
    if choice not in ("cuda", "triton"):
        raise ValueError(f"{_ENV}={choice!r}: expected 'cuda' (the default, where CuPy is installed) or 'triton'")
    return choice


@functools.cache
def _source_compiles(device: int) -> bool:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    try:
        _functions(device)
    except Exception as error:  # NVRTC missing or refusing: the Triton kernels still work
        warnings.warn(f"the sparse codec's CUDA kernels did not compile ({error}); using Triton's", stacklevel=3)
        return False
    return True


def _options() -> tuple[str, ...]:
    """The NVRTC options the file is compiled with (the architecture is the device's)."""
    return ("-std=c++17", *_macros())


def _macros() -> tuple[str, ...]:
    """The table columns and constants the source reads, from their Python definitions."""
    names = [name for name in dir(sparse_table) if name.startswith(("SEND_", "RECV_"))]
    values = {name: getattr(sparse_table, name) for name in names}
    values |= {"NO_INDEX": NONE, "INT32_INDEX": INT32_INDEX, "UINT16_OFFSET": UINT16_OFFSET}
    values |= {"BLOCK": BLOCK, "INLINE_VALUES": INLINE_VALUES, "STAGE_SHARE": STAGE_SHARE}
    values |= {"ALIGN": ALIGN, "MAX_INDEX": MAX_INDEX, "BUSY": BUSY, "BUSIER": BUSIER}
    values |= {"CODE_INDICES": INDICES, "CODE_BITMAP": BITMAP, "CODE_DENSE": DENSE, "CODE_BLOCKED": BLOCKED}
    values |= {f"STAGE_RUN_{width}": stage_run(width) for width in C_TYPES}
    return tuple(f"-D{name}={value}" for name, value in sorted(values.items()))


def _name(kernel: str, width: int) -> str:
    part = f", {_DIFF_PART}" if kernel == "diff" else ""
    return f"{kernel}<{C_TYPES[width]}, {TILE}{part}, {WARPS[kernel][width]}>"


_STARTS = f"starts<{TILE}, {STARTS_WARPS}>"
PLACE_THREADS = 256
"""Threads of `place`'s one program: it takes the bucket's rows this many at a time."""
_PLACE = f"place<{TILE}, {PLACE_THREADS}>"
_NAMES = {(kernel, width): _name(kernel, width) for kernel in WARPS for width in C_TYPES}
"""`_name` of each kernel and width (a launch looks its name up rather than formatting it)."""
BLOCKED_WARPS = 4
"""Warps a program of `blocked_check` and `blocked_apply`, each program one wire block of 65,536
elements (at 1% density, 655 entries: about 5 a thread)."""
_BLOCKED_CHECK = f"blocked_check<{BLOCKED_WARPS}>"
_BLOCKED_APPLY = {width: f"blocked_apply<{C_TYPES[width]}, {BLOCKED_WARPS}>" for width in C_TYPES}


def _names() -> list[str]:
    """Every kernel the file is compiled for."""
    return [*_NAMES.values(), _STARTS, _BLOCKED_CHECK, *_BLOCKED_APPLY.values(), _PLACE]


def _source() -> str:
    return importlib.resources.files(__package__).joinpath("sparse_kernels.cu").read_text()


@functools.cache
def _functions(device: int) -> dict[str, Any]:
    """Every kernel of the file, built for `device` (one NVRTC compile, cached by CuPy on disk;
    loaded in the device's primary context, which torch uses too), as CuPy's `Function`: its `ptr`
    is the driver's handle, valid while the `Function` (which holds its module) is kept here."""
    import cupy

    names = _names()
    source = _source()
    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=source, options=_options(), name_expressions=names)
        return {name: module.get_function(name).kernel for name in names}


MAX_ARGS = 16
"""Arguments a kernel of the file takes, at most (all 64-bit), besides its inline rows."""
INLINE_VALUES = 480
"""int64 values a launch of any kernel but `diff` can carry in its parameters (`Inline` in
the source: its program starts, then its rows), rather than in a table uploaded to the device
(3,840 bytes: with the other arguments, under the 4 KiB a kernel's parameters may take). A launch
of fewer rows skips the upload, its pinned staging and its slices: on an H200's host about 30 µs
of a sender's first `compact` and of a receiver's checks, both on the round's critical path."""


def fits_inline(boxes: int, columns: int) -> bool:
    """Whether a launch of `boxes` rows of `columns` values carries them in its parameters."""
    return boxes + 1 + boxes * columns <= INLINE_VALUES


class _Params(threading.local):
    """This thread's argument slots for `cuLaunchKernel`: `values`, `inline` (a launch's rows, when
    its kernel takes them), and the addresses of two arrays of pointers to the slots: `address`
    (the values alone) and `inline_address` (the inline rows first). The driver copies the values
    when the launch is queued, so the slots are free again once `_launch` returns."""

    def __init__(self) -> None:
        self.values = np.zeros(MAX_ARGS, dtype=np.int64)
        self.inline = np.zeros(INLINE_VALUES, dtype=np.int64)
        first = self.values.ctypes.data
        pointers = [self.inline.ctypes.data, *range(first, first + 8 * MAX_ARGS, 8)]
        self._pointers = np.array(pointers, dtype=np.uint64)
        self.inline_address = self._pointers.ctypes.data
        self.address = self.inline_address + 8


_PARAMS = _Params()


def _launch(name: str, warps: int, total: int, device: int, *args: int, inline: Inline | None = None) -> None:
    """Kernel `name` (`_names`) over `total` programs of `warps` warps, on torch's current stream of
    the device numbered `device`; `args` are addresses and counts, 64-bit as every kernel of the file
    takes them, after `inline`, the values of its `Inline` parameter (program starts, then rows:
    every kernel but `diff` takes one: None for `diff`). Queued through the driver with
    the arguments in one int64 array: CuPy's kernel call converts each argument to an object first,
    about 10 µs a launch on an H200's host."""
    handle, params = _functions(device)[name].ptr, _PARAMS
    params.values[: len(args)] = args
    pointers = params.address
    if inline is not None:
        firsts, rows = inline
        end = len(firsts) + len(rows)
        if end > INLINE_VALUES:
            raise ValueError(f"{end} inline values for {name}; a launch carries at most {INLINE_VALUES}")
        params.inline[: len(firsts)] = firsts
        params.inline[len(firsts) : end] = rows
        pointers = params.inline_address
    _queue(handle, total, warps, device, pointers)


def _queue(handle: int, total: int, warps: int, device: int, pointers: int) -> None:
    """Kernel `handle` over `total` programs of `warps` warps, its arguments at `pointers` (an array
    of pointers to them), on torch's current stream of the device numbered `device`."""
    launch = (handle, total, 1, 1, 32 * warps, 1, 1, 0, _current_stream(device), pointers, 0)
    if device == _current_device():
        _driver().launchKernel(*launch)
    else:
        with torch.cuda.device(device):  # the module's context
            _driver().launchKernel(*launch)


class BoundDiff:
    """`diff(table, firsts, boxes, total, key, words, counts, totals)` with every argument but
    `words` fixed, to be queued again and again (`bound(words)`, on torch's current stream): its
    arguments and their pointers are built once, as a bucket's `diff` runs every round on the same
    table and counts (the words, 4 bytes a 32 elements, are allocated each round, not held)."""

    _WORDS = 3
    """Where the words' address is among the arguments."""

    def __init__(
        self,
        table: torch.Tensor,
        firsts: torch.Tensor,
        boxes: int,
        total: int,
        key: tuple[int, bool],
        counts: torch.Tensor,
        totals: torch.Tensor,
    ):
        _check_path("diff", key, None)
        width, self._device, self._total = key[0], counts.get_device(), total
        anchor = anchor_address(self._device, width)
        values = [table.data_ptr(), firsts.data_ptr(), boxes, 0, counts.data_ptr(), totals.data_ptr(), anchor]
        self._values = np.array(values, dtype=np.int64)
        first = self._values.ctypes.data
        self._pointers = np.arange(first, first + 8 * len(values), 8, dtype=np.uint64)
        self._handle, self._warps = _functions(self._device)[_NAMES["diff", width]].ptr, WARPS["diff"][width]
        self._kept = (table, firsts, counts, totals)  # (their addresses are in `_values`)

    def __call__(self, words: torch.Tensor) -> None:
        if self._total:
            self._values[self._WORDS] = words.data_ptr()
            _queue(self._handle, self._total, self._warps, self._device, self._pointers.ctypes.data)


def _driver():
    """CuPy's bindings of the CUDA driver (`cuLaunchKernel`)."""
    from cupy.cuda import driver

    return driver


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_RAW_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
"""torch's raw calls behind `torch.cuda.current_stream` and `current_device`, where it has them
(looked up once: a lookup on `torch._C` costs 0.6 µs on this CPU, two a launch)."""


def _current_stream(device: int) -> int:
    """The address of torch's current stream on `device` (through the raw call Triton's launcher
    uses, a few microseconds cheaper than `torch.cuda.current_stream`, where torch has it)."""
    return _RAW_STREAM(device) if _RAW_STREAM is not None else torch.cuda.current_stream(device).cuda_stream


def _current_device() -> int:
    """torch's current CUDA device, by number (through the raw call behind
    `torch.cuda.current_device`, a few microseconds cheaper, where torch has it)."""
    return _RAW_DEVICE() if _RAW_DEVICE is not None else torch.cuda.current_device()


Rows = torch.Tensor | list[int] | np.ndarray
"""A launch's table (or its program starts): int64 on the device, or host values (a list, or an
int64 array for a table several launches carry), which the kernels that take an `Inline`
parameter carry there (`fits_inline`)."""
Inline = tuple[list[int] | np.ndarray, list[int] | np.ndarray]
"""A launch's inline values: its program starts, then its rows."""


class Address(NamedTuple):
    """Device memory a launch takes by its address `at` (on the device numbered `device`) rather
    than as a tensor, where a view would cost the host more than the launch: a launch reads only
    `data_ptr()` and `get_device()` of the tensors it is given. Whoever passes one keeps the memory
    alive until the launch is done (stream order: until later work on the stream may reuse it)."""

    at: int
    device: int

    def data_ptr(self) -> int:
        return self.at

    def get_device(self) -> int:
        return self.device


def _rows(table: Rows, firsts: Rows, takes_inline: bool) -> tuple[tuple[int, int], Inline | None]:
    """((table address, starts address), the launch's inline values): (0, 0) and (the starts, the
    rows) for host values; the tensors' addresses and none (empty, or None for a kernel without the
    parameter) otherwise."""
    if isinstance(table, torch.Tensor) and isinstance(firsts, torch.Tensor):
        return (table.data_ptr(), firsts.data_ptr()), ([], []) if takes_inline else None
    if not takes_inline or isinstance(table, torch.Tensor) or isinstance(firsts, torch.Tensor):
        raise ValueError("a launch takes its table and program starts both on the device or both inline (not diff)")
    return (0, 0), (firsts, table)


def _launch_rows(
    name: str,
    key: tuple[int, bool],
    density: int | None,
    total: int,
    table: Rows,
    firsts: Rows,
    boxes: int,
    *data: torch.Tensor | Address,
) -> None:
    """Kernel `name` over `total` programs of the rows `table` (program starts `firsts`, `boxes` rows;
    `Rows`), with the addresses of `data` and of the width's anchor after them: every kernel of
    the file takes its arguments in that order (`_check_path` refuses the launches it does not take)."""
    _check_path(name, key, density)
    width = key[0]
    if total:
        device = data[0].get_device()
        where, inline = _rows(table, firsts, name != "diff")
        addresses = (*(t.data_ptr() for t in data), anchor_address(device, width))
        _launch(_NAMES[name, width], WARPS[name][width], total, device, *where, boxes, *addresses, inline=inline)


def _check_path(name: str, key: tuple[int, bool], density: int | None) -> None:
    """Refuses a launch `sparse_fused` would not send here: off the vectorized path, or (`density`
    given) not busy."""
    if not key[1] or density == 0:
        busy, what = ("", key) if density is None else ("busy ", f"{key}, density {density}")
        raise ValueError(f"the CUDA {name} takes {busy}launches on the vectorized path, not {what}")


def diff(
    table: torch.Tensor,
    firsts: torch.Tensor,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    words: torch.Tensor,
    counts: torch.Tensor,
    totals: torch.Tensor,
) -> None:
    """`sparse_triton.diff` for rows on the vectorized path (`key`'s flag)."""
    _launch_rows("diff", key, None, total, table, firsts, boxes, words, counts, totals)


def compact(
    table: Rows,
    firsts: Rows,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    words: torch.Tensor,
    starts: torch.Tensor,
    blocks: torch.Tensor,
    density: int,
) -> None:
    """`sparse_triton.compact` for rows on the vectorized path (`key`'s flag): sparse ones (`density`
    0, `compact_sparse`) read their marked elements alone, from the stage where `diff` left them;
    busy ones (1, `compact_staged`) the stage where it holds them, else every element of the source;
    busier ones (2, `compact`: more than a stage holds) every element of the source."""
    name = ("compact_sparse", "compact_staged", "compact")[density]
    _launch_rows(name, key, None, total, table, firsts, boxes, words, starts, blocks)


def expand(
    table: Rows,
    firsts: Rows,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    starts: torch.Tensor | Address,
    density: int,
    guard: torch.Tensor | Address,
) -> None:
    """`sparse_triton.expand` for busy rows (`density` 1 or 2) on the vectorized path (`key`'s flag)."""
    _launch_rows("expand", key, density, total, table, firsts, boxes, starts, guard)


def starts(
    table: Rows,
    firsts: Rows,
    boxes: int,
    total: int,
    counts: torch.Tensor | Address,
    positions: torch.Tensor | Address,
    flags: torch.Tensor | Address,
    guard: torch.Tensor | Address,
    done: torch.Tensor | Address,
) -> None:
    """`sparse_triton.bitmap_counts` then `sparse_triton.scan` over every `RECV_*` row of `table`, in
    one launch: `firsts` gives a bitmap row one program every `STARTS_WARPS` tiles and any other
    row one; `counts` (int32, the tile counts) as `bitmap_counts` leaves them; `positions` (int64,
    each row's payload positions from its first slot), `flags` and `guard` as `scan` leaves its
    `starts` and flags; `done`: `boxes` zeroed int64 counters (the programs of a bitmap row count
    themselves off, and its last one scans it and zeroes its counter again: the launch leaves
    them as it found them)."""
    if total:
        where, inline = _rows(table, firsts, True)
        addresses = (counts, positions, flags, guard, done)
        args = (*where, boxes, *(t.data_ptr() for t in addresses))
        _launch(_STARTS, STARTS_WARPS, total, counts.get_device(), *args, inline=inline)


def blocked_check(
    table: Rows,
    firsts: Rows,
    boxes: int,
    total: int,
    starts: torch.Tensor | Address,
    flags: torch.Tensor | Address,
    guard: torch.Tensor | Address,
) -> None:
    """`sparse_triton.blocked_check`, any blocked row (strided or not: it reads the payload alone)."""
    if total:
        where, inline = _rows(table, firsts, True)
        args = (*where, boxes, starts.data_ptr(), flags.data_ptr(), guard.data_ptr())
        _launch(_BLOCKED_CHECK, BLOCKED_WARPS, total, starts.get_device(), *args, inline=inline)


def blocked_apply(
    table: Rows,
    firsts: Rows,
    boxes: int,
    total: int,
    key: tuple[int, bool],
    starts: torch.Tensor | Address,
    guard: torch.Tensor | Address,
) -> None:
    """`sparse_triton.blocked_apply`, any blocked row (it writes one element at a time, strided or not)."""
    if total:
        device, width = starts.get_device(), key[0]
        where, inline = _rows(table, firsts, True)
        args = (*where, boxes, starts.data_ptr(), guard.data_ptr(), anchor_address(device, width))
        _launch(_BLOCKED_APPLY[width], BLOCKED_WARPS, total, device, *args, inline=inline)


def place(
    rows: torch.Tensor,
    boxes: int,
    totals: torch.Tensor,
    width: int,
    dense: bool,
    buffer: torch.Tensor,
    out: torch.Tensor,
    firsts: torch.Tensor,
    placed: torch.Tensor,
    headers: torch.Tensor,
) -> None:
    """Each of the `boxes` SEND rows of `rows` (one key, `width`-byte elements, payloads in row order)
    encoded as `encodings.choose` picks from its count in `totals` (`dense`: dense may be picked),
    and laid out one after another in `buffer` (uint8), all on the device: `out` takes the rows
    `compact` reads, `firsts` each density class's program starts (`boxes + 1` values each, the
    three one after another), `placed` (int64, `placed_values(boxes)`) each row's code, byte offset
    and count, then the bytes in all, whether they fit in `buffer`, and each class's programs;
    `headers` (int64, 2 a row) each row's wire header, its code and count (`n` for dense), as a
    sparse round sends it."""
    device = rows.get_device()
    anchor = anchor_address(device, width)
    args = (rows.data_ptr(), boxes, totals.data_ptr(), width, int(dense), buffer.data_ptr(), buffer.numel(), anchor)
    tables = (out.data_ptr(), firsts.data_ptr(), placed.data_ptr(), headers.data_ptr())
    _launch(_PLACE, PLACE_THREADS // 32, 1, device, *args, *tables)


def placed_values(boxes: int) -> int:
    """int64 values of `place`'s `placed` for `boxes` rows."""
    return 3 * boxes + 5
