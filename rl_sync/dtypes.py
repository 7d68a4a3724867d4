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


def dtype_name(dtype: object) -> str:
    """The wire name of a torch dtype (`torch.bfloat16` -> `"bfloat16"`)."""
    name = str(dtype).removeprefix("torch.")
    itemsize(name, "dtype")
    return name
