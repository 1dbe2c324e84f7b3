"""AdaGrad on the ps shards (paper section 4.1) against NumPy, and its placement."""

import numpy as np
import pytest
import tensorflow as tf

from tf_distbelief import adagrad
from tf_distbelief.strategy import DistBeliefStrategy


def _numpy_adagrad(value, grads, lr, a0, eps):
    """Independent reference: a = a0 + sum g^2; w -= lr g / (sqrt(a) + eps)."""
    value = np.array(value, dtype=np.float64)
    accumulator = np.full_like(value, a0)
    for g in grads:
        accumulator += g * g
        value -= lr * g / (np.sqrt(accumulator) + eps)
    return value


def _apply(values, grads, **kwargs):
    var = tf.Variable(np.asarray(values, np.float64), name="w")
    opt = adagrad.Adagrad(**kwargs)
    for g in grads:
        opt.apply_gradients([(tf.constant(g, tf.float64), var)])
    return var.numpy()


def test_one_step_from_one():
    result = _apply(
        [1.0], [[1.0]], learning_rate=0.1, initial_accumulator_value=0.1, epsilon=1e-7
    )
    np.testing.assert_allclose(result, [0.9046537502], rtol=0, atol=1e-10)


def test_zero_gradient_with_zero_accumulator_stays_put():
    result = _apply(
        [0.5, -2.0],
        [[0.0, 0.0]] * 3,
        learning_rate=0.1,
        initial_accumulator_value=0.0,
        epsilon=1e-7,
    )
    assert np.all(np.isfinite(result))
    np.testing.assert_array_equal(result, [0.5, -2.0])


@pytest.mark.parametrize("a0,eps", [(0.1, 1e-7), (0.0, 1e-8), (1.0, 0.0)])
def test_many_steps_match_numpy(a0, eps):
    rng = np.random.default_rng(0)
    value = rng.normal(size=5)
    grads = rng.normal(size=(7, 5))
    result = _apply(
        value, grads, learning_rate=0.3, initial_accumulator_value=a0, epsilon=eps
    )
    np.testing.assert_allclose(
        result, _numpy_adagrad(value, grads, 0.3, a0, eps), rtol=1e-12
    )


def test_pure_update_matches_numpy_reference():
    value, accumulator = adagrad.adagrad_update(
        np.array([1.0]), np.array([0.1]), np.array([1.0]), 0.1, 1e-7
    )
    np.testing.assert_allclose(value, [0.9046537502], atol=1e-10)
    np.testing.assert_allclose(accumulator, [1.1])


def test_sparse_rows_match_numpy():
    var = tf.Variable(np.ones((4, 2)), name="table")
    opt = adagrad.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7)
    grad = tf.IndexedSlices(tf.constant([[1.0, 2.0]], tf.float64), tf.constant([2]))
    opt.apply_gradients([(grad, var)])
    expected = np.ones((4, 2))
    expected[2] = _numpy_adagrad([1.0, 1.0], [np.array([1.0, 2.0])], 0.1, 0.1, 1e-7)
    np.testing.assert_allclose(var.numpy(), expected, rtol=1e-12)


def _numpy_summed(value, pushes, steps, lr, a0, eps):
    """Independent reference: a += G^2 / steps; w -= lr G / (sqrt(a) + eps)."""
    value = np.array(value, dtype=np.float64)
    accumulator = np.full_like(value, a0)
    for g in pushes:
        accumulator += g * g / steps
        value -= lr * g / (np.sqrt(accumulator) + eps)
    return value


