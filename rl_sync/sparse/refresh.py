"""When a round must run dense whatever was asked: the dense-refresh policy.

The policy, in the order the coordinator applies it to each round:

* **Baselines first.** Sparse and `auto` rounds send what changed since the
  values the trainers keep as baselines, so they run dense (`m2n`) until a
  dense round of every tensor has filled those baselines (trainers keep them
  from the first sparse or auto request on), and again after a repair or
  patches, which leave the baselines describing other values than the workers
  hold.
* **Refresh.** With `every` = K > 0, every K-th sparse or auto round runs
  dense: once K - 1 of them ran since the last full dense round.
* **Full round.** Until a round succeeded since the group formed (or was
  repaired, or a colocated worker's memory moved), the workers hold unrelated
  weights: the next round carries every tensor, dense (`m2n` for a sparse or
  auto request, as asked otherwise).

A round that fails changes nothing here (the coordinator marks the group
broken, and the repair that follows starts over). Pure: no Ray, no torch.

Typical use (inside the coordinator)::

    refresh = RefreshPolicy(every=config.dense_refresh_every)
    mode, reason = refresh.round_mode(asked)
    full = refresh.full_round(mode)          # (mode, reason) when every tensor must go, else None
    ...                                      # run the round
    first = refresh.finished(ran, every_tensor=names is None)
"""

from __future__ import annotations

from ..config.sync import SPARSE_MODES, Mode


class RefreshPolicy:
    """The state behind the policy in the module docstring, for one sync group."""

    def __init__(self, every: int = 0):
        self.every = every
        """Run every `every`-th sparse or auto round dense (0: never)."""
        self.needs_full_round = True
        """Workers hold unrelated weights until a round succeeds: the next carries every tensor."""
        self.baselines = False
        """Trainers keep baselines (set by the first sparse or auto request, kept after)."""
        self.baselines_ready = False
        """The baselines hold what every worker holds (a full dense round ran with them on)."""
        self.since_dense = 0
        """Sparse or auto rounds since the last full dense one."""

    def round_mode(self, asked: Mode) -> tuple[Mode, str]:
        """The mode a round asked for as `asked` runs, and why when that is not `asked`
        (baselines first, then the refresh); a sparse or auto request turns baselines on."""
        if asked not in SPARSE_MODES:
            return asked, ""
        self.baselines = True
        if not self.baselines_ready:
            return "m2n", f"{asked}: a dense round first fills the baselines sparse rounds diff against"
        if self.every and self.since_dense + 1 >= self.every:
            return "m2n", f"{asked}: the dense refresh due every {self.every} rounds"
        return asked, ""

    def full_round(self, mode: Mode) -> tuple[Mode, str] | None:
        """When the round must carry every tensor: its mode (`m2n` for a sparse or auto `mode`,
        else `mode`) and why; None otherwise."""
        if not self.needs_full_round:
            return None
        why = "the first round after init or a repair carries every tensor, dense"
        return ("m2n" if mode in SPARSE_MODES else mode), why

    def finished(self, mode: str, every_tensor: bool) -> bool:
        """Record a round that succeeded in `mode` (after `auto`'s choice); True when it was the
        first full round the workers needed."""
        first, self.needs_full_round = self.needs_full_round, False
        if mode in SPARSE_MODES:
            self.since_dense += 1
        elif self.baselines and every_tensor:
            self.baselines_ready, self.since_dense = True, 0
        return first

    def regrouped(self) -> None:
        """The group was re-formed (a repair): a full round first, and fresh baselines."""
        self.needs_full_round, self.baselines_ready = True, False

    def memory_moved(self) -> None:
        """A colocated worker's memory moved: it holds what its engine put there."""
        self.needs_full_round = True

    def patched(self) -> None:
        """Patches changed the workers behind the trainers' baselines."""
        self.baselines_ready = False
