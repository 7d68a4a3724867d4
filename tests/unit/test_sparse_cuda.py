"""`engine.sparse_cuda` without a GPU: the choice of kernels, and the CUDA source's constants coming
from their Python definitions (the kernels themselves run in `tests/gpu/test_sparse_triton.py`)."""

from __future__ import annotations

import importlib.resources
import re
import sys
import types
import warnings

import pytest
import torch

from rl_sync.engine import sparse_cuda, sparse_table

CUDA = torch.device("cuda", 0)


def test_an_unknown_kernel_choice_is_refused(monkeypatch):
    monkeypatch.setenv("RL_SYNC_SPARSE_KERNELS", "cupy")
    expected = "RL_SYNC_SPARSE_KERNELS='cupy': expected 'cuda' (the default, where CuPy is installed) or 'triton'"
    with pytest.raises(ValueError, match=re.escape(expected)):
        sparse_cuda.usable(CUDA)


def test_asking_for_triton_keeps_every_launch_on_triton_and_a_cpu_never_takes_cuda(monkeypatch):
    monkeypatch.setattr(sparse_cuda, "_source_compiles", lambda device: True)  # as if CuPy compiled it
    for choice, cuda in (("triton", False), (" Triton ", False), ("CUDA", True), ("", True)):
        monkeypatch.setenv("RL_SYNC_SPARSE_KERNELS", choice)
        assert sparse_cuda.usable(CUDA) is cuda, choice
        assert not sparse_cuda.usable(torch.device("cpu"))


def test_the_cuda_source_ships_with_the_package_and_reads_only_constants_defined_in_python():
    source = importlib.resources.files("rl_sync.engine").joinpath("sparse_kernels.cu").read_text()
    used = set(re.findall(r"\b(?:SEND_[A-Z_]+|RECV_[A-Z_]+|INT32_INDEX|UINT16_OFFSET|NO_INDEX|BLOCK)\b", source))
    macros = dict(m[2:].split("=") for m in sparse_cuda._macros())
    assert used and used <= set(macros)
    assert macros["SEND_COLUMNS"] == str(sparse_table.SEND_COLUMNS) and macros["RECV_K"] == str(sparse_table.RECV_K)
    assert macros["UINT16_OFFSET"] == "2" and macros["BLOCK"] == str(1 << 16)
    placing = set(re.findall(r"\b(?:CODE_[A-Z]+|ALIGN|MAX_INDEX|BUSY|BUSIER)\b", source))
    assert placing <= set(macros) and len(placing) == 8
    assert (macros["CODE_BLOCKED"], macros["BUSY"], macros["BUSIER"]) == ("3", "32", "5")


def test_a_source_that_does_not_compile_warns_once_and_leaves_triton_in_place(monkeypatch):
    def refuse(device):
        raise RuntimeError("nvrtc: no such library")

    monkeypatch.setenv("RL_SYNC_SPARSE_KERNELS", "cuda")
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))  # CuPy imports, NVRTC fails
    monkeypatch.setattr(sparse_cuda, "_functions", refuse)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    sparse_cuda._source_compiles.cache_clear()
    try:
        with pytest.warns(UserWarning, match=re.escape("(nvrtc: no such library); using Triton's")):
            assert not sparse_cuda.usable(CUDA)
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            assert not sparse_cuda.usable(CUDA)
        assert again == []  # the outcome is kept: no second compile, no second warning
    finally:
        sparse_cuda._source_compiles.cache_clear()


@pytest.mark.slow  # 1 min of NVRTC on a 2-core machine; the GPU tests compile and run it on the H200
def test_the_cuda_source_compiles_for_an_h200_without_a_warning_and_names_every_kernel():
    """NVRTC (the `nvrtc` extra) builds the file as `sparse_cuda` does, for sm_90, on this machine:
    a kernel that no longer compiles, or a template `sparse_cuda` names that the file lacks, fails
    here rather than on the first GPU that runs it."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc")
    try:
        created, program = nvrtc.nvrtcCreateProgram(sparse_cuda._source().encode(), b"sparse_kernels.cu", 0, [], [])
    except RuntimeError as error:  # the bindings, but no NVRTC library to load
        pytest.skip(f"NVRTC is not installed: {error}")
    assert created == nvrtc.nvrtcResult.NVRTC_SUCCESS
    names = sparse_cuda._names()
    for name in names:
        assert nvrtc.nvrtcAddNameExpression(program, name.encode()) == (nvrtc.nvrtcResult.NVRTC_SUCCESS,)
    options = [option.encode() for option in (*sparse_cuda._options(), "-arch=sm_90")]
    (compiled,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = bytearray(size)  # (NVRTC writes into it: `b" " * 1` is CPython's cached one-byte object)
    nvrtc.nvrtcGetProgramLog(program, log)
    assert (compiled, bytes(log).rstrip(b"\0").strip().decode()) == (nvrtc.nvrtcResult.NVRTC_SUCCESS, "")
    lowered = [nvrtc.nvrtcGetLoweredName(program, name.encode()) for name in names]
    assert all(result == nvrtc.nvrtcResult.NVRTC_SUCCESS and symbol for result, symbol in lowered)
    per_width = ("diff", "compact", "compact_staged", "compact_sparse", "expand", "blocked_apply")
    once = ("starts", "blocked_check", "place")
    assert len({symbol for _, symbol in lowered}) == len(names) == 4 * len(per_width) + len(once)
    nvrtc.nvrtcDestroyProgram(program)
