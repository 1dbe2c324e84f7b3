"""Delay compensation on the ps (DC-ASGD).

Zheng et al. ICML 2017, "Asynchronous Stochastic Gradient Descent with Delay
Compensation", equation 10. Setting (`DownpourConfig` keyword argument and
launch flag):

* `delay_compensation`: `lambda`, a float >= 0; 0.0 (default): off. A push
  of `G` is applied as `G + lambda * G * G * (w_now - w_fetched)`, with
  `w_now` the ps value and `w_fetched` the value this replica last fetched
  (AdaGrad's pushed squares, if sent, are not changed). Not with a rule whose
  pushes are parameter deltas (`outer_learning_rate`): the push is then no
  gradient.

The ps knows `w_fetched` without a second model on the network
(`PushRule.needs_fetched`): at each fetch it writes the values it sends into
a ps-side copy per replica (`[num_workers, ...]` per variable shard, on its ps
task; `on_ps.PushRules.record_fetch`). Bytes on the network: none more; ps
memory: `num_workers` more copies of the model (not checkpointed: a resumed
replica fetches first, which rewrites its row). TensorFlow is imported by the
TF hooks only.
"""

from __future__ import annotations

from tf_distbelief.downpour.push_rules import rule

__all__ = ["DelayCompensation", "RULE"]


class DelayCompensation(rule.PushRule):
    """DC-ASGD's correction of a pushed gradient (module docstring).

    Args:
      config: a `DownpourConfig` with `delay_compensation` > 0.
    """

    name = "delay_compensation"
    title = "delay compensation"
    settings = (
        rule.Setting(
            "delay_compensation",
            0.0,
            "float",
            "Downpour push rule (DC-ASGD, Zheng et al. 2017): lambda of "
            "g + lambda*g*g*(w_now - w_fetched) on the ps (0: off).",
            lower_bound=0.0,
        ),
    )
    needs_fetched = True

    def __init__(self, config):
        super().__init__(config)
        self.lam = config.delay_compensation

    @classmethod
    def check(cls, config) -> None:
        rule.check_float("delay_compensation", config.delay_compensation, "", ">= 0")

    @classmethod
    def check_combination(cls, config, others) -> None:
        for other in others:
            if other.pushes_deltas:
                raise ValueError(
                    f"Arguments `{other.name}` and `delay_compensation` cannot "
                    "be combined: delay compensation corrects a gradient, and "
                    f"with {other.title} a push is a parameter delta. Received: "
                    f"delay_compensation={config.delay_compensation!r}; set it to 0."
                )

    def reference_correct(self, grads, params, fetched, staleness):
        lam = self.lam
        return [a + lam * a * a * (w - f) for a, w, f in zip(grads, params, fetched)]

    def correct(self, grad, variable, fetched, staleness):
        import tensorflow as tf

        from tf_distbelief.downpour import base

        lam = tf.cast(self.lam, variable.dtype)
        w_now = base.read(variable.handle, variable.dtype)
        return grad + lam * grad * grad * (w_now - fetched)


RULE = DelayCompensation
