"""Staleness-aware AdaGrad steps (`adagrad.staleness`) against NumPy."""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_distbelief import adagrad, checks
from tf_distbelief.adagrad import staleness
from tf_distbelief.fit import training
from tf_distbelief.strategy import DistBeliefStrategy


def _numpy_damped_adagrad(value, grads, taus, lr, a0, eps, power):
    """Independent reference: a += g^2, then
    w -= lr / max(1, tau)^power * g / (sqrt(a) + eps)."""
    value = np.array(value, dtype=np.float64)
    accumulator = np.full_like(value, a0)
    for g, tau in zip(grads, taus):
        accumulator += g * g
        step = lr / max(1.0, float(tau)) ** power
        value -= step * g / (np.sqrt(accumulator) + eps)
    return value


@pytest.mark.parametrize("power", [0.5, 1.0, 0.0])
def test_each_update_is_damped_by_its_measured_staleness(power):
    rng = np.random.default_rng(3)
    value = rng.normal(size=4)
    grads = rng.normal(size=(6, 4))
    taus = [0, 1, 2, 7, 3, 30]
    var = tf.Variable(value, name="w")
    opt = adagrad.Adagrad(
        0.3, initial_accumulator_value=0.1, staleness_power=power, jit_compile=False
    )
    for g, tau in zip(grads, taus):
        # The step read the count `tau` applied updates ago.
        with staleness.scope(opt.iterations.read_value() - tau):
            opt.apply_gradients([(tf.constant(g), var)])
    np.testing.assert_allclose(
        var.numpy(),
        _numpy_damped_adagrad(value, grads, taus, 0.3, 0.1, 1e-7, power),
        rtol=1e-12,
    )


def test_outside_a_steps_scope_the_step_is_the_learning_rate():
    var = tf.Variable([1.0], dtype=tf.float64)
    opt = adagrad.Adagrad(0.1, staleness_power=1.0, jit_compile=False)
    opt.iterations.assign(50)
    opt.apply_gradients([(tf.constant([1.0], tf.float64), var)])
    np.testing.assert_allclose(var.numpy(), [0.9046537502], rtol=0, atol=1e-10)


@pytest.mark.parametrize("power", [-0.5, float("nan"), "1", None])
def test_a_bad_staleness_power_is_refused_by_name(power):
    with pytest.raises(checks.ArgumentError, match="staleness_power"):
        adagrad.Adagrad(0.1, staleness_power=power)


def test_the_staleness_power_is_in_the_config():
    opt = adagrad.Adagrad(0.1, staleness_power=0.25)
    assert opt.get_config()["staleness_power"] == 0.25
    assert adagrad.Adagrad.from_config(opt.get_config()).staleness_power == 0.25


def test_the_default_damps_8_and_16_replicas_and_leaves_1_and_2_alone():
    """The default power (0.75) is one number for every entry point: the
    job's config (and so `--staleness_power`), tf_keras's and Keras 3's
    AdaGrad. In steady state a gradient of W asynchronous replicas is about
    W - 1 updates stale: 1 and 2 replicas train undamped; 8 and 16 take
    7^-0.75 and 15^-0.75 of the step, the setting that kept the README's
    digits job at the 2-worker accuracy (benchmarks/README, "More model
    replicas")."""
    from tf_distbelief import job
    from tf_distbelief.keras3 import optimizer as keras3_optimizer

    assert job.JobConfig().staleness_power == 0.75
    assert adagrad.Adagrad(0.1).staleness_power == 0.75
    assert keras3_optimizer.Adagrad().staleness_power == 0.75
    applied = tf.Variable(0, dtype=tf.int64)
    factor = {}
    for workers in (1, 2, 8, 16):
        applied.assign(workers - 1)
        read = tf.constant(0, tf.int64)
        factor[workers] = float(staleness.damping(applied, read, 0.75))
    assert factor[1] == factor[2] == 1.0
    np.testing.assert_allclose(factor[8], 7**-0.75, rtol=1e-15)
    np.testing.assert_allclose(factor[16], 15**-0.75, rtol=1e-15)


class _LinearWithOthersUpdates(tf_keras.Model):
    """`x @ w` (float64, no bias) trained by MSE, whose step lets `others`
    updates land between its forward pass and its own update: what `others`
    other replicas pushing meanwhile do to the ps's applied-step count."""

    def __init__(self, w0, others):
        super().__init__()
        self.others = others
        self.dense = tf_keras.layers.Dense(
            1,
            use_bias=False,
            dtype="float64",
            kernel_initializer=tf_keras.initializers.Constant(w0),
        )

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.iterations.assign_add(self.others)
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        return {"loss": loss}


@pytest.mark.slow
@pytest.mark.parametrize("others", [3, 1])
def test_fit_damps_each_step_by_the_updates_applied_since_its_read(
    local_cluster, others
):
    # Through `fit.fit` on a real cluster: the step reads the applied-step
    # count before its forward pass and the update on the ps measures
    # `others` updates since (1 worker, so no real replica interleaves).
    rng = np.random.default_rng(0)
    x, y, w0 = (
        rng.normal(size=shape).astype(np.float32).astype(np.float64)
        for shape in [(8, 3), (8, 1), (3, 1)]
    )
    steps, lr, power = 6, 0.25, 0.5
    strategy = DistBeliefStrategy(local_cluster.resolver_for(1, 1))
    with strategy.scope():
        model = _LinearWithOthersUpdates(w0, others)
        model.compile(
            adagrad.Adagrad(lr, initial_accumulator_value=0.125, staleness_power=power),
            steps_per_execution=2,
        )
    # Every step sees the whole set, so the order of the steps is fixed.
    whole = tf_keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensors((x, y)).repeat()
    )
    training.fit(model, whole, epochs=1, steps_per_epoch=steps, batch_size=8)

    w, a = w0.copy(), np.full_like(w0, 0.125)
    for _ in range(steps):
        g = 2.0 / len(x) * x.T @ (x @ w - y)
        a += g * g
        w -= lr / max(1, others) ** power * g / (np.sqrt(a) + 1e-7)
    np.testing.assert_allclose(model.dense.kernel.numpy(), w, rtol=1e-12)
    assert int(model.optimizer.iterations.numpy()) == steps * (1 + others)


def test_the_keras3_ps_adagrad_is_damped_by_the_same_rule():
    from tf_distbelief.keras3 import optimizer as keras3_optimizer

    rng = np.random.default_rng(5)
    value, grads = rng.normal(size=3), rng.normal(size=(5, 3))
    taus = [0, 4, 1, 9, 2]
    rule = keras3_optimizer.Adagrad(0.3, 0.1, 1e-7, staleness_power=0.75)
    var = tf.Variable(value)
    accumulator = tf.Variable(np.full(3, 0.1))
    applied = tf.Variable(0, dtype=tf.int64)
    for g, tau in zip(grads, taus):
        read = rule.read_before(applied) - tau
        rule.apply(var, accumulator, tf.constant(g), rule.damping(applied, read))
        applied.assign_add(1)
    np.testing.assert_allclose(
        var.numpy(),
        _numpy_damped_adagrad(value, grads, taus, 0.3, 0.1, 1e-7, 0.75),
        rtol=1e-12,
    )
    # `fit`'s tf_keras optimizer argument keeps its power.
    tf_keras_adagrad = adagrad.Adagrad(0.25, staleness_power=0.25)
    assert keras3_optimizer.from_optimizer(tf_keras_adagrad).staleness_power == 0.25
    assert keras3_optimizer.Adagrad(staleness_power=0).read_before(applied) is None
