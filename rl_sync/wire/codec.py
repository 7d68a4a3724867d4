"""msgpack codecs for everything the coordinator ships: strict, typed, no pickle.

A wire type is a frozen dataclass of plain fields (int, float, bool, str,
bytes, lists, tuples, str/int-keyed dicts, Optional, Literal and nested wire
dataclasses). `encode(obj)` wraps it as `{"schema", "type", "body"}`;
`decode(cls, data)` checks the schema version and type name and rebuilds the
dataclass, rejecting missing, extra and ill-typed fields with a `ValueError`
that names the field path. Any malformed input, random bytes included, raises
`ValueError` and nothing else.

Typical use::

    blob = encode(PlanInfo.from_schedule(schedule))
    schedule = decode(PlanInfo, blob).to_schedule()
"""

from __future__ import annotations

import dataclasses
import types
import typing
import zlib
from typing import Any, Literal, TypeVar, Union

import msgpack

SCHEMA_VERSION = 1
T = TypeVar("T")
_HINTS: dict[type, dict[str, Any]] = {}


def encode(obj: Any, compress: bool = False) -> bytes:
    """Serialise a wire dataclass (with schema version and type name).

    `compress=True` zlib-compresses the body (large, repetitive messages such
    as a plan's tensor names)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        raise TypeError(f"encode expects a wire dataclass instance, got {type(obj).__name__}")
    body: Any = {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if compress:
        body = zlib.compress(msgpack.packb(body, use_bin_type=True), 6)
    envelope = {"schema": SCHEMA_VERSION, "type": type(obj).__name__, "zlib": compress, "body": body}
    return msgpack.packb(envelope, use_bin_type=True)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


MAX_ITEMS = 1 << 23
"""Most array elements plus map entries one message may hold: unpacking builds a Python object
for each (tens of bytes from as little as one byte on the wire), so this, not the byte size,
bounds a decode's memory (about 0.5 GiB). A Kimi-K2-sized plan holds about 0.5 million."""
INT_RANGE = (-(1 << 63), 1 << 63)
"""Ints on the wire fit int64, so no arithmetic on them overflows into an `OverflowError`."""


def decode(cls: type[T], data: bytes, max_bytes: int = 256 << 20, max_items: int = MAX_ITEMS) -> T:
    """Rebuild a `cls` from `encode` output; `ValueError` on anything malformed, including a
    message of more than `max_bytes` (inflated too) or `max_items` elements."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"{cls.__name__}: expected bytes, got {type(data).__name__}")
    if len(data) > max_bytes:
        raise ValueError(f"{cls.__name__}: message of {len(data)} bytes exceeds the {max_bytes}-byte limit")
    envelope = _exact_keys(_unpack(data, cls.__name__, max_items), {"schema", "type", "zlib", "body"}, cls.__name__)
    if envelope["schema"] != SCHEMA_VERSION or type(envelope["schema"]) is not int:
        raise ValueError(
            f"{cls.__name__}: schema version {envelope['schema']!r} is not supported; expected {SCHEMA_VERSION}"
        )
    if envelope["type"] != cls.__name__:
        raise ValueError(f"expected a {cls.__name__} message, got type {envelope['type']!r}")
    body = envelope["body"]
    if envelope["zlib"] is True and isinstance(body, bytes):
        body = _unpack(_inflate(body, max_bytes, cls.__name__), cls.__name__, max_items)
    elif envelope["zlib"] is not False:
        raise ValueError(f"{cls.__name__}: field 'zlib' must be a bool with a bytes body when true")
    return _build(cls, body, cls.__name__)


class _TooMany(Exception):
    pass


def _unpack(data: bytes, what: str, max_items: int) -> Any:
    """msgpack, stopped as soon as the containers built so far hold more than `max_items`
    elements (each array's length is checked before it is built, totals as they grow)."""
    count = 0

    def counted(container):
        nonlocal count
        count += len(container)
        if count > max_items:
            raise _TooMany
        return container

    try:
        return msgpack.unpackb(
            bytes(data),
            raw=False,
            strict_map_key=False,
            list_hook=counted,
            object_hook=counted,
            max_array_len=max_items,
            max_map_len=max_items,
        )
    except _TooMany:
        raise ValueError(f"{what}: message holds more than {max_items} items") from None
    except Exception as exc:  # msgpack raises several types on malformed input
        raise ValueError(f"{what}: not a valid msgpack message ({type(exc).__name__}: {exc})") from None


def _inflate(data: bytes, max_bytes: int, what: str) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, max_bytes)
    except zlib.error as exc:
        raise ValueError(f"{what}: corrupt compressed body ({exc})") from None
    if inflater.unconsumed_tail:
        raise ValueError(f"{what}: compressed body inflates past the {max_bytes}-byte limit")
    if not inflater.eof:
        raise ValueError(f"{what}: compressed body is truncated")
    return out


def _exact_keys(raw: Any, expected: set[str], path: str) -> dict:
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a map, got {type(raw).__name__}")
    keys = set(raw)
    if keys != expected:
        missing = sorted(str(k) for k in expected - keys)
        extra = sorted(str(k) for k in keys - expected)
        raise ValueError(f"{path}: missing fields {missing}, unexpected fields {extra}")
    return raw


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _build(cls: type, raw: Any, path: str) -> Any:
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    raw = _exact_keys(raw, set(fields), path)
    hints = _hints(cls)
    values = {name: _convert(hints[name], raw[name], f"{path}.{name}") for name in fields}
    try:
        return cls(**values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None


_SCALARS = {int: (int,), float: (float, int), str: (str,), bytes: (bytes,), bool: (bool,)}


def _convert(hint: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        if value is not None:
            raise ValueError(f"{path}: expected nil, got {type(value).__name__}")
        return None
    if hint in _SCALARS:
        if not isinstance(value, _SCALARS[hint]) or (hint is not bool and isinstance(value, bool)):
            raise ValueError(f"{path}: expected {hint.__name__}, got {type(value).__name__}")
        if hint is int:
            _check_ints(path, (value,))
        return float(value) if hint is float else value
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _build(hint, value, path)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, path)
            except ValueError as exc:
                errors.append(str(exc))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        if value not in args or type(value) is not type(args[0]):
            raise ValueError(f"{path}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (list, tuple):
        return _sequence(origin, args, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a map, got {type(value).__name__}")
        return {_convert(args[0], k, f"{path}[key]"): _convert(args[1], v, f"{path}[{k!r}]") for k, v in value.items()}
    raise TypeError(f"{path}: unsupported wire type {hint!r}")


def _sequence(origin: type, args: tuple, value: Any, path: str) -> Any:
    if not isinstance(value, list):
        raise ValueError(f"{path}: expected an array, got {type(value).__name__}")
    if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
        if len(value) != len(args):
            raise ValueError(f"{path}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    item = args[0]
    if item in (int, str) and all(type(v) is item for v in value):
        items = value
        if item is int:
            _check_ints(path, value)
    else:
        items = [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


def _check_ints(path: str, values) -> None:
    if values and not (INT_RANGE[0] <= min(values) and max(values) < INT_RANGE[1]):
        raise ValueError(f"{path}: ints must fit int64, got {max(values, key=abs)}")
