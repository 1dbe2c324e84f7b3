"""AdaGrad applied on the parameter-server shards (Dean et al. 2012, section 4.1).

The update, per parameter i at its K-th update (Duchi et al. 2011):

    a_{i,K} = a_{i,0} + sum_{j<=K} g_{i,j}^2
    w_{i,K} = w_{i,K-1} - gamma * g_{i,K} / (sqrt(a_{i,K}) + epsilon)

`a_{i,0}` is `initial_accumulator_value`. `epsilon` sits outside the square root,
as in TensorFlow's `ResourceApplyAdagradV2` op, so a parameter whose gradients are
all exactly 0 with `a_{i,0} = 0` stays unchanged and finite (0 / epsilon = 0).

Each accumulator is created with `colocate_vars_with` its variable, so it lives on
the same ps shard as its slice (a ShardedVariable gets a ShardedVariable of
accumulators, shard by shard), and the update op runs on that shard: no
communication beyond the gradient push.
"""

from __future__ import annotations

import tensorflow as tf
import tf_keras

from tf_distbelief import checks
from tf_distbelief.adagrad import staleness
from tf_distbelief.adagrad.ops import apply_adagrad

__all__ = ["Adagrad"]


class Adagrad(tf_keras.optimizers.Adagrad):
    """tf_keras AdaGrad whose state and update stay on each variable's ps shard.

    Dean et al. 2012, section 4.1: "each parameter server shard ... keeps the
    accumulator for its own slice". Use it like `tf_keras.optimizers.Adagrad`; the
    arguments that change results are explicit.

    Args:
      learning_rate: gamma, a float > 0 or a schedule. The paper sets it about ten
        times the best fixed SGD learning rate.
      initial_accumulator_value: `a_0`, a float >= 0 (0.1 in tf_keras).
      epsilon: added to `sqrt(a)`, a float >= 0 (1e-7 in tf_keras).
      staleness_power: under asynchronous `fit` on several workers, a
        gradient `tau` updates stale is applied with step
        `gamma / max(1, tau)^staleness_power` (`adagrad.staleness`), a float
        >= 0; 0 turns it off. An update of staleness 0 or 1 is unchanged.
        Downpour's pushes are not damped by it (Downpour has its own push
        rules, `--staleness_scaled`).
      name: optimizer name.
      **kwargs: passed to `tf_keras.optimizers.Adagrad` (clipnorm, ...).

    Raises:
      ValueError: a negative `initial_accumulator_value`, `epsilon` or
        `staleness_power`, or a non-positive float `learning_rate`.
    """

    def __init__(
        self,
        learning_rate=0.1,
        initial_accumulator_value: float = 0.1,
        epsilon: float = 1e-7,
        staleness_power: float = 0.75,
        name: str = "Adagrad",
        **kwargs,
    ):
        if not float(initial_accumulator_value) >= 0:
            raise checks.argument_error(
                "initial_accumulator_value",
                ">= 0 (AdaGrad divides by the square root of the accumulator)",
                initial_accumulator_value,
            )
        if not float(epsilon) >= 0:
            raise checks.argument_error("epsilon", ">= 0", epsilon)
        checks.check_nonnegative("staleness_power", staleness_power)
        if isinstance(learning_rate, (int, float)) and not learning_rate > 0:
            raise checks.argument_error("learning_rate", "> 0", learning_rate)
        super().__init__(
            learning_rate=learning_rate,
            initial_accumulator_value=initial_accumulator_value,
            epsilon=epsilon,
            name=name,
            **kwargs,
        )
        self.staleness_power = float(staleness_power)

    def get_config(self):
        return {**super().get_config(), "staleness_power": self.staleness_power}

    def _build_learning_rate(self, learning_rate):
        if isinstance(learning_rate, (int, float)):
            # tf_keras stores a number in floatx (float32): 0.1 would become
            # 0.10000000149 and a float64 model would drift by 1.5e-8 relative
            # per step. float64 holds every float the user can pass exactly.
            with tf.init_scope():
                return tf.Variable(
                    float(learning_rate),
                    name="learning_rate",
                    dtype=tf.float64,
                    trainable=False,
                )
        return super()._build_learning_rate(learning_rate)

    def update_step(self, gradient, variable):
        # The step size a gradient of this staleness earns (`staleness`): the
        # learning rate itself outside an asynchronous step's scope.
        lr = staleness.damped_learning_rate(
            tf.cast(self.learning_rate, variable.dtype),
            self.iterations,
            self.staleness_power,
        )
        self._apply(gradient, variable, 1, lr)

    def apply_summed_gradient(self, gradient, variable, steps: int):
        """Applies the sum of `steps` gradients as `steps` AdaGrad updates.

        For a Downpour push (Dean et al. 2012, section 4.1) of `G`, the
        gradients of `steps` local steps summed: the accumulator grows as
        `steps` updates with the mean gradient `G / steps` would grow it,
        `a += steps * (G / steps)^2 = G^2 / steps`, and the parameters move by
        `gamma * G / (sqrt(a) + epsilon)`, what those updates would move them
        by with the accumulator at its new value. With SGD a pushed sum moves
        the parameters as far as its steps would; so it does here. Applying
        `G` as one update (`steps=1`) would move them by about `gamma` per
        push, whatever `steps` is.

        One fused `ResourceApplyAdagradV2` op on the variable's device, given
        `G / sqrt(steps)` and `gamma * sqrt(steps)`.

        Args:
          gradient: `G`, a tensor of the variable's shape and dtype, or
            `tf.IndexedSlices` of its rows.
          variable: a variable this optimizer was built with.
          steps: the number of gradients summed in `G`, an int >= 1.

        Raises:
          ValueError: `steps` is not an int >= 1.
        """
        if not checks.is_int(steps) or steps < 1:
            raise checks.argument_error(
                "steps", "an int >= 1 (the gradients summed in the push)", steps
            )
        self._apply(
            gradient, variable, steps, tf.cast(self.learning_rate, variable.dtype)
        )

    def _apply(self, gradient, variable, steps: int, lr):
        """`apply_summed_gradient` with the step size `lr` (a scalar tensor)."""
        if steps != 1:
            scale = tf.constant(steps**0.5, variable.dtype)
            lr = lr * scale
            if isinstance(gradient, tf.IndexedSlices):
                gradient = tf.IndexedSlices(
                    gradient.values / scale, gradient.indices, gradient.dense_shape
                )
            else:
                gradient = gradient / scale
        accumulator = self._accumulator(variable)
        epsilon = tf.cast(self.epsilon, variable.dtype)
        apply_adagrad(variable.handle, accumulator.handle, gradient, lr, epsilon)

    def apply_gradient_and_squares(self, gradient, squares, variable):
        """Applies a pushed sum of gradients with the sum of their squares.

        For a Downpour push (Dean et al. 2012, section 4.1) of `G`, the sum of
        a replica's gradients `g_j` since its last push, and `S`, the sum of
        their squares `g_j^2` (`DownpourConfig.adagrad_accumulator =
        "squares"`): the accumulator grows by `S`, as those steps would grow
        it, `a += S`, and the parameters move by `gamma * G / (sqrt(a) +
        epsilon)`. The accumulator then holds the paper's `sum_j g_j^2` over
        every gradient computed, whatever `n_push` is.

        Args:
          gradient: `G`, a tensor of the variable's shape and dtype, or
            `tf.IndexedSlices` of its rows (a repeated index: its rows are
            summed, `deduplicate`).
          squares: `S`, of the same kind as `gradient`: a repeated index adds
            each of its rows (a sum of squares sums).
          variable: a variable this optimizer was built with.
        """
        accumulator = self._accumulator(variable)
        lr = tf.cast(self.learning_rate, variable.dtype)
        epsilon = tf.cast(self.epsilon, variable.dtype)
        if isinstance(gradient, tf.IndexedSlices):
            grown = tf.raw_ops.ResourceScatterAdd(
                resource=accumulator.handle,
                indices=gradient.indices,
                updates=squares.values,
            )
        else:
            grown = accumulator.assign_add(squares, read_value=False)
        # The accumulator grown by `S`, one fused op moves the parameters.
        with tf.control_dependencies([grown]):
            apply_adagrad(
                variable.handle,
                accumulator.handle,
                gradient,
                lr,
                epsilon,
                update_slots=False,
            )

    def _accumulator(self, variable):
        """The accumulator slot of `variable` (on its ps shard)."""
        return self._accumulators[self._index_dict[self._var_key(variable)]]
