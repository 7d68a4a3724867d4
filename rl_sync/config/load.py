"""Load YAML files from `configs/` into the project's frozen dataclasses.

Unknown keys, missing fields and ill-typed values are a `ValueError` naming the
key and the file. Command-line overrides take `a.b=value` (the value parsed as
YAML, so `bucket_bytes=1048576` is an int and `mode=sparse` a string).

Typical use::

    cfg = load_config("configs/plan_dense_8b.yaml", PlanReport, ["trainer.ranks=16"])
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import dacite
import yaml

T = TypeVar("T")


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true / false. YAML 1.1 also reads `off`, `on`, `no`, `yes` as
    booleans, which would turn `integrity: off` or `colocate: off` into False."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def parse_overrides(args: Sequence[str]) -> list[tuple[list[str], Any]]:
    """`["a.b=1", "--c", "x", "--d=2"]` -> `[(["a", "b"], 1), (["c"], "x"), (["d"], 2)]`."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--") and "=" not in arg:
            if i + 1 >= len(args):
                raise ValueError(f"override {arg!r} needs a value: '--key value' or 'key=value'")
            key, value, i = arg[2:], args[i + 1], i + 2
        elif "=" in arg:
            key, value = arg.removeprefix("--").split("=", 1)
            i += 1
        else:
            raise ValueError(f"cannot read override {arg!r}: expected 'key=value' or '--key value'")
        if not key:
            raise ValueError(f"override {arg!r} has an empty key")
        out.append((key.replace("-", "_").split("."), _yaml(value)))
    return out


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """Set each `a.b=value` override into a nested dict (creating levels)."""
    for path, value in parse_overrides(overrides):
        node = data
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"override {'.'.join(path)}: {part!r} is not a section")
        node[path[-1]] = value
    return data


def _unknown_keys(cls: type, data: dict, prefix: str = "") -> list[str]:
    """Dotted paths of keys in `data` that no (nested) dataclass field takes."""
    hints = typing.get_type_hints(cls)
    unknown = []
    for key, value in data.items():
        if key not in hints:
            unknown.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            unknown.extend(_unknown_keys(hints[key], value, f"{prefix}{key}."))
    return unknown


def from_dict(cls: type[T], data: Any, source: str) -> T:
    """Build `cls` from plain data; errors name the key and `source`."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    unknown = _unknown_keys(cls, data)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} (not fields of {cls.__name__})")
    try:
        return dacite.from_dict(cls, data, config=dacite.Config(strict=True, cast=[tuple]))
    except dacite.DaciteFieldError as exc:
        raise ValueError(f"{source}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_config(path: str | Path, cls: type[T], overrides: Sequence[str] = ()) -> T:
    """Read YAML `path` into dataclass `cls`, after `key=value` overrides."""
    path = Path(path)
    try:
        data = _yaml(path.read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    return from_dict(cls, apply_overrides(data, overrides), str(path))
