"""Sandblaster's work portions and backup tasks, as pure bookkeeping.

Dean et al. 2012, section 4.2: the batch of one objective evaluation is cut
into many small work portions, handed to whichever replica is free; near the
end of the batch the coordinator hands out copies of the portions still
outstanding ("backup tasks") and takes whichever copy finishes first. This
module holds that policy with no TensorFlow in it, so it is tested on its own;
`objective.SandblasterObjective` runs it on a cluster.

* `portion_bounds` cuts `num_examples` into contiguous portions.
* `PortionLedger` tracks one evaluation: the copies of each portion, which
  copy was accepted, which portions want a backup copy now.
* `SlotPool` hands out the gradient slots that copies write into; a slot comes
  back only when the copy that writes it has finished, so a late copy can never
  overwrite a slot that another copy is using.
"""

from __future__ import annotations

import dataclasses

from tf_distbelief import checks

__all__ = ["PortionLedger", "SandblasterStats", "SlotPool", "portion_bounds"]


def portion_bounds(num_examples: int, portions: int) -> list[int]:
    """Start of each portion, then `num_examples`: `portions + 1` ints.

    The first `num_examples % portions` portions hold one example more (the
    "div" layout of `ps_vectors.shard_sizes`).

    Raises:
      ValueError: `portions` is not in `[1, num_examples]`.
    """
    if not checks.is_int(portions):
        raise checks.argument_error("portions", "an int", portions)
    if not 1 <= portions <= num_examples:
        raise checks.argument_error(
            "portions", f"in [1, {num_examples}] (the number of examples)", portions
        )
    base, extra = divmod(num_examples, portions)
    bounds = [0]
    for i in range(portions):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


@dataclasses.dataclass
class PortionLedger:
    """The copies of each portion of one evaluation, and the one accepted.

    Exactly once: `finish` accepts a copy only if no copy of its portion was
    accepted before; every later copy of that portion is reported as discarded.
    The caller adds up only accepted copies, so no portion is counted twice and,
    once `complete`, none is missing.

    Args:
      num_portions: portions of the evaluation.
      max_copies: most copies of one portion in flight (1 disables backups).

    Attributes:
      copies: `[num_portions]` copies scheduled so far per portion.
      accepted: `[num_portions]` the accepted copy's payload, or None.
    """

    num_portions: int
    max_copies: int = 2
    copies: list[int] = dataclasses.field(init=False)
    accepted: list = dataclasses.field(init=False)

    def __post_init__(self):
        self.copies = [0] * self.num_portions
        self.accepted = [None] * self.num_portions

    def scheduled(self, portion: int) -> int:
        """Records a new copy of `portion`; returns its copy index (0: primary)."""
        self.copies[portion] += 1
        return self.copies[portion] - 1

    def finish(self, portion: int, payload) -> bool:
        """Records a finished copy; True if it is the first, i.e. accepted."""
        if self.accepted[portion] is not None:
            return False
        self.accepted[portion] = payload
        return True

    @property
    def complete(self) -> bool:
        """True once every portion has an accepted copy."""
        return all(a is not None for a in self.accepted)

    @property
    def outstanding(self) -> list[int]:
        """Portions without an accepted copy, in portion order."""
        return [p for p, a in enumerate(self.accepted) if a is None]

    def backups_wanted(self, idle_workers: int) -> list[int]:
        """Portions to copy now onto `idle_workers` free workers.

        A worker is idle only once nothing is queued, i.e. every portion not yet
        accepted is already running: the end of the batch, when the paper hands
        out backups. The oldest outstanding portions with at least one and fewer
        than `max_copies` copies go first, at most one new copy each per call.
        """
        wanted = [p for p in self.outstanding if 0 < self.copies[p] < self.max_copies]
        return wanted[: max(0, idle_workers)]


class SlotPool:
    """Indices of the gradient slots on the ps, lent to one copy at a time.

    Args:
      num_slots: slots in the pool.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self) -> int:
        """Returns a free slot (the lowest), or raises if none is free."""
        if not self._free:
            raise RuntimeError("No free gradient slot; wait for a copy to finish.")
        self._free.sort()
        return self._free.pop(0)

    def release(self, slot: int) -> None:
        if slot in self._free or not 0 <= slot < self.num_slots:
            raise ValueError(f"Slot {slot} is not lent out.")
        self._free.append(slot)


@dataclasses.dataclass
class SandblasterStats:
    """Counters of a `SandblasterObjective`, summed over its evaluations.

    Attributes:
      evaluations: objective evaluations (calls).
      portions_scheduled: primary copies, `portions` per evaluation.
      backup_copies_scheduled: backup copies.
      copies_accepted: copies counted, exactly one per portion and evaluation.
      copies_discarded: copies that finished after another copy of their portion
        had been accepted; their gradient was never added.
      accepted_by_worker: accepted copies per worker index (load balancing).
      evaluation_secs: wall time of each evaluation.
    """

    evaluations: int = 0
    portions_scheduled: int = 0
    backup_copies_scheduled: int = 0
    copies_accepted: int = 0
    copies_discarded: int = 0
    accepted_by_worker: dict[int, int] = dataclasses.field(default_factory=dict)
    evaluation_secs: list[float] = dataclasses.field(default_factory=list)
