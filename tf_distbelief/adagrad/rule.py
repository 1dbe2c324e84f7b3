"""The AdaGrad update as a pure NumPy function (Duchi et al. 2011).

Per parameter i at its K-th update:

    a_{i,K} = a_{i,K-1} + g_{i,K}^2
    w_{i,K} = w_{i,K-1} - gamma * g_{i,K} / (sqrt(a_{i,K}) + epsilon)

`epsilon` sits outside the square root, as in TensorFlow's
`ResourceApplyAdagradV2` op. `tf_distbelief.adagrad.optimizer.Adagrad` runs
this rule on the ps shards; the Downpour NumPy reference
(`tf_distbelief.downpour.schedule`) and the tests use this function.
"""

from __future__ import annotations

import numpy as np


def adagrad_update(
    value, accumulator, grad, learning_rate, epsilon, steps=1, squares=None
):
    """The pure AdaGrad update of the module docstring (NumPy arrays).

    Args:
      value: the parameters `w_{K-1}`, any shape.
      accumulator: `a_{K-1}`, the same shape.
      grad: `g_K`, the same shape; with `steps > 1`, the sum of `steps`
        gradients (see `Adagrad.apply_summed_gradient`).
      learning_rate: `gamma`, a scalar.
      epsilon: a scalar >= 0.
      steps: the gradients summed in `grad`, >= 1; the accumulator grows by
        `grad^2 / steps`.
      squares: None, or the sum of the squares of the gradients summed in
        `grad` (the same shape): the accumulator grows by it instead.

    Returns:
      `(w_K, a_K)`.
    """
    if squares is None:
        squares = grad * grad / steps
    accumulator = accumulator + squares
    return value - learning_rate * grad / (np.sqrt(accumulator) + epsilon), accumulator
