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

import tensorflow as tf

from tf_distbelief.adagrad import optimizer as tf_keras_adagrad
from tf_distbelief.downpour import replica as replica_lib
from tf_distbelief.faults import exactly_once
from tf_distbelief.keras3 import variables as variables_lib


def make_step(
    strategy, model, weights, loss_fn, metrics, metric_inits, adagrad, config
):
    """A scheduled function running one local Downpour step of a Keras 3 model.

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

    Returns:
      `(step, downpour)`: `step(iterator, token) -> (losses [1], metric state
      deltas)` to schedule, with `token` an int64 scalar from
      `downpour.tokens.take(1)` taken when the step is scheduled (a retry
      keeps it); and the `Downpour` state (`.stats()`).
    """
    with strategy.scope():  # Its iteration counter and slots live on the ps.
        optimizer = tf_keras_adagrad.Adagrad(
            adagrad.learning_rate, adagrad.initial_accumulator_value, adagrad.epsilon
        )
    # The shards, as tf_keras lists a sharded weight's: the optimizer keeps
    # one accumulator per shard, which Downpour's exchange pushes to.
    shards = [s for v in weights.trainable for s in variables_lib.shards_of(v)]
    downpour = replica_lib.Downpour(strategy, shards, optimizer, config)

    @tf.function
    def step(iterator, token):
        x, y = next(iterator)

        def forward():
            # Under `Downpour.step` these reads are the replica's cache.
            trainable = [variables_lib.read(v) for v in weights.trainable]
            y_pred, _, losses = model.stateless_call(
                trainable, [], x, training=True, return_losses=True
            )
            loss = loss_fn(y, y_pred)
            total = tf.add_n([loss, *losses]) if losses else loss
            return total, (loss, y_pred)

        def replica_fn():
            with exactly_once.scope(token):  # Read when the push is traced.
                _, (loss, y_pred), _ = downpour.step(forward)
            deltas = []
            for metric, init in zip(metrics, metric_inits):
                state = metric.stateless_update_state(init, y, y_pred)
                deltas.append([s - i for s, i in zip(state, init)])
            return tf.reshape(loss, [1]), deltas

        return strategy.run(replica_fn)

    return step, downpour
