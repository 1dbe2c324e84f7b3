"""The fused AdaGrad ops on resource handles, without tf_keras.

`ResourceApplyAdagradV2` (or its sparse form) runs the rule of
`tf_distbelief.adagrad.rule.adagrad_update` on the device of the variable: the
tf_keras `Adagrad` (`adagrad.optimizer`), Downpour's local step and the Keras 3
path (`tf_distbelief.keras3`) all apply AdaGrad through these functions.
"""

from __future__ import annotations

import tensorflow as tf


def apply_adagrad(var, accum, gradient, lr, epsilon, update_slots: bool = True):
    """One fused AdaGrad op on a variable and its accumulator (resource handles).

    `ResourceApplyAdagradV2`, or `ResourceSparseApplyAdagradV2` on the rows of
    an `IndexedSlices` gradient, its repeated rows summed first
    (`deduplicate`): `a <- a + g^2` (with `update_slots`; False reads
    the accumulator as it is), then `w <- w - lr * g / (sqrt(a) + epsilon)`,
    the rule of `adagrad.rule.adagrad_update`. The ps AdaGrad (`Adagrad`) and
    Downpour's local step on a replica's cache both run it; the op runs on
    the device of the variable.

    Args:
      var: the variable's resource handle.
      accum: the accumulator's resource handle, same shape and dtype.
      gradient: `g`, a tensor of the variable's shape, or `tf.IndexedSlices`
        of its rows (an index may repeat: its rows are summed).
      lr: the learning rate, a scalar tensor of the variable's dtype.
      epsilon: a scalar tensor of the variable's dtype.
      update_slots: grow the accumulator by `g^2` first.

    Returns:
      The op.
    """
    if isinstance(gradient, tf.IndexedSlices):
        gradient = deduplicate(gradient)
        return tf.raw_ops.ResourceSparseApplyAdagradV2(
            var=var,
            accum=accum,
            lr=lr,
            epsilon=epsilon,
            grad=gradient.values,
            indices=gradient.indices,
            use_locking=False,
            update_slots=update_slots,
        )
    return tf.raw_ops.ResourceApplyAdagradV2(
        var=var,
        accum=accum,
        lr=lr,
        epsilon=epsilon,
        grad=gradient,
        use_locking=False,
        update_slots=update_slots,
    )


def deduplicate(gradient: tf.IndexedSlices) -> tf.IndexedSlices:
    """`gradient` with the rows of each repeated index summed into one.

    The sparse AdaGrad op grows the accumulator once per row it is given: rows
    `g1, g2` at one index would add `g1^2 + g2^2` instead of the `(g1 + g2)^2`
    of the dense gradient they stand for. tf_keras sums them the same way
    before its sparse updates (`Optimizer._deduplicate_sparse_grad`).

    Args:
      gradient: `tf.IndexedSlices`, `values` of shape `[n, *row_shape]` and
        `indices` of shape `[n]` (int32 or int64).

    Returns:
      `tf.IndexedSlices` with unique `indices` (in order of first appearance)
      and the summed `values`, same dtypes and `dense_shape`.
    """
    unique, position = tf.unique(gradient.indices)
    summed = tf.math.unsorted_segment_sum(gradient.values, position, tf.size(unique))
    return tf.IndexedSlices(summed, unique, gradient.dense_shape)
