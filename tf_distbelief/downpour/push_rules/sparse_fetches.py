"""Sparse fetches: a fetch sends only the entries changed since the last one.

When pushes are sparse (a selecting rule, `top_k`), an applied push changes
only the entries it sent, so a replica's fetch need not move the whole model:
the entries changed on the ps since that replica's last fetch are enough.
SparseLoCo (Sarfi et al. 2025, "SparseLoCo: Communication-Efficient LLM
Training") exchanges only the sparse aggregated updates in the same way.
Setting (`DownpourConfig` keyword argument and launch flag):

* `sparse_fetches`: False (default): off. True: the ps keeps, next to each
  shard, one flag per entry and replica: set for every replica at each entry
  an applied push changed (sent a non-zero value for), cleared for a replica
  by its fetch. A fetch sends the flagged entries' int32 positions and
  values; the replica writes them into its mirror of the ps values (one
  more copy of the model on the worker, not checkpointed) and copies the
  mirror into its cache. The cache then holds exactly what a whole fetch
  would have put there. A replica's first fetch (and its first after a
  restart or a resume, when its mirror is new) moves the whole model.

Needs a selecting rule (`top_k_fraction`), `n_fetch >= 2` (a cached
replica), and, with the outer optimizer, `outer_momentum = 0`: the outer
momentum moves every entry at every push, so nothing would be saved
(SparseLoCo drops it for the error feedback). The ps optimizer must leave
every entry pushed as 0 unchanged, as AdaGrad and SGD without momentum do
(`sparse_fetch.check_optimizer`, when the replica is built); the push rules'
corrections and factors do too. Delay compensation, which keeps a whole copy
of each replica's fetch on the ps, is refused with it.

Bytes of a fetch: `entries * (4 + itemsize)` for the flagged entries, the
model's bytes for a whole one. ps memory: one byte per entry and replica.
Ordering: a push flags its entries after the ps applied it, and a fetch reads
its flags, clears them, then reads the values, so an entry changed while a
fetch runs is either in it with its new value or flagged for the next one.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour.push_rules import rule

__all__ = ["RULE", "SparseFetches", "fetch_nbytes"]


def fetch_nbytes(changed: list, params: list) -> int:
    """Bytes of a sparse fetch of the `changed` entries (bool arrays).

    Args:
      changed: per parameter, a bool array of its shape: the flagged entries.
      params: the parameters (their `itemsize`).
    """
    return sum(
        int(np.count_nonzero(c)) * (rule.POSITION_BYTES + p.itemsize)
        for c, p in zip(changed, params)
    )


class SparseFetches(rule.PushRule):
    """Fetches of the entries changed since the replica's last fetch
    (module docstring).

    Args:
      config: a `DownpourConfig` with `sparse_fetches` True.
    """

    name = "sparse_fetches"
    title = "sparse fetches"
    settings = (
        rule.Setting(
            "sparse_fetches",
            False,
            "bool",
            "Downpour: a fetch sends only the entries the ps changed since the "
            "replica's last fetch (needs --top_k_fraction; with the outer "
            "optimizer, --outer_momentum=0).",
        ),
    )
    marks_changes = True

    @classmethod
    def check(cls, config) -> None:
        if not isinstance(config.sparse_fetches, (bool, np.bool_)):
            raise checks.argument_error(
                "sparse_fetches", "a bool", config.sparse_fetches
            )
        if not config.sparse_fetches:
            return
        if config.n_fetch < 2:
            raise ValueError(
                "Argument `sparse_fetches` needs `n_fetch` >= 2 (a replica that "
                "caches the parameters between fetches). Received: "
                f"n_fetch={config.n_fetch}"
            )
        outer = getattr(config, "outer_learning_rate", None)
        momentum = getattr(config, "outer_momentum", 0.0)
        if outer is not None and momentum != 0:
            raise ValueError(
                "Argument `sparse_fetches` needs `outer_momentum` 0 with the "
                "outer optimizer: the outer momentum changes every entry at "
                f"every push. Received: outer_momentum={momentum!r}"
            )

    @classmethod
    def check_combination(cls, config, others) -> None:
        copied = [o.name for o in others if o.needs_fetched]
        if copied:
            raise ValueError(
                f"Argument `sparse_fetches` cannot be combined with "
                f"{', '.join(copied)}: the ps would keep a whole copy of what "
                "each replica fetched, which a sparse fetch does not send. "
                f"Received: {', '.join(f'{n}={getattr(config, n)!r}' for n in copied)}"
            )
        if not any(o.selects for o in others):
            raise ValueError(
                "Argument `sparse_fetches` needs a push rule that selects the "
                "entries a push sends (`top_k_fraction`): with whole pushes "
                "every entry changes. Received: push rules "
                f"{', '.join(o.name for o in others) or 'none'}"
            )


RULE = SparseFetches
