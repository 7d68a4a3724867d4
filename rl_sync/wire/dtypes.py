"""Dtype names as they travel on the wire, and their sizes in bytes.

Names are torch's attribute names (`"bfloat16"`, `"float8_e4m3fn"`); the
planner needs only the byte size, so this module imports no torch.
"""

from __future__ import annotations

ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}


def itemsize(name: str, what: str = "tensor") -> int:
    """Bytes per element of dtype `name`; `ValueError` naming `what` if unknown."""
    size = ITEMSIZE.get(name) if isinstance(name, str) else None
    if size is None:
        raise ValueError(
            f"{what}: unknown dtype name {name!r}; expected one of {sorted(ITEMSIZE)} "
            "(torch attribute names, e.g. 'bfloat16')"
        )
    return size


CASTABLE = frozenset({"float64", "float32", "float16", "bfloat16"})
"""Dtypes a sender casts between on the way (round to nearest even, as `Tensor.copy_` and
vLLM's loader do): fp32 master weights into a bf16 engine, for instance."""


def check_cast(name: str, src: str, dst: str) -> None:
    """`ValueError` unless tensor `name` can travel from dtype `src` to dtype `dst`: the same
    dtype, or two of `CASTABLE` (quantized and integer destinations need the source's own dtype)."""
    if src == dst or (src in CASTABLE and dst in CASTABLE):
        return
    raise ValueError(
        f"tensor {name!r}: source dtype {src!r} and destination dtype {dst!r} disagree; senders cast "
        f"only between {sorted(CASTABLE)}, so send {dst!r} or bind a destination of dtype {src!r}"
    )


def dtype_name(dtype: object) -> str:
    """The wire name of a torch dtype (`torch.bfloat16` -> `"bfloat16"`)."""
    name = str(dtype).removeprefix("torch.")
    itemsize(name, "dtype")
    return name
