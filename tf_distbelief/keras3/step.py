"""The scheduled function of stock Keras 3 training: steps applied on the ps.

Dean et al. 2012, section 4.1, with `n_fetch = n_push = 1`: each step reads
the ps values (`PsWeights`), runs `model.stateless_call` on them, takes the
gradient with `tf.GradientTape`, checks it for NaN and inf, and applies the
optimizer (`keras3.optimizer`) on each ps shard, gated by the step's
exactly-once token. `keras3.fit` schedules it through `ClusterCoordinator`;
Downpour's counterpart is `keras3.downpour.make_step`.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.faults import exactly_once
from tf_distbelief.keras3 import optimizer as optimizer_lib
from tf_distbelief.keras3 import variables as variables_lib

# Tag of the `check_numerics` ops, to tell a non-finite gradient from other errors.
NONFINITE_TAG = "tf_distbelief.keras3: non-finite gradient of "


def make_step(
    model,
    weights,
    loss_fn,
    metrics,
    metric_inits,
    rule,
    steps,
    tokens,
    applied,
    skipped=None,
):
    """The scheduled function: `steps` training steps in a row on one worker.

    A step whose gradients are not all finite changes no ps variable: with
    `skipped` None it fails (`check_numerics`, naming the weight), else it
    adds 1 to `skipped` (an int64 ps variable) instead. Each step's update is
    gated by its exactly-once token (`faults.exactly_once.gate` on `tokens`):
    a step that the coordinator runs again after a lost worker is applied
    once, and counted once in `applied` (an int64 ps variable).

    Returns `(iterator, first_token) -> (loss sum (float64), steps (int64),
    metric state deltas summed)`, with step `k` under token `first_token + k`.
    """
    shards = [variables_lib.shards_of(v) for v in weights.trainable]

    damped = isinstance(rule, optimizer_lib.Adagrad)

    def one_step(x, y, token):
        # AdaGrad damps the update by the gradient's staleness
        # (`adagrad.staleness`): the applied-step count is read before any
        # parameter is.
        read = rule.read_before(applied) if damped else None
        with (
            tf.control_dependencies([] if read is None else [read]),
            tf.GradientTape() as tape,
        ):
            trainable = [variables_lib.read(v) for v in weights.trainable]
            non_trainable = [variables_lib.read(v) for v in weights.non_trainable]
            y_pred, new_non_trainable, losses = model.stateless_call(
                trainable, non_trainable, x, training=True, return_losses=True
            )
            loss = loss_fn(y, y_pred)
            total = tf.add_n([loss, *losses]) if losses else loss
        grads = iter(tape.gradient(total, [s for group in shards for s in group]))
        checked = []  # (shard, accumulator, gradient checked to be finite)
        slots_of = weights.accumulators or [[None] * len(g) for g in shards]
        for path, group, slots in zip(weights.paths, shards, slots_of):
            for shard, slot in zip(group, slots):
                grad = next(grads)
                if grad is None:
                    continue
                if skipped is None:
                    grad = _check_numerics(grad, NONFINITE_TAG + path)
                # Read by the update as received on the ps (`gate`).
                checked.append((shard, slot, exactly_once.copy_to(shard.device, grad)))
        new_non_trainable = [
            _to_ps(v, value, exactly_once)
            for v, value in zip(weights.non_trainable, new_non_trainable)
        ]
        # Every gradient is checked before any update: a step whose gradients
        # are not all finite changes no ps variable.
        gates = [_values(g) for *_, g in checked]

        def apply():
            with tf.control_dependencies(gates):
                extra = [] if read is None else [rule.damping(applied, read)]
                ops = [
                    rule.apply(shard, slot, grad, *extra)
                    for shard, slot, grad in checked
                ]
                for variable, value in zip(weights.non_trainable, new_non_trainable):
                    ops.append(variable.assign(value, read_value=False))
            with tf.control_dependencies(ops):
                # A ps tensor: the token's write waits for the update only.
                counted = applied.assign_add(1, read_value=True)
            return tf.constant(True), [counted]

        def refuse():  # A fresh step with a NaN or inf, skipped and counted.
            return tf.constant(False), [skipped.assign_add(1, read_value=True)]

        if skipped is None:
            finite, refuse_fn = tf.constant(True), lambda: (tf.constant(False), [])
        else:
            finite = tf.reduce_all(
                tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in gates])
            )
            refuse_fn = refuse
        updated = exactly_once.gate(
            token, tokens, finite, apply, refuse_fn, lambda: tf.constant(False)
        )
        deltas = []
        for metric, init in zip(metrics, metric_inits):
            state = metric.stateless_update_state(init, y, y_pred)
            deltas.append([s - i for s, i in zip(state, init)])
        return loss, deltas, [updated]

    @tf.function
    def step(iterator, first_token):
        losses, summed, updates = [], None, []
        # Unrolled: each step reads the ps values after the step before it
        # updated them (`steps_per_execution` of tf_keras).
        for k in range(steps):
            with tf.control_dependencies(updates):
                x, y = next(iterator)
                loss, deltas, updates = one_step(x, y, first_token + k)
            losses.append(loss)
            summed = (
                deltas
                if summed is None
                else tf.nest.map_structure(tf.add, summed, deltas)
            )
        with tf.control_dependencies(updates):
            return (
                tf.reduce_sum(tf.cast(tf.stack(losses), tf.float64)),
                tf.constant(steps, tf.int64),
                tf.nest.map_structure(tf.identity, summed),
            )

    return step


def _to_ps(variable, value, exactly_once):
    """`value` copied to `variable`'s ps task, when the variable is whole (a
    sharded one splits it on assignment: the worker sends each slice)."""
    shards = variables_lib.shards_of(variable)
    if len(shards) > 1:
        return value
    return exactly_once.copy_to(shards[0].device, value)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _check_numerics(gradient, message):
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.debugging.check_numerics(gradient.values, message),
            gradient.indices,
            gradient.dense_shape,
        )
    return tf.debugging.check_numerics(gradient, message)