@pytest.mark.parametrize("steps", [1, 4, 16])
def test_summed_gradient_counts_as_its_steps(steps):
    rng = np.random.default_rng(steps)
    value = rng.normal(size=(4, 3))
    pushes = rng.normal(size=(3, 4, 3)) * steps  # Sums of `steps` gradients.
    rows = [0, 2]
    dense = tf.Variable(value, name="dense")
    table = tf.Variable(value, name="table")
    opt = adagrad.Adagrad(0.3, initial_accumulator_value=0.1, epsilon=1e-7)
    opt.build([dense, table])
    for g in pushes:
        opt.apply_summed_gradient(tf.constant(g), dense, steps)
        opt.apply_summed_gradient(
            tf.IndexedSlices(tf.constant(g[rows]), tf.constant(rows)), table, steps
        )
    want = _numpy_summed(value, pushes, steps, 0.3, 0.1, 1e-7)
    np.testing.assert_allclose(dense.numpy(), want, rtol=1e-12)
    want_table = value.copy()
    want_table[rows] = want[rows]
    np.testing.assert_allclose(table.numpy(), want_table, rtol=1e-12)
    if steps == 1:  # One step: plain AdaGrad.
        np.testing.assert_allclose(
            want, _numpy_adagrad(value, pushes, 0.3, 0.1, 1e-7), rtol=1e-12
        )


def test_gradient_and_squares_match_numpy():
    """A push of `G = sum g` and `S = sum g^2`: a += S; w -= lr G / (sqrt(a) + eps)."""
    rng = np.random.default_rng(7)
    value = rng.normal(size=(4, 3))
    steps = rng.normal(size=(3, 4, 4, 3))  # 3 pushes of 4 steps' gradients.
    rows = [1, 3]
    dense = tf.Variable(value, name="dense")
    table = tf.Variable(value, name="table")
    opt = adagrad.Adagrad(0.3, initial_accumulator_value=0.1, epsilon=1e-7)
    opt.build([dense, table])
    want = value.copy()
    accumulator = np.full_like(value, 0.1)
    for push in steps:
        g, s = push.sum(0), (push * push).sum(0)
        opt.apply_gradient_and_squares(tf.constant(g), tf.constant(s), dense)
        opt.apply_gradient_and_squares(
            tf.IndexedSlices(tf.constant(g[rows]), tf.constant(rows)),
            tf.IndexedSlices(tf.constant(s[rows]), tf.constant(rows)),
            table,
        )
        for step in push:  # The accumulator holds every step's square.
            accumulator += step * step
        want -= 0.3 * g / (np.sqrt(accumulator) + 1e-7)
    np.testing.assert_allclose(dense.numpy(), want, rtol=1e-12)
    want_table = value.copy()
    want_table[rows] = want[rows]
    np.testing.assert_allclose(table.numpy(), want_table, rtol=1e-12)
    np.testing.assert_allclose(opt._accumulators[0].numpy(), accumulator, rtol=1e-12)
    # One step per push: plain AdaGrad.
    one = tf.Variable(value, name="one")
    opt = adagrad.Adagrad(0.3, initial_accumulator_value=0.1, epsilon=1e-7)
    opt.build([one])
    for g in steps[0]:
        opt.apply_gradient_and_squares(tf.constant(g), tf.constant(g * g), one)
    np.testing.assert_allclose(
        one.numpy(), _numpy_adagrad(value, steps[0], 0.3, 0.1, 1e-7), rtol=1e-12
    )


@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("index_dtype", [tf.int32, tf.int64])
def test_repeated_rows_are_summed_first(steps, index_dtype):
    """Rows at a repeated index are one gradient, their sum: a += (sum g)^2 / steps."""
    value = np.arange(8.0).reshape(4, 2)
    rows = np.array([[1.0, 1.0], [1.0, 3.0], [0.5, -2.0]])
    indices = [1, 3, 1]
    table = tf.Variable(value, name="table")
    opt = adagrad.Adagrad(0.3, initial_accumulator_value=0.1, epsilon=1e-7)
    opt.build([table])
    grad = tf.IndexedSlices(tf.constant(rows), tf.constant(indices, index_dtype))
    opt.apply_summed_gradient(grad, table, steps)
    dense = np.zeros_like(value)
    np.add.at(dense, indices, rows)  # The dense gradient the rows stand for.
    scale = np.sqrt(steps)
    accumulator = np.full_like(value, 0.1)
    accumulator[[1, 3]] += (dense[[1, 3]] / scale) ** 2
    want = value.copy()
    want[[1, 3]] -= (
        0.3 * scale * (dense[[1, 3]] / scale) / (np.sqrt(accumulator[[1, 3]]) + 1e-7)
    )
    np.testing.assert_array_equal(opt._accumulators[0].numpy(), accumulator)
    # The op orders its float math its own way: ulps apart, not bits.
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-15, atol=0)
    if steps == 1:  # The figures: indices [1, 1] of 1.0 give 4.1, not 2.1.
        twice = tf.IndexedSlices(
            tf.constant([[1.0, 1.0]] * 2, tf.float64), tf.constant([1, 1])
        )
        opt.update_step(twice, table)
        assert opt._accumulators[0].numpy()[1, 0] == accumulator[1, 0] + 4.0


