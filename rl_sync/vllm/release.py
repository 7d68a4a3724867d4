"""What a commit replaced, released on a thread of its own after the commit returns.

A staged commit on CPUs installs processed twins into the live modules
(`rl_sync.vllm.reload.install`); what they replace (the previous round's kernels, such as
vLLM's oneDNN handles with their packed weights, and the twins, which hold the previous
round's memory after the swaps) is released here instead of inside the commit, where
releasing it took most of the commit: the commit step went from 47 to 13 ms (vLLM's CPU
build at TP2, 12 layers of Qwen2-0.5B shapes, `benchmarks/staged_bench.py`). Nothing reads
those objects any more: the live modules hold the new kernels before the commit returns.
The kernels' own release (`release_dnnl_matmul_handler`, a torch operator) runs without the
GIL, beside the engine. The thread drops the objects one at a time and offers the GIL between
them: dropped in one `list.clear()` (a single C call that frees every tensor they hold), they
kept the GIL from the rank's thread while the commit returned, and the commit step took a
median 14 to 15 ms against 6 ms (4 layers, the same benchmark, 2026-12-07).

Ordering contract: the next round's processing (`prepare`, `after_update`) and the next release
wait for the release before, at most `RELEASE_WAIT_S`; one that outlives it runs on beside them
(it only drops what nothing reads).

Typical use (inside `rl_sync.vllm.reload.Processor`)::

    releaser.wait()                       # before processing anew
    releaser.release([twins, replaced])   # after the commit installed them
"""

from __future__ import annotations

import threading
import time

from ..rank.background import joined

RELEASE_WAIT_S = 30.0
"""How long processing waits for the previous release before it goes on beside it."""


class Releaser:
    """Drops objects on a thread of its own (see the module docstring)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def release(self, objects: list) -> None:
        """Drop what `objects` holds on a new thread, after the one before; `objects` is emptied
        here, so the objects are released there as long as the caller holds them nowhere else."""
        self.wait()
        if not objects:
            return
        held = objects[:]
        objects.clear()
        self._thread = threading.Thread(target=_drop_one_by_one, args=(held,), name="rl-sync-release", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """The last release finished (waiting at most `RELEASE_WAIT_S`; past it, a warning, and
        processing goes on beside it: it only drops what nothing reads)."""
        thread, self._thread = self._thread, None
        joined(thread, RELEASE_WAIT_S, "releasing a commit's replaced kernels")


def _drop_one_by_one(held: list) -> None:
    """Drop `held`'s objects one at a time, offering the GIL between them: `list.clear()` frees
    them all in one C call, holding the GIL throughout, while the commit's thread waits for it."""
    for i in range(len(held)):
        held[i] = None
        time.sleep(0)
