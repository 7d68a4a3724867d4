"""Load YAML files from `configs/` into the project's frozen dataclasses.

Unknown keys, missing fields and ill-typed values are a `ValueError` naming the
key and the file. Command-line overrides take `a.b=value` (the value parsed as
YAML, so `bucket_bytes=1048576` is an int and `mode=sparse` a string).

Input is bounded before anything is built from it: a file is at most
`MAX_CONFIG_BYTES`, nesting at most `MAX_DEPTH` levels deep, YAML aliases
(`*name`, and so merge keys through them) are refused, and so is a key given
twice in one mapping; each is a one-line `ValueError` naming the line.

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


MAX_CONFIG_BYTES = 1 << 20
"""1 MiB: far above any config, small enough that every error message built from it is cheap."""
MAX_DEPTH = 32
"""Nesting levels of mappings and sequences (and dotted override keys)."""
MAX_MESSAGE_CHARS = 400
"""An error quoting a value quotes at most this much of it."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans: only true / false. YAML 1.1 also reads `off`, `on`, `no`, `yes` as
    booleans, which would turn `integrity: off` or `colocate: off` into False. Refuses aliases,
    nesting deeper than `MAX_DEPTH` and repeated keys (see the module docstring)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        mark: Any = event.start_mark  # typed by PyYAML's stubs as a union its errors do not take
        if isinstance(event, yaml.AliasEvent):
            problem = f"alias *{event.anchor}: configs take no YAML aliases, write the value out"
            raise yaml.composer.ComposerError(None, None, problem, mark)
        if self.depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """The mapping, once no key in it is given twice (a merge key `<<` aside)."""
        first: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                seen = first.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base constructor refuses it
                continue
            if seen is not key_node:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"key {key!r} given twice (first on line {seen.start_mark.line + 1}); give each key once",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep)


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def _yaml_error(exc: yaml.YAMLError, source: str) -> ValueError:
    """A YAML error in `source` on one line: where and what (PyYAML's own text spans several)."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return ValueError(f"{source}: not valid YAML: {clip(str(exc))}")
    what = "; ".join(filter(None, (exc.context, exc.problem)))
    mark = exc.problem_mark or exc.context_mark
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return ValueError(f"{source}{where}: {clip(what)}")


def clip(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """`text` on one line, cut to `limit` characters (marked with '...'): an error quoting a value
    stays short."""
    text = " ".join(text.splitlines())
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


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
        out.append((_override_key(arg, key), _override_value(key, value)))
    return out


def _override_key(arg: str, key: str) -> list[str]:
    path = key.replace("-", "_").split(".")
    if not all(path):
        raise ValueError(f"override {clip(arg)!r} has an empty key")
    if len(path) > MAX_DEPTH:
        raise ValueError(f"override key {clip(key)!r} is nested deeper than {MAX_DEPTH} levels")
    return path


def _override_value(key: str, value: str) -> Any:
    try:
        return _yaml(value)
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, f"override {clip(key)}") from None


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


def _check_mapping(data: Any, source: str) -> None:
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")


def from_dict(cls: type[T], data: Any, source: str) -> T:
    """Build `cls` from plain data; errors name the key and `source`."""
    _check_mapping(data, source)
    unknown = _unknown_keys(cls, data)
    if unknown:
        raise ValueError(f"{source}: unknown key(s) {', '.join(unknown)} (not fields of {cls.__name__})")
    try:
        return dacite.from_dict(cls, data, config=dacite.Config(strict=True, cast=[tuple]))
    except (dacite.DaciteFieldError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {clip(str(exc))}") from None


def load_config(path: str | Path, cls: type[T], overrides: Sequence[str] = ()) -> T:
    """Read YAML `path` into dataclass `cls`, after `key=value` overrides."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"cannot read config {path}: {exc.strerror}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than the {MAX_CONFIG_BYTES} bytes a config may hold")
    try:
        data = _yaml(raw.decode()) or {}
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise _yaml_error(exc, str(path)) from None
    _check_mapping(data, str(path))
    return from_dict(cls, apply_overrides(data, overrides), str(path))
