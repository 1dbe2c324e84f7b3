"""The push rules' updates on the ps, in NumPy (no TensorFlow).

What `schedule.simulate` applies at a push when a `DownpourConfig` push rule
is on (see `DownpourConfig` for each rule and its paper); `push_rules` is the
TF side.
"""

from __future__ import annotations

__all__ = ["outer_nesterov", "staleness_scaled_update"]


def outer_nesterov(params, momentums, deltas, learning_rate, momentum):
    """The outer optimizer on pushes: SGD with Nesterov momentum on `deltas`.

    DiLoCo (Douillard et al. 2023, algorithm 1) and Async Local-SGD (Liu et
    al. 2024) apply it to the pushed pseudo-gradient `D` (the parameter delta
    of a round of local steps), in tf_keras `SGD(nesterov=True)`'s form (TF's
    `ResourceApplyKerasMomentum`): `m <- mu * m - eta * D`, `w <- w + mu * m -
    eta * D`.

    Args:
      params: the ps parameters, a list of arrays.
      momentums: `m`, one array per parameter (zeros at the start).
      deltas: `D`, one array per parameter.
      learning_rate: `eta`, `DownpourConfig.outer_learning_rate`.
      momentum: `mu`, `DownpourConfig.outer_momentum`.

    Returns:
      `(params, momentums)`, new lists.
    """
    momentums = [momentum * m - learning_rate * d for m, d in zip(momentums, deltas)]
    params = [
        w + momentum * m - learning_rate * d
        for w, m, d in zip(params, momentums, deltas)
    ]
    return params, momentums


def staleness_scaled_update(update, params, state, grads, steps, squares, staleness):
    """A push applied with its step divided by `max(staleness, 1)`.

    Zhang et al. IJCAI 2016, section 3: the learning rate over the staleness.
    The gradients are divided; a ps optimizer that takes squares (AdaGrad)
    grows its accumulator by the unscaled squares (the pushed `squares`, else
    `G^2 / steps`), so that its step, not its accumulator, is divided.

    Args:
      update: the ps optimizer's update (`PsUpdate`).
      params, state, grads, steps, squares: as `PsUpdate` takes them.
      staleness: the push's staleness, an int >= 0.

    Returns:
      `(params, state)`.
    """
    scale = 1.0 / max(staleness, 1)
    scaled = [g * scale for g in grads]
    if getattr(update, "takes_squares", False):
        if squares is None:
            squares = [g * g / steps for g in grads]
        return update(params, state, scaled, 1, squares)
    return update(params, state, scaled, steps, squares)
