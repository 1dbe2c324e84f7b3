"""The staleness-aware step: each push's step divided by its staleness.

Zhang et al. IJCAI 2016, "Staleness-aware Async-SGD for Distributed Deep
Learning", section 3: the learning rate over the staleness. Setting
(`DownpourConfig` keyword argument and launch flag):

* `staleness_scaled`: False (default): off. True: each push's step is
  divided by its staleness `s` (pushes by other replicas since this
  replica's fetch, as counted for `max_staleness`), by `max(s, 1)`. The
  push's gradient is divided by it; AdaGrad on the ps grows its accumulator
  by the unscaled squares, so its step is the unscaled step over
  `max(s, 1)`. The staleness is then read from the ps before the push is
  applied, as with `max_staleness` (`PushRule.needs_staleness`). A push with
  staleness 0 or 1 is unchanged: with 2 replicas and `n_fetch == n_push` it
  changes nothing.

TensorFlow is imported by the TF hook only.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks
from tf_distbelief.downpour.push_rules import rule

__all__ = ["RULE", "StalenessScaled"]


class StalenessScaled(rule.PushRule):
    """The step over `max(staleness, 1)` (module docstring).

    Args:
      config: a `DownpourConfig` with `staleness_scaled` True.
    """

    name = "staleness_scaled"
    title = "the staleness-scaled step"
    settings = (
        rule.Setting(
            "staleness_scaled",
            False,
            "bool",
            "Downpour push rule (Zhang et al. 2016): divide each push's step by "
            "its staleness.",
        ),
    )
    needs_staleness = True

    @classmethod
    def check(cls, config) -> None:
        if not isinstance(config.staleness_scaled, (bool, np.bool_)):
            raise checks.argument_error(
                "staleness_scaled", "a bool", config.staleness_scaled
            )

    def reference_scale(self, staleness):
        return 1.0 / max(staleness, 1)

    def scale(self, staleness, dtype):
        import tensorflow as tf

        most = tf.maximum(staleness, tf.constant(1, staleness.dtype))
        return 1 / tf.cast(most, dtype)


RULE = StalenessScaled
