"""The settings of a Sandblaster L-BFGS run, without TensorFlow.

Dean et al. 2012, section 4.2. `SandblasterConfig` gathers what a job chooses:
the L-BFGS memory, the iteration budget, how finely each objective evaluation
is cut into work portions, and whether backup tasks run. It is validated when
made, so a bad value fails before any cluster is touched.
"""

from __future__ import annotations

import dataclasses

from tf_distbelief import checks
from tf_distbelief.sandblaster import two_loop

__all__ = ["DEFAULT_STALL_TIMEOUT_SECS", "SandblasterConfig"]

# Longest wait, in seconds, for the next copy of a work portion to finish
# (`SandblasterConfig.stall_timeout_secs`).
DEFAULT_STALL_TIMEOUT_SECS = 600.0


@dataclasses.dataclass(frozen=True)
class SandblasterConfig:
    """Sandblaster L-BFGS settings (Dean et al. 2012, section 4.2).

    Example:

    ```python
    config = sandblaster.SandblasterConfig(history=10, portions=64)
    trainer = sandblaster.SandblasterTrainer(strategy, model, loss, x, y, config)
    trainer.fit()  # At most `config.max_iters` iterations.
    ```

    Attributes:
      history: the L-BFGS memory, the number of `(s, y)` pairs kept (on the ps),
        >= 1; `m` in Nocedal & Wright and in `lbfgs.minimize`. They suggest 3 to
        20; the default 10 is SciPy L-BFGS-B's.
      max_iters: L-BFGS iterations (accepted steps) at most, >= 1; the default
        of `SandblasterTrainer.fit`.
      portions: work portions each objective evaluation (the whole training
        set) is cut into, >= 1 and at most the number of examples (checked when
        the data is known). The paper uses far more portions than workers, so
        fast workers do more of them (default 32).
      backup_tasks: near the end of an evaluation, copy the portions still
        running onto idle workers and take whichever copy finishes first
        (default True).
      checkpoint_every_iters: with a `model_dir`, write the L-BFGS state
        (iterate, gradient, `(s, y)` history, counters) every so many
        iterations, >= 1, and at the end; a rerun resumes from the last one
        (`sandblaster.checkpoint`). Each checkpoint writes `2 * history + 2`
        parameter-sized vectors from the ps tasks; the default 1 loses no
        iteration to a chief loss.
      log_every_iters: `SandblasterTrainer.fit` prints a line every so many
        iterations, >= 0 (`lbfgs iteration 3/100: loss 0.412345, gradient
        norm 0.0123, 7 evaluations, 4.2 s`); 0 prints none. The default 1
        prints each: an iteration is a pass over the whole training set.
      two_loop: how L-BFGS computes its direction (`sandblaster.two_loop`):
        `"vector_free"` (default; Chen, Wang and Zhou, NIPS 2014) keeps the
        dot products of the history on the coordinator, so an iteration
        costs 2 round trips to the ps plus 2 per line-search evaluation;
        `"vectors"` runs the two-loop recursion as `4 * history` vector
        operations, about `4 * history + 12` round trips plus 4 per
        evaluation. Same iterates up to rounding.
      stall_timeout_secs: longest wait, in seconds (finite, > 0), for the next
        copy of a work portion to finish; past it the run fails with a
        `TimeoutError` naming the portions waited for. The coordinator hands a
        lost worker's portions to the others and waits for a restarted one,
        so only a cluster with no worker left waits this long (default 600).

    Raises:
      TypeError: a field of the wrong type.
      ValueError: a field out of range.
    """

    history: int = 10
    max_iters: int = 100
    portions: int = 32
    backup_tasks: bool = True
    checkpoint_every_iters: int = 1
    log_every_iters: int = 1
    two_loop: str = "vector_free"
    stall_timeout_secs: float = DEFAULT_STALL_TIMEOUT_SECS

    def __post_init__(self):
        for name in ("history", "max_iters", "portions", "checkpoint_every_iters"):
            checks.check_int(name, getattr(self, name), 1, ">= 1")
        checks.check_int("log_every_iters", self.log_every_iters, 0, ">= 0")
        checks.check_bool("backup_tasks", self.backup_tasks)
        checks.check_positive_secs("stall_timeout_secs", self.stall_timeout_secs)
        if self.two_loop not in two_loop.TWO_LOOPS:
            raise checks.argument_error(
                "two_loop", f"one of {two_loop.TWO_LOOPS}", self.two_loop
            )
