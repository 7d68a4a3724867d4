"""Checks on `WeightSync.push` arguments, made on the driver before anything is sent.

Typical use::

    version, names, mode = check_push_args(version, names, mode)

A version is an int (numpy integers are taken as ints; bools, floats and
strings are refused); names are a non-empty list or tuple of str (a single
str is refused, not split into characters); a mode is one of the push modes.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence

from .sync import CHOICES, Mode

MAX_VERSION = (1 << 63) - 1


def check_version(version) -> int | None:
    if version is None:
        return None
    if isinstance(version, (bool, str, bytes, float)):
        raise TypeError(f"push: version must be an int, got {version!r} ({type(version).__name__})")
    try:
        value = operator.index(version)
    except TypeError:
        raise TypeError(f"push: version must be an int, got {version!r} ({type(version).__name__})") from None
    if not 0 < value <= MAX_VERSION:
        raise ValueError(f"push: version must be in [1, 2**63 - 1], got {value}")
    return value


def check_names(names) -> list[str] | None:
    if names is None:
        return None
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise TypeError(f"push: names must be a list of tensor names, got {type(names).__name__} {names!r:.80}")
    if not names:
        raise ValueError("push: names is empty (nothing to move); pass None to push every tensor")
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"push: every name must be a str, got {bad[0]!r} ({type(bad[0]).__name__})")
    repeated = repeated_names(names)
    if repeated:
        raise ValueError(f"push: names repeat {repeated[:5]}")
    return list(names)


def repeated_names(names) -> list[str]:
    """The names that occur more than once, sorted."""
    return sorted(n for n, count in Counter(names).items() if count > 1)


def check_mode(mode) -> Mode | None:
    if mode is not None and mode not in CHOICES["mode"]:
        raise ValueError(f"push: mode must be one of {', '.join(map(repr, CHOICES['mode']))} or None, got {mode!r}")
    return mode


def check_push_args(version, names, mode) -> tuple[int | None, list[str] | None, Mode | None]:
    return check_version(version), check_names(names), check_mode(mode)
