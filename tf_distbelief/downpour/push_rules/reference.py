"""The push rules at a push, in NumPy: what `schedule.simulate` applies.

The composition of `rule` (corrections, the step's factors, then the rule
replacing the ps optimizer or the ps optimizer's scaled step), with each
rule's `reference_*` hooks; `on_ps` is the TF side. Pure: no TensorFlow.
"""

from __future__ import annotations

__all__ = ["ReferenceRules", "scaled_update"]


def scaled_update(update, params, state, grads, steps, squares, scale):
    """A push applied by the ps optimizer with its step times `scale`.

    The gradients are scaled; a ps optimizer that takes squares (AdaGrad)
    grows its accumulator by the unscaled squares (the pushed `squares`, else
    `G^2 / steps`), so that its step, not its accumulator, is scaled.

    Args:
      update: the ps optimizer's update (`schedule.PsUpdate`).
      params, state, grads, steps, squares: as `update` takes them.
      scale: the factor, a float.

    Returns:
      `(params, state)`.
    """
    scaled = [g * scale for g in grads]
    if getattr(update, "takes_squares", False):
        if squares is None:
            squares = [g * g / steps for g in grads]
        return update(params, state, scaled, 1, squares)
    return update(params, state, scaled, steps, squares)


class ReferenceRules:
    """The push rules of a `DownpourConfig` and their ps state, in NumPy.

    Args:
      config: the `DownpourConfig` (its `rules`).
      params: the initial ps parameters (the rules' states start from them).
    """

    def __init__(self, config, params: list):
        self.rules = config.rules
        self.states = [r.reference_state(params) for r in self.rules]
        self.updater = next(
            (k for k, r in enumerate(self.rules) if r.replaces_optimizer), None
        )

    def apply(self, update, params, state, grads, steps, squares, staleness, fetched):
        """Applies one push by the rules (the ps optimizer's alone without any).

        Args:
          update: the ps optimizer's update (`schedule.PsUpdate`).
          params: the ps parameters.
          state: the ps optimizer's state.
          grads: the pushed sums (parameter deltas with `pushes_deltas`).
          steps: the local steps summed, as the ps optimizer counts them.
          squares: the pushed squared gradients, or None.
          staleness: the push's staleness, an int >= 0.
          fetched: the ps parameters at the pushing replica's last fetch.

        Returns:
          `(params, state)`; the rules' own states are kept here.
        """
        for r in self.rules:
            grads = r.reference_correct(grads, params, fetched, staleness)
        scale = None
        for r in self.rules:
            factor = r.reference_scale(staleness)
            if factor is not None:
                scale = factor if scale is None else scale * factor
        if self.updater is not None:
            if scale is not None:
                grads = [g * scale for g in grads]
            k = self.updater
            params, self.states[k] = self.rules[k].reference_update(
                params, self.states[k], grads
            )
            return params, state
        if scale is not None:
            return scaled_update(update, params, state, grads, steps, squares, scale)
        return update(params, state, grads, steps, squares)
