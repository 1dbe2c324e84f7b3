"""The optimizers a Keras 3 model trains with on the ps: AdaGrad and SGD.

`tf_distbelief.adagrad.Adagrad` is a tf_keras optimizer (it subclasses
`tf_keras.optimizers.Adagrad`), and a Keras 3 optimizer keeps its state in
Keras 3 variables on the coordinator. The Keras 3 path therefore applies each
update itself, as one fused op on the ps shard that holds the variable:

* `Adagrad`: the rule of `tf_distbelief.adagrad.rule.adagrad_update` (epsilon
  outside the square root) by the same fused op as the tf_keras path
  (`tf_distbelief.adagrad.ops.apply_adagrad`), with an accumulator per shard;
* `SGD`: `keras.optimizers.SGD`'s rule (momentum and Nesterov momentum as
  Keras 3 writes them) by `ResourceApplyKerasMomentum`, with a momentum per
  shard, or plain gradient descent without momentum.

`from_optimizer` maps `fit`'s `optimizer` argument (including a
`keras.optimizers.SGD`) to one of them, or refuses it by name.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.adagrad import ops as adagrad_ops
from tf_distbelief.adagrad import staleness

# `tf_distbelief.adagrad.Adagrad` (tf_keras) is recognised by its module, so that this
# module never imports tf_keras.
_TF_KERAS_ADAGRAD_MODULE = "tf_distbelief.adagrad.optimizer"
# `keras.optimizers.SGD`'s module (Keras 3), mapped to `SGD`.
_KERAS_SGD_MODULE = "keras.src.optimizers.sgd"


def _check_finite(name: str, value, low: float, strict: bool, high=None) -> None:
    ok = checks.is_number(value) and float(value) < float("inf")
    ok = ok and (value > low if strict else value >= low)
    ok = ok and (high is None or value <= high)
    if not ok:
        rule = ("> " if strict else ">= ") + str(low)
        rule += "" if high is None else f" and <= {high}"
        raise checks.argument_error(name, f"a finite number {rule}", value)


@dataclasses.dataclass(frozen=True)
class Adagrad:
    """AdaGrad applied on the ps shards (Dean et al. 2012, section 4.1).

    The defaults are `tf_distbelief.adagrad.Adagrad`'s.

    Attributes:
      learning_rate: gamma, a float > 0.
      initial_accumulator_value: `a_0`, a float >= 0.
      epsilon: added to `sqrt(a)`, a float >= 0.
      staleness_power: stock training applies a gradient `tau` updates stale
        with step `learning_rate / max(1, tau)^staleness_power`
        (`tf_distbelief.adagrad.staleness`), a float >= 0; 0 turns it off.
      slot_name: `"accumulators"`, the slot's name in a checkpoint
        (`optimizer/accumulators/<i>`).

    Raises:
      ValueError: a value outside those ranges (or not finite).
    """

    learning_rate: float = 0.1
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    staleness_power: float = 0.75
    slot_name: ClassVar[str] = "accumulators"

    def __post_init__(self):
        _check_finite("learning_rate", self.learning_rate, 0, True)
        _check_finite(
            "initial_accumulator_value", self.initial_accumulator_value, 0, False
        )
        _check_finite("epsilon", self.epsilon, 0, False)
        _check_finite("staleness_power", self.staleness_power, 0, False)

    @property
    def slot_initial_value(self) -> float:
        """Each shard's accumulator starts at `initial_accumulator_value`."""
        return self.initial_accumulator_value

    def apply(self, variable, accumulator, gradient, damping=None):
        """One AdaGrad update of a ps variable (one shard) and its accumulator.

        `a <- a + g^2; w <- w - gamma * g / (sqrt(a) + epsilon)`, the fused
        `ResourceApplyAdagradV2` (sparse for `tf.IndexedSlices`) on the
        variable's device.

        Args:
          variable: a `tf.Variable` on a ps task.
          accumulator: its accumulator, same shape and dtype, same device.
          gradient: a tensor of the variable's shape, or `tf.IndexedSlices`.
          damping: None, or the float64 factor of `gamma` for the gradient's
            staleness (`staleness.damping`).

        Returns:
          The op.
        """
        dtype = variable.dtype
        lr = tf.constant(self.learning_rate, dtype)
        if damping is not None:
            lr = lr * tf.cast(damping, dtype)
        return adagrad_ops.apply_adagrad(
            variable.handle,
            accumulator.handle,
            gradient,
            lr,
            tf.constant(self.epsilon, dtype),
        )

    def read_before(self, applied):
        """`applied` (the applied-step counter) read now, or None if undamped."""
        return applied.read_value() if self.staleness_power > 0 else None

    def damping(self, applied, read):
        """The factor of `gamma` for the step that read `read` (`apply`)."""
        return staleness.damping(applied, read, self.staleness_power)


