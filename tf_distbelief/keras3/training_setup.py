"""What a `keras3.fit` run trains with: ps weights, the step, its counters.

`setup` creates, in order: the `PsWeights` (or checks the ones given), the
`ClusterCoordinator` (no step scheduled after a failed one runs), each
worker's dataset, and the scheduled function: stock (`keras3.step`, with
its exactly-once tokens and ps counters) or Downpour's
(`keras3.downpour.make_step`, whose services reach the run as a
`hooks.FitHooks`, as `downpour.install` gives a tf_keras model's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf

from tf_distbelief import hooks
from tf_distbelief.faults import exactly_once
from tf_distbelief.fit import shards
from tf_distbelief.keras3 import step as step_lib
from tf_distbelief.keras3 import variables as variables_lib
from tf_distbelief.keras3.training_args import FitArgs
from tf_distbelief.tf_internals import coordinator as tf_coordinator


@dataclasses.dataclass
class Run:
    """One `keras3.fit` run's objects (see the module).

    Attributes:
      model: the Keras 3 model.
      weights: its `PsWeights`.
      coordinator: the `ClusterCoordinator` that schedules the steps.
      step: the scheduled function, `step(*step_args())`.
      step_args: `() -> args`, fixed when a function is scheduled (a retry
        keeps its tokens).
      loss_fn: the loss.
      metrics: the Keras 3 metrics.
      metric_inits: each metric's initial state (NumPy arrays).
      applied: an int64 ps variable: the steps this run finished (stock:
        applied; Downpour: run).
      skipped: an int64 ps variable of the steps (Downpour: pushes) skipped
        for a NaN or inf, or None (`nonfinite="raise"`, stock).
      skipped_before: its value when the run began.
      algorithm: Downpour's `hooks.FitHooks`, or None (stock training).
    """

    model: Any
    weights: variables_lib.PsWeights
    coordinator: Any
    step: Callable
    step_args: Callable[[], tuple]
    loss_fn: Any
    metrics: list
    metric_inits: list
    applied: tf.Variable
    skipped: tf.Variable | None
    skipped_before: int
    algorithm: hooks.FitHooks | None

    def skipped_since_start(self) -> int:
        """Steps (Downpour: pushes) skipped in this run."""
        return (
            0
            if self.skipped is None
            else int(self.skipped.numpy()) - (self.skipped_before)
        )


def setup(
    model, strategy, args: FitArgs, loss_fn, metrics, rule, ps_weights, downpour
) -> Run:
    """Creates what the run trains with (see the module).

    Raises:
      ValueError: `ps_weights` hold another optimizer's slots than `rule`'s.
    """
    metric_inits = [[np.asarray(v.numpy()) for v in m.variables] for m in metrics]
    weights = _weights(strategy, model, rule, ps_weights, downpour)
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    # No step scheduled after a failed one runs (a NaN refused with "raise").
    tf_coordinator.cancel_queued_on_failure(coordinator)
    if args.dataset is None:
        per_worker = coordinator.create_per_worker_dataset(
            arrays_dataset_fn(strategy, args.x, args.y, args.batch_size, args.seed)
        )
    else:
        per_worker = coordinator.create_per_worker_dataset(args.dataset.repeat())
    iterator = iter(per_worker)
    made = (model, weights, loss_fn, metrics, metric_inits, rule)
    if downpour is None:
        step, applied, skipped, tokens = _stock_step(strategy, args, *made)
        algorithm = None
    else:
        step, algorithm, applied = _downpour_step(strategy, args, downpour, *made)
        skipped = algorithm.state.nonfinite_skipped
        tokens = algorithm.state.tokens

    def step_args():  # Fixed when scheduled: a retry keeps its tokens.
        first = tokens.take(args.steps_per_execution)
        return (iterator, tf.constant(first, tf.int64))

    return Run(
        model=model,
        weights=weights,
        coordinator=coordinator,
        step=step,
        step_args=step_args,
        loss_fn=loss_fn,
        metrics=metrics,
        metric_inits=metric_inits,
        applied=applied,
        skipped=skipped,
        skipped_before=0 if skipped is None else int(skipped.numpy()),
        algorithm=algorithm,
    )


def _weights(strategy, model, rule, ps_weights, downpour) -> variables_lib.PsWeights:
    if ps_weights is None:
        return variables_lib.PsWeights(
            strategy, model, rule if downpour is None else None
        )
    ps_weights.check_model(model)
    if ps_weights.slot_name != rule.slot_name:
        raise ValueError(
            f"Argument `ps_weights` holds {ps_weights.slot_name} (made for "
            f"another optimizer) and `optimizer` keeps {rule.slot_name}: "
            f"pass the optimizer they were made with. Received: {rule!r}"
        )
    return ps_weights


def _stock_step(strategy, args, model, weights, loss_fn, metrics, inits, rule):
    """`(step, applied, skipped, tokens)` of stock training."""
    skipped = None
    with strategy.scope():  # On a ps task: every worker's steps add up.
        applied = tf.Variable(0, dtype=tf.int64, trainable=False, name="applied_steps")
        if args.nonfinite == "skip":
            skipped = tf.Variable(
                0, dtype=tf.int64, trainable=False, name="nonfinite_skipped"
            )
    tokens = exactly_once.StepTokens(applied, strategy)
    step = step_lib.make_step(
        model,
        weights,
        loss_fn,
        metrics,
        inits,
        rule,
        args.steps_per_execution,
        tokens,
        applied,
        skipped,
    )
    return step, applied, skipped, tokens


def _downpour_step(
    strategy, args, config, model, weights, loss_fn, metrics, inits, rule
):
    """`(step, hooks, finished)` of Downpour with `config`."""
    # Imported here: Downpour's ps optimizer is `tf_distbelief.adagrad.Adagrad`,
    # a tf_keras optimizer; stock Keras 3 training never imports tf_keras.
    from tf_distbelief.keras3 import downpour as keras3_downpour

    step, downpour, applied = keras3_downpour.make_step(
        strategy,
        model,
        weights,
        loss_fn,
        metrics,
        inits,
        rule,
        config,
        args.steps_per_execution,
    )
    algorithm = keras3_downpour.fit_hooks(downpour)
    # What a push with a NaN or inf does (read when the step is traced).
    algorithm.install_guard(model, args.nonfinite)
    return step, algorithm, applied


def arrays_dataset_fn(strategy, x, y, batch_size, seed):
    """Each worker's dataset of `x, y`: worker `i` of `W` reads its own shard
    (`fit.shards`, as a tf_keras job's `dataset_creator`)."""
    num_workers = max(1, getattr(strategy, "num_workers", 1))
    return shards.arrays_dataset_fn(
        np.asarray(x), np.asarray(y), batch_size, seed, lambda: num_workers
    )
