"""Downpour SGD for Keras 3 models (Dean et al. 2012, section 4.1).

The ps variables of `PsWeights`, created with `tf_distbelief.downpour.enable`
in effect, are Downpour variables: inside `Downpour.step` each reads as the
running replica's cache (`tf_distbelief.substitution`), so
`model.stateless_call` on their values computes the forward pass from the
cache, and `Downpour` fetches every `n_fetch` steps and pushes every `n_push`
steps exactly as for a tf_keras model (`tf_distbelief.downpour.schedule`'s
order). Each push is gated by its step's `exactly_once` token, as for a
tf_keras model: a step that TensorFlow's coordinator runs again (after a lost
worker, or a derived `CancelledError` it treats as transient) never applies
its push twice. The ps applies a push with `tf_distbelief.adagrad.Adagrad`,
the optimizer object that `Downpour`'s exchange is written against: it holds
the accumulators on the ps shards and runs the same fused op; the Keras 3
model never meets tf_keras.
"""

from __future__ import annotations

import functools

import numpy as np
import tensorflow as tf

from tf_distbelief import hooks
from tf_distbelief.adagrad import optimizer as tf_keras_adagrad
from tf_distbelief.downpour import push_guard, replica_state
from tf_distbelief.downpour import replica as replica_lib
from tf_distbelief.faults import exactly_once
from tf_distbelief.keras3 import variables as variables_lib


def make_step(
    strategy, model, weights, loss_fn, metrics, metric_inits, adagrad, config, steps=1
):
    """A scheduled function running `steps` local Downpour steps of a Keras 3 model.

    With `steps` > 1 (`config.runs_segments` must hold) the steps run in
    segments between fetches and pushes (`Downpour.run_steps`, as tf_keras's
    `fit` with `steps_per_execution`): the ps takes part once per segment,
    and the loss and metrics are those of the last step of each segment.

    Args:
      strategy: the `DistBeliefStrategy`, with `downpour.enable` called before
        `weights` were created.
      model: the built Keras 3 model.
      weights: its `PsWeights` (no accumulators: the optimizer keeps them).
      loss_fn: `(y_true, y_pred) -> scalar`.
      metrics: Keras 3 metrics, updated statelessly from `metric_inits`.
      metric_inits: each metric's initial state, NumPy arrays.
      adagrad: a `keras3.Adagrad`: the ps optimizer's and the local AdaGrad's
        hyperparameters.
      config: a `DownpourConfig`.
      steps: local steps per scheduled function, >= 1.

    Returns:
      `(step, downpour, finished)`: `step(iterator, first_token) -> (loss
      sum, losses summed, metric state deltas)` to schedule, with
      `first_token` an int64 scalar from `downpour.tokens.take(steps)` taken
      when the function is scheduled (a retry keeps it; step `i` pushes under
      `first_token + i`); the `Downpour` state (`.stats()`); and an int64 ps
      variable to which each function adds its steps once they ran (for
      progress lines: a function run again after a lost worker adds them
      again).

    Raises:
      ValueError: `steps` > 1 and `config.runs_segments` is False.
    """
    if steps > 1 and not config.runs_segments:
        raise ValueError(
            "Downpour runs several steps per scheduled function in segments, "
            "which needs n_fetch > 1, n_push > 1 and no warm start: pass "
            f"`steps_per_execution=1`. Received: steps_per_execution={steps}, "
            f"{config}"
        )
    with strategy.scope():  # Its iteration counter and slots live on the ps.
        optimizer = tf_keras_adagrad.Adagrad(
            adagrad.learning_rate, adagrad.initial_accumulator_value, adagrad.epsilon
        )
        finished = tf.Variable(0, dtype=tf.int64, trainable=False, name="finished")
    # The shards, as tf_keras lists a sharded weight's: the optimizer keeps
    # one accumulator per shard, which Downpour's exchange pushes to.
    shards = [s for v in weights.trainable for s in variables_lib.shards_of(v)]
    downpour = replica_lib.Downpour(strategy, shards, optimizer, config)

    def forward(data):
        x, y = data
        # Under `Downpour.step` and `run_steps` these reads are the replica's
        # cache.
        trainable = [variables_lib.read(v) for v in weights.trainable]
        y_pred, _, losses = model.stateless_call(
            trainable, [], x, training=True, return_losses=True
        )
        loss = loss_fn(y, y_pred)
        total = tf.add_n([loss, *losses]) if losses else loss
        return total, (loss, y_pred)

    def logged(data, outputs):
        """`(loss, 1, metric state deltas)` of one step."""
        (_, y), (loss, y_pred) = data, outputs
        deltas = []
        for metric, init in zip(metrics, metric_inits):
            state = metric.stateless_update_state(init, y, y_pred)
            deltas.append([s - i for s, i in zip(state, init)])
        return tf.cast(loss, tf.float64), tf.constant(1, tf.int64), deltas

    if steps == 1:

        @tf.function
        def step(iterator, first_token):
            data = next(iterator)

            def replica_fn():
                with exactly_once.scope(first_token):  # Read when traced.
                    _, outputs, _ = downpour.step(lambda: forward(data))
                return logged(data, outputs)

            outputs = strategy.run(replica_fn)
            with tf.control_dependencies(tf.nest.flatten(outputs)):
                counted = finished.assign_add(1)
            with tf.control_dependencies([counted]):
                return tf.nest.map_structure(tf.identity, outputs)

    else:
        zeros = (
            tf.constant(0.0, tf.float64),
            tf.constant(0, tf.int64),
            [[np.zeros_like(i) for i in init] for init in metric_inits],
        )

        @tf.function
        def step(iterator, first_token):
            done, summed = downpour.run_steps(
                iterator,
                steps,
                forward,
                logged,
                first_token=first_token,
                totals=tf.nest.map_structure(tf.convert_to_tensor, zeros),
            )
            with tf.control_dependencies([finished.assign_add(done)]):
                return tf.nest.map_structure(tf.identity, summed)

    return step, downpour, finished


def fit_hooks(downpour) -> hooks.FitHooks:
    """Downpour's services to `keras3.fit`, as `downpour.install` gives a
    tf_keras model's `fit`: the guard of its pushes (`push_guard`), its
    replicas' state in checkpoints (`replica_state`), the `Downpour` itself,
    its end of training (`Downpour.finish`).

    Args:
      downpour: the `Downpour` of `make_step`.
    """
    return hooks.FitHooks(
        name="downpour",
        install_guard=functools.partial(push_guard.install, downpour),
        checkpoint_state=functools.partial(replica_state.ReplicaState, downpour),
        state=downpour,
        finish=downpour.finish,
    )
