"""Call one method on many actors at once, bounded in time, with named failures."""

from __future__ import annotations

from collections.abc import Sequence

import ray


class SyncError(RuntimeError):
    """A sync init or round failed; the message names who failed and where."""


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    summary = lines[0].split(", \x1b")[0].split(" [36m")[0]
    return f"{type(exc).__name__}: {summary}" + (f" ... {lines[-1]}" if len(lines) > 1 else "")


def call_all(handles: Sequence, method: str, args: Sequence[tuple], timeout_s: float, labels: Sequence[str], what: str) -> list:
    """`handle.method(*args[i])` on every handle concurrently; all results, or `SyncError`.

    Waits at most `timeout_s` seconds. The error lists every rank that raised
    (with its own message, which names its bucket and tensors) and every rank
    that had not answered when the time ran out.
    """
    refs = [getattr(h, method).remote(*a) for h, a in zip(handles, args)]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    done = set(ready)
    results, failures = [], []
    for ref, label in zip(refs, labels):
        if ref not in done:
            failures.append(f"{label}: no answer within {timeout_s:.0f} s")
            results.append(None)
            continue
        try:
            results.append(ray.get(ref))
        except ray.exceptions.RayError as exc:
            failures.append(f"{label}: {_cause(exc)}")
            results.append(None)
    if failures:
        for ref in refs:
            if ref not in done:
                ray.cancel(ref, force=False)
        raise SyncError(f"{what} failed on {len(failures)} of {len(refs)} ranks:\n  " + "\n  ".join(failures))
    return results