def test_repeated_rows_with_squares_match_numpy():
    """A push's `G` and `S` with a repeated index: a += sum S; w -= lr sum G / ..."""
    value = np.arange(8.0).reshape(4, 2)
    g = np.array([[1.0, 2.0], [3.0, -1.0], [0.5, 0.5]])
    s = g * g
    indices = [2, 0, 2]
    table = tf.Variable(value, name="table")
    opt = adagrad.Adagrad(0.3, initial_accumulator_value=0.1, epsilon=1e-7)
    opt.build([table])
    opt.apply_gradient_and_squares(
        tf.IndexedSlices(tf.constant(g), tf.constant(indices)),
        tf.IndexedSlices(tf.constant(s), tf.constant(indices)),
        table,
    )
    dense_g, dense_s = np.zeros_like(value), np.full_like(value, 0.1)
    np.add.at(dense_g, indices, g)
    np.add.at(dense_s, indices, s)
    want = value.copy()
    want[[0, 2]] -= 0.3 * dense_g[[0, 2]] / (np.sqrt(dense_s[[0, 2]]) + 1e-7)
    np.testing.assert_array_equal(opt._accumulators[0].numpy(), dense_s)
    # The op orders its float math its own way: ulps apart, not bits.
    np.testing.assert_allclose(table.numpy(), want, rtol=1e-15, atol=0)


@pytest.mark.parametrize("steps", [0, -1, 2.0, True])
def test_summed_gradient_steps_must_be_a_positive_int(steps):
    var = tf.Variable(np.ones(3), name="w")
    opt = adagrad.Adagrad(0.1)
    opt.build([var])
    with pytest.raises(ValueError, match=r"`steps` must be an int >= 1.*Received"):
        opt.apply_summed_gradient(tf.ones(3, tf.float64), var, steps)
    np.testing.assert_array_equal(var.numpy(), np.ones(3))


def test_negative_initial_accumulator_is_rejected():
    with pytest.raises(
        ValueError,
        match=r"Argument `initial_accumulator_value` must be >= 0.*Received: -0.1",
    ):
        adagrad.Adagrad(0.1, initial_accumulator_value=-0.1)


def test_negative_epsilon_is_rejected():
    with pytest.raises(
        ValueError, match=r"Argument `epsilon` must be >= 0. Received: -1"
    ):
        adagrad.Adagrad(0.1, epsilon=-1)


def test_accumulators_and_updates_live_on_each_shard(local_cluster):
    strategy = DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        var = tf.Variable(np.ones((4, 3)), name="w")
        opt = adagrad.Adagrad(0.1, initial_accumulator_value=0.1, epsilon=1e-7)
        opt.build(var.variables)
    shard_devices = [v.device for v in var.variables]
    assert shard_devices == [
        "/job:ps/replica:0/task:0/device:CPU:0",
        "/job:ps/replica:0/task:1/device:CPU:0",
    ]
    (accumulators,) = [a for a in opt.variables if hasattr(a, "variables")]
    assert [a.device for a in accumulators.variables] == shard_devices

    @tf.function
    def step():
        grads = tf.split(tf.ones((4, 3), tf.float64), [2, 2])
        strategy.run(lambda: opt.apply_gradients(zip(grads, var.variables)))

    coordinator.schedule(step)
    coordinator.join()
    np.testing.assert_allclose(var.numpy(), np.full((4, 3), 0.9046537502), atol=1e-10)
    graph = step.get_concrete_function().graph
    update_devices = sorted(
        op.device
        for op in graph.get_operations()
        if op.type == "ResourceApplyAdagradV2"
    )
    assert update_devices == shard_devices