@dataclasses.dataclass(frozen=True)
class SGD:
    """SGD on the ps shards, with `keras.optimizers.SGD`'s momentum rule.

    Without momentum `w <- w - lr * g`; with momentum `m <- momentum * m -
    lr * g`, then `w <- w + m` (Nesterov: `w <- w + momentum * m - lr * g`),
    `m` starting at 0 on each shard: Keras 3's `SGD.update_step`, run as the
    fused `ResourceApplyKerasMomentum` on the shard's ps task.

    Attributes:
      learning_rate: a float > 0.
      momentum: a float >= 0 and <= 1 (0: plain SGD, no slot).
      nesterov: Nesterov momentum.
      slot_name: `"momentums"`, the slot's name in a checkpoint
        (`optimizer/momentums/<i>`).

    Raises:
      ValueError: a value outside those ranges (or not finite).
    """

    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    slot_name: ClassVar[str] = "momentums"

    def __post_init__(self):
        _check_finite("learning_rate", self.learning_rate, 0, True)
        _check_finite("momentum", self.momentum, 0, False, high=1)
        checks.check_bool("nesterov", self.nesterov)

    @property
    def slot_initial_value(self) -> float | None:
        """Each shard's momentum starts at 0; None (no slot) without momentum."""
        return 0.0 if self.momentum else None

    def apply(self, variable, momentum, gradient):
        """One SGD update of a ps variable (one shard) and its momentum.

        Args:
          variable: a `tf.Variable` on a ps task.
          momentum: its momentum (same shape, dtype and device), or None
            when `self.momentum` is 0.
          gradient: a tensor of the variable's shape, or `tf.IndexedSlices`
            (rows of a repeated index are summed first).

        Returns:
          The op.
        """
        dtype = variable.dtype
        lr = tf.constant(self.learning_rate, dtype)
        sparse = isinstance(gradient, tf.IndexedSlices)
        if sparse:
            gradient = adagrad_ops.deduplicate(gradient)
        if momentum is None:
            if sparse:
                return tf.raw_ops.ResourceScatterAdd(
                    resource=variable.handle,
                    indices=gradient.indices,
                    updates=-lr * gradient.values,
                )
            return tf.raw_ops.ResourceApplyGradientDescent(
                var=variable.handle, alpha=lr, delta=gradient
            )
        beta = tf.constant(self.momentum, dtype)
        if sparse:
            return tf.raw_ops.ResourceSparseApplyKerasMomentum(
                var=variable.handle,
                accum=momentum.handle,
                lr=lr,
                grad=gradient.values,
                indices=gradient.indices,
                momentum=beta,
                use_nesterov=self.nesterov,
            )
        return tf.raw_ops.ResourceApplyKerasMomentum(
            var=variable.handle,
            accum=momentum.handle,
            lr=lr,
            grad=gradient,
            momentum=beta,
            use_nesterov=self.nesterov,
        )


# Settings of a Keras 3 optimizer that `SGD` has no counterpart for, with the
# values that mean "off".
_KERAS_OFF = {
    "weight_decay": (None, 0),
    "clipnorm": (None,),
    "clipvalue": (None,),
    "global_clipnorm": (None,),
    "use_ema": (False,),
    "loss_scale_factor": (None,),
    "gradient_accumulation_steps": (None,),
}


def from_optimizer(optimizer) -> Adagrad | SGD:
    """The ps optimizer that `fit`'s `optimizer` argument stands for.

    Args:
      optimizer: None or `"adagrad"` (`Adagrad()`), `"sgd"` (`SGD()`), an
        `Adagrad` or `SGD`, a `tf_distbelief.adagrad.Adagrad` (tf_keras) with a
        constant learning rate, or a `keras.optimizers.SGD` with a constant
        learning rate (its `momentum` and `nesterov` taken) and none of
        weight decay, gradient clipping, EMA, loss scaling or gradient
        accumulation.

    Returns:
      An `Adagrad` or an `SGD`.

    Raises:
      ValueError: any other optimizer or setting, named (a Keras 3 optimizer
        keeps its state on the coordinator; Keras 3's AdaGrad puts epsilon
        inside the square root).
    """
    if optimizer is None or optimizer == "adagrad":
        return Adagrad()
    if optimizer == "sgd":
        return SGD()
    if isinstance(optimizer, (Adagrad, SGD)):
        return optimizer
    config = optimizer.get_config() if hasattr(optimizer, "get_config") else {}
    constant = isinstance(config.get("learning_rate"), (int, float))
    if type(optimizer).__module__ == _TF_KERAS_ADAGRAD_MODULE and constant:
        return Adagrad(
            float(config["learning_rate"]),
            float(config["initial_accumulator_value"]),
            float(config["epsilon"]),
            float(config["staleness_power"]),
        )
    if type(optimizer).__module__ == _KERAS_SGD_MODULE and not constant:
        raise ValueError(
            "Argument `optimizer`: a `keras.optimizers.SGD` with a learning-rate "
            "schedule is not applied on the ps (a constant learning rate only). "
            f"Received: learning_rate={config.get('learning_rate')!r}"
        )
    if type(optimizer).__module__ == _KERAS_SGD_MODULE:
        for name, off in _KERAS_OFF.items():
            if config.get(name, off[0]) not in off:
                raise ValueError(
                    f"Argument `optimizer`: `keras.optimizers.SGD` with `{name}` "
                    f"is not applied on the ps (only learning_rate, momentum, "
                    f"nesterov). Received: {name}={config[name]!r}"
                )
        return SGD(
            float(config["learning_rate"]),
            float(config["momentum"]),
            bool(config["nesterov"]),
        )
    raise checks.argument_error(
        "optimizer",
        "None, 'adagrad', 'sgd', a `tf_distbelief.keras3.Adagrad` or `SGD`, a "
        "`tf_distbelief.adagrad.Adagrad`, or a `keras.optimizers.SGD`, with a "
        "constant learning rate: a Keras 3 model's optimizer runs on the ps shards "
        "(Keras 3's own optimizers keep their state on the coordinator; its Adagrad "
        "puts epsilon inside the square root)",
        optimizer,
    )
