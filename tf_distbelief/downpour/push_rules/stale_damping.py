"""Direction-aware damping of stale pseudo-gradients against the outer momentum.

A push of staleness `s` was computed from parameters the ps has since moved
`s` outer steps along its momentum `m`. Its entries whose step points the way
`m` points repeat motion the momentum has already made (and will go on
making), so they overshoot; the entries pointing against `m` are the brake
that the stale replica saw and the ps lacks. Setting (`DownpourConfig`
keyword argument and launch flag):

* `stale_damping`: `lambda`, a float >= 0; 0.0: off; None (default):
  `DEFAULT_DAMPING` (1.0) with the outer optimizer and a momentum
  (`outer_learning_rate` set, `outer_momentum` > 0), off otherwise. A value
  > 0 needs the outer optimizer. Before the outer step applies a pushed
  pseudo-gradient `D` of staleness `s` (outer steps by other replicas since
  this replica's fetch), each entry whose step `-eta * D` points the way the
  current outer momentum `m` does (`D * m < 0`) is divided by
  `1 + lambda * s`; the others are kept. A push of staleness 0 is
  unchanged: with one replica the rule changes nothing.

Why it is on by default: with 2 asynchronous replicas a push is about one
push stale, and the outer momentum (0.9) then carries the ps past where the
stale push meant to go, push after push; the ps's model swings from push to
push, so where a short job ends varies from run to run. Damped, it does not
(docs/downpour.md, "Stale pushes and the outer momentum", has the figures).

HeLoCo-style corrections damp the other side (the entries against `m`); on
the softmax fixture's model with 8 replicas that made the loss worse, and
this side better (docs/downpour.md, "Stale pushes and the outer momentum").
The ps reads `m` (the outer optimizer's `MOMENTUM_SLOT`, on each shard's ps
task) before the push updates it, and the push's staleness
(`PushRule.needs_staleness`); nothing more crosses the network and the ps
keeps no more state. TensorFlow is imported by the TF hook only.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief.downpour.push_rules import rule

__all__ = ["DEFAULT_DAMPING", "RULE", "StaleDamping", "damp"]

# `lambda` when `stale_damping` is None (the default) and the outer
# optimizer has a momentum: a push 1 stale moves half as far where it
# repeats the momentum (module docstring).
DEFAULT_DAMPING = 1.0


def damp(delta, momentum, staleness, lam):
    """`delta` with the entries that move along `momentum` divided by `1 + lam * s`.

    An entry moves along `momentum` when its step `-delta` has the sign of
    `momentum` (`delta * momentum < 0`).

    Args:
      delta: the pushed pseudo-gradient `D`, an array.
      momentum: the outer momentum `m`, an array of `D`'s shape.
      staleness: `s`, an int >= 0.
      lam: `lambda`, a float >= 0.

    Returns:
      The damped `D`, a new array.
    """
    along = delta * momentum < 0
    return np.where(along, delta / (1.0 + lam * staleness), delta)


class StaleDamping(rule.PushRule):
    """Damps a stale push where it repeats the outer momentum (module docstring).

    Args:
      config: a `DownpourConfig` in which the rule is on (`is_on`).
    """

    name = "stale_damping"
    title = "the stale-push damping"
    settings = (
        rule.Setting(
            "stale_damping",
            None,
            "float",
            "Downpour push rule, with --outer_learning_rate: lambda; the entries "
            "of a push of staleness s whose step goes the outer momentum's way "
            "are divided by 1 + lambda*s (0: off; unset: 1 with "
            "--outer_learning_rate and --outer_momentum > 0).",
            lower_bound=0.0,
        ),
    )
    needs_staleness = True
    reads_state = "outer_learning_rate"  # Its `m`, the outer momentum.

    def __init__(self, config):
        super().__init__(config)
        lam = config.stale_damping
        self.lam = DEFAULT_DAMPING if lam is None else float(lam)

    @classmethod
    def is_on(cls, config) -> bool:
        """Set > 0, or unset with the outer optimizer and `outer_momentum` > 0."""
        lam = config.stale_damping
        if lam is None:
            return config.outer_learning_rate is not None and config.outer_momentum > 0
        return lam > 0

    @classmethod
    def check(cls, config) -> None:
        if config.stale_damping is not None:
            rule.check_float(
                "stale_damping", config.stale_damping, "None (the default)", ">= 0"
            )

    def reference_correct(self, grads, params, fetched, staleness, state=None):
        return [damp(d, m, staleness, self.lam) for d, m in zip(grads, state)]

    def correct(self, grad, variable, fetched, staleness, state=None):
        import tensorflow as tf

        from tf_distbelief.downpour import base

        m = base.read(state.handle, variable.dtype)
        factor = 1 + tf.cast(self.lam, variable.dtype) * tf.cast(
            staleness, variable.dtype
        )
        return tf.where(grad * m < 0, grad / factor, grad)


RULE = StaleDamping
