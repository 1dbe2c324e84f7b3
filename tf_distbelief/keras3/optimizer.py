"""AdaGrad on the ps for Keras 3 models: hyperparameters and the fused op.

`tf_distbelief.adagrad.Adagrad` is a tf_keras optimizer (it subclasses
`tf_keras.optimizers.Adagrad`), and a Keras 3 optimizer keeps its state in
Keras 3 variables on the coordinator. The Keras 3 path therefore applies
AdaGrad itself, with the rule of `tf_distbelief.adagrad.rule.adagrad_update`
(epsilon outside the square root) run by the same fused op as the tf_keras
path (`tf_distbelief.adagrad.ops.apply_adagrad`) on each ps shard.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.adagrad import ops as adagrad_ops

# `tf_distbelief.adagrad.Adagrad` (tf_keras) is recognised by its module, so that this
# module never imports tf_keras.
_TF_KERAS_ADAGRAD_MODULE = "tf_distbelief.adagrad.optimizer"


@dataclasses.dataclass(frozen=True)
class Adagrad:
    """AdaGrad applied on the ps shards (Dean et al. 2012, section 4.1).

    The defaults are `tf_distbelief.adagrad.Adagrad`'s.

    Attributes:
      learning_rate: gamma, a float > 0.
      initial_accumulator_value: `a_0`, a float >= 0.
      epsilon: added to `sqrt(a)`, a float >= 0.

    Raises:
      ValueError: a value outside those ranges (or not finite).
    """

    learning_rate: float = 0.1
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    def __post_init__(self):
        for name, low, strict in (
            ("learning_rate", 0.0, True),
            ("initial_accumulator_value", 0.0, False),
            ("epsilon", 0.0, False),
        ):
            value = getattr(self, name)
            ok = checks.is_number(value)
            ok = ok and float(value) < float("inf")
            ok = ok and (value > low if strict else value >= low)
            if not ok:
                rule = "> 0" if strict else ">= 0"
                raise ValueError(
                    f"Argument `{name}` must be a finite number {rule}. "
                    f"Received: {value!r}"
                )

    @classmethod
    def from_optimizer(cls, optimizer) -> Adagrad:
        """The `Adagrad` that `fit`'s `optimizer` argument stands for.

        Args:
          optimizer: None (the defaults), an `Adagrad`, the string
            `"adagrad"`, or a `tf_distbelief.adagrad.Adagrad` (tf_keras) with a
            constant learning rate, whose hyperparameters are taken.

        Returns:
          An `Adagrad`.

        Raises:
          ValueError: any other optimizer (a Keras 3 optimizer keeps its
            state on the coordinator, and its AdaGrad puts epsilon inside the
            square root).
        """
        if optimizer is None or optimizer == "adagrad":
            return cls()
        if isinstance(optimizer, cls):
            return optimizer
        if type(optimizer).__module__ == _TF_KERAS_ADAGRAD_MODULE:
            config = optimizer.get_config()
            if isinstance(config["learning_rate"], (int, float)):
                return cls(
                    float(config["learning_rate"]),
                    float(config["initial_accumulator_value"]),
                    float(config["epsilon"]),
                )
        raise ValueError(
            "Argument `optimizer` must be None, 'adagrad', a "
            "`tf_distbelief.keras3.Adagrad`, or a `tf_distbelief.adagrad.Adagrad` "
            "with a constant learning rate: a Keras 3 model's AdaGrad runs on the ps "
            f"shards. Received: {optimizer!r}"
        )

    def apply(self, variable, accumulator, gradient):
        """One AdaGrad update of a ps variable (one shard) and its accumulator.

        `a <- a + g^2; w <- w - gamma * g / (sqrt(a) + epsilon)`, the fused
        `ResourceApplyAdagradV2` (sparse for `tf.IndexedSlices`) on the
        variable's device.

        Args:
          variable: a `tf.Variable` on a ps task.
          accumulator: its accumulator, same shape and dtype, same device.
          gradient: a tensor of the variable's shape, or `tf.IndexedSlices`.

        Returns:
          The op.
        """
        dtype = variable.dtype
        return adagrad_ops.apply_adagrad(
            variable.handle,
            accumulator.handle,
            gradient,
            tf.constant(self.learning_rate, dtype),
            tf.constant(self.epsilon, dtype),
        )
