"""The push rules at a push, in NumPy: what `schedule.simulate` applies.

The composition of `rule` (corrections, the step's factors, then the rule
replacing the ps optimizer or the ps optimizer's scaled step), with each
rule's `reference_*` hooks; `on_ps` is the TF side. Before them, what a
compressing rule lets a push send (`compress`, `push_nbytes`; the TF side is
`compression`). Pure: no TensorFlow.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief.downpour import position_codes
from tf_distbelief.downpour.push_rules import rule

__all__ = ["ReferenceRules", "compress", "corrected", "push_nbytes", "scaled_update"]


def _compressors(rules) -> tuple:
    """`(selecting rule or None, coding rule or None)` among `rules`."""
    selector = next((r for r in rules if r.selects), None)
    return selector, next((r for r in rules if r.codes), None)


def compress(rules, values: list) -> list:
    """What the ps receives of a push of `values` (step 0), in NumPy.

    Each array is flattened; a selecting rule keeps the entries at its
    `reference_select` positions (the others are 0), a coding rule replaces
    the kept values, in sending order (`position_codes.wire_order`), by its
    `reference_code`. The replica's
    residual is then `values` less the result.

    Args:
      rules: the rules in effect (`DownpourConfig.rules`).
      values: the arrays to push (gradient sums plus the residual).

    Returns:
      One array per value, its shape; `values` themselves when no rule
      compresses.
    """
    selector, coder = _compressors(rules)
    if selector is None and coder is None:
        return values
    out = []
    for v in values:
        flat = v.reshape(-1)
        positions = (
            np.arange(flat.size)
            if selector is None
            else position_codes.wire_order(selector.reference_select(flat), flat.size)
        )
        kept = flat[positions]
        if coder is not None:
            kept = coder.reference_code(kept)
        sent = np.zeros_like(flat)
        sent[positions] = kept
        out.append(sent.reshape(v.shape))
    return out


def push_nbytes(rules, params: list) -> int | None:
    """Bytes a compressed push of arrays shaped like `params` sends.

    Per array of `n` entries of `itemsize` bytes: `count` = the selecting
    rule's `sent_count(n)` (else `n`) values, coded (`coded_nbytes`) or not
    (`count * itemsize`), plus with a selecting rule the positions' bytes
    in the coding the wire sends (`position_codes.wire_coding`).

    Returns:
      The bytes, or None when no rule compresses.
    """
    selector, coder = _compressors(rules)
    if selector is None and coder is None:
        return None
    total = 0
    for p in params:
        count = p.size if selector is None else selector.sent_count(p.size)
        if coder is None:
            total += count * p.itemsize
        else:
            total += coder.coded_nbytes(count, p.itemsize)
        if selector is not None:
            where = np.zeros(count, np.int64)  # The coding counts `k` only.
            total += position_codes.position_nbytes(where, p.size, "wire")
    return total


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


def corrected(rules, grads, params, fetched, staleness, state_of):
    """Steps 1 and 2 of a push: `grads` corrected by each rule
    (`reference_correct`, in order), and the product of the rules' factors of
    the step (`reference_scale`); `on_ps.corrected` is the TF side.

    Args:
      rules: the `PushRule`s in effect, in order.
      grads: the pushed arrays (parameter deltas with `pushes_deltas`).
      params: the ps parameters before the push.
      fetched: the ps parameters at the pushing replica's last fetch, or None.
      staleness: the push's staleness, an int >= 0.
      state_of: `name -> ` the named rule's NumPy state (a rule's
        `reads_state`; e.g. the outer momentum, one array per parameter).

    Returns:
      `(grads, scale)`: the corrected arrays, and the factor (a float) or
      None when no rule scales the step.
    """
    return rule.compose(
        rules,
        grads,
        lambda r, g, **state: r.reference_correct(
            g, params, fetched, staleness, **state
        ),
        lambda r: r.reference_scale(staleness),
        state_of,
    )


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
        self.index = {r.name: k for k, r in enumerate(self.rules)}

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
        grads, scale = corrected(
            self.rules,
            grads,
            params,
            fetched,
            staleness,
            lambda name: self.states[self.index[name]],
        )
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
