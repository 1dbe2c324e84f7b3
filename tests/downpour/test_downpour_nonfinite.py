"""Downpour's per-push non-finite guard (issue 10): no push with a NaN or inf
reaches a ps variable.

One worker and a fixed cycle of batches (finite ones and one with a NaN
feature) make every run deterministic: a guarded run must equal a run over
the finite pushes alone, bit for bit.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_distbelief as tfdb
from tf_distbelief import downpour
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.fit import training

FEATURES, CLASSES, BATCH = 4, 3, 8
X = np.linspace(-1.0, 1.0, BATCH * FEATURES, dtype=np.float32).reshape(BATCH, -1)
Y = np.arange(BATCH, dtype=np.int64) % CLASSES
X_NAN = X.copy()
X_NAN[2, 1] = np.nan


@pytest.fixture(scope="module")
def strategy(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(1, 2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    downpour.enable(strategy)
    return strategy


def _model(strategy, n):
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.layers.InputLayer(input_shape=(FEATURES,)),
                tf_keras.layers.Dense(
                    CLASSES,
                    kernel_initializer=tf_keras.initializers.GlorotUniform(0),
                    name="logits",
                ),
            ]
        )
        model.compile(
            tfdb.adagrad.Adagrad(0.5),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
        )
        model.downpour = downpour.install(
            model, downpour.DownpourConfig(n_fetch=n, n_push=n)
        )
    return model


def _data(pattern):
    """Batches by `pattern`, repeated: `1` is `X`, `0` is `X_NAN`."""

    def dataset_fn(_):
        batches = [(X, Y) if good else (X_NAN, Y) for good in pattern]
        xs, ys = zip(*batches)
        return tf.data.Dataset.from_tensor_slices((np.stack(xs), np.stack(ys))).repeat()

    return tf_keras.utils.experimental.DatasetCreator(dataset_fn)


def _fit(model, steps, pattern, **kwargs):
    lines = []
    result = training.fit(
        model,
        _data(pattern),
        epochs=1,
        steps_per_epoch=steps,
        batch_size=BATCH,
        print_fn=lines.append,
        callbacks=[downpour.DownpourMetrics(model.downpour)],
        **kwargs,
    )
    return result, lines


def _weights(model):
    return [w.numpy() for w in model.trainable_weights]


def _assert_equal_weights(model, reference):
    for got, want in zip(_weights(model), _weights(reference)):
        np.testing.assert_array_equal(got, want)


def test_raise_stops_at_the_push_and_no_nan_reaches_the_ps(strategy):
    model = _model(strategy, 1)
    with pytest.raises(
        tfdb.NonFiniteError,
        match=r"Non-finite push \(NaN or inf\) from worker 0 at its step 3 for "
        r"logits/kernel/part_0:0, logits/kernel/part_1:0, logits/bias/part_0:0, "
        r"logits/bias/part_1:0: the push was not applied",
    ) as raised:
        _fit(model, 6, [1, 1, 0])
    assert raised.value.step == 3
    assert int(model.downpour.update_count.numpy()) == 2
    assert int(model.optimizer.iterations.numpy()) == 2
    reference = _model(strategy, 1)
    _fit(reference, 2, [1])
    _assert_equal_weights(model, reference)


def test_skip_drops_and_counts_the_pushes(strategy):
    model = _model(strategy, 1)
    result, lines = _fit(model, 6, [1, 1, 0], nonfinite="skip")
    assert result.nonfinite_skipped == 2
    assert "nonfinite: 2 pushes skipped so far" in " ".join(lines)
    assert result.history[0]["nonfinite_pushes"] == 2
    (stats,) = model.downpour.stats()
    assert (stats.steps, stats.pushes, stats.nonfinite_pushes) == (6, 4, 2)
    assert int(model.optimizer.iterations.numpy()) == 4
    reference = _model(strategy, 1)
    _fit(reference, 4, [1])
    _assert_equal_weights(model, reference)


def test_skip_restarts_the_replica_from_its_last_push(strategy):
    """n_fetch = n_push = 2 with a local AdaGrad step: the NaN of step 1 spoils
    the cache, the sums to push and the local accumulator; after the dropped
    push each is back where the last push left it, so 8 steps with a NaN in
    every other push equal 4 finite steps exactly."""
    model = _model(strategy, 2)
    result, _ = _fit(model, 8, [1, 0, 1, 1], nonfinite="skip")
    assert result.nonfinite_skipped == 2
    (stats,) = model.downpour.stats()
    assert (stats.steps, stats.pushes, stats.nonfinite_pushes) == (8, 2, 2)
    reference = _model(strategy, 2)
    _fit(reference, 4, [1])
    _assert_equal_weights(model, reference)
