"""Downpour's non-finite guard: a push with a NaN or inf never reaches the ps.

Dean et al. 2012, section 4.1, pushes a replica's summed gradients to the ps
shards; one NaN in a push would spread to every replica at its next fetch.
`Exchange.push` checks each push on the worker, before anything is sent
(`finite_flags`: every pushed gradient, and its squares when they go along),
and applies it only when all are finite. Otherwise (`tf_distbelief.faults.nonfinite`
modes):

* `raise`: the scheduled function fails with an assertion naming the step, the
  worker and the variables (`raise_if_refused`, on the worker after the
  push); `tf_distbelief.faults.nonfinite.error_from` turns it into a
  `NonFiniteError` (as `training.fit` does). Halt: the refusal also sets
  `Downpour.halted` on the ps, and no later push of any replica is applied
  until the next fit (`install` clears it): the coordinator runs the steps
  it had queued until it sees the error, and the ps must keep the state the
  error describes;
* `skip`: the push is dropped and counted (`ReplicaStats.nonfinite_pushes` on
  the replica, `Downpour.nonfinite_skipped` on the ps); the replica restarts
  from the ps as after a push dropped for staleness: its accumulators restart
  at 0, its next step fetches (the cache may hold the NaN of its local steps),
  and its local AdaGrad accumulator goes back to its value at the last push
  (with pushed squares, which keep that value) or else has its non-finite
  entries reset to the initial accumulator value.

Cost: one `is_finite` pass over each push on the worker (not over each step),
and a `tf.cond`; no extra message while pushes are finite.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import base
from tf_distbelief.faults import nonfinite, settings

__all__ = ["Guard", "finite_flags", "install", "raise_if_refused"]


def finite_flags(grads: list, squares: list | None) -> list[tf.Tensor]:
    """Per pushed variable, a bool scalar: its gradient (and squares) finite.

    Args:
      grads: the pushed gradients, tensors or `tf.IndexedSlices`, one per
        variable.
      squares: the pushed squares, the same kinds, or None.

    Returns:
      One bool scalar per variable, computed where the gradients are (the
      worker).
    """
    flags = []
    for j, g in enumerate(grads):
        parts = [g] if squares is None else [g, squares[j]]
        checks = [tf.reduce_all(tf.math.is_finite(_values(p))) for p in parts]
        flags.append(tf.reduce_all(tf.stack(checks)))
    return flags


def _values(x):
    return x.values if isinstance(x, tf.IndexedSlices) else x


def raise_if_refused(h: base.Handles, variables: list, flags, step, refused):
    """The `raise` mode's check of a push: fails when `refused`.

    Run on the worker after the push (see `exchange.Exchange.push`), naming
    the step, the variables whose values were not finite and the worker
    (`tf_distbelief.faults.nonfinite.error_from` reads it).

    Args:
      h: the scheduled function's handles.
      variables: the pushed variables (shards), in `flags` order.
      flags: `finite_flags` of the push, stacked: bool `[variables]`.
      step: the replica's local step the push ends (1-based), an int64 scalar.
      refused: bool scalar: this push was refused (and set the halt).

    Returns:
      The assertion op.
    """
    names = tf.constant([v.name for v in variables])
    bad = tf.boolean_mask(names, tf.logical_not(flags))
    return tf.debugging.Assert(
        tf.logical_not(refused),
        [nonfinite.PUSH_MARKER, step, bad, "worker", h.worker],
        summarize=len(variables) + 1,
    )


class Guard:
    """What `training.fit` reads of Downpour's guard (as of `tf_keras_fit.Guard`).

    Args:
      downpour: the `replica.Downpour`.

    Attributes:
      mode: `raise` or `skip`.
      unit: what is skipped, `pushes`.
    """

    unit = "pushes"

    def __init__(self, downpour):
        self._downpour = downpour

    @property
    def mode(self) -> str:
        return self._downpour.nonfinite

    def skipped_steps(self) -> int:
        """Pushes skipped so far by every replica (reads the ps counter)."""
        return int(self._downpour.nonfinite_skipped.numpy())


def install(downpour, model, mode: str) -> Guard:
    """Sets what a push of `downpour` with a NaN or inf does.

    A new mode makes `fit` trace its train function anew (the mode is read
    when it is traced). `downpour.keras.install` hands it to the fit layer
    (`hooks.FitHooks.install_guard`, with `downpour` bound).

    Args:
      downpour: the `replica.Downpour` installed on `model`.
      model: the tf_keras model it trains.
      mode: `raise` or `skip` (`tf_distbelief.faults.settings.NONFINITE_MODES`).

    Returns:
      The `Guard` (`mode`, `skipped_steps()`: pushes skipped so far).

    Raises:
      ValueError: `mode` is not one of the modes.
    """
    settings.check_nonfinite_mode(mode)
    downpour.halted.assign(0)  # A new fit: pushes apply again ("Halt").
    if mode != downpour.nonfinite:
        downpour.nonfinite = mode
        model.train_function = None
    return downpour.guard
