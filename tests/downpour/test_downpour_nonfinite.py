"""Downpour's per-push non-finite guard (issue 10): no push with a NaN or inf
reaches a ps variable.

One worker and a fixed cycle of batches (finite ones and one with a NaN
feature) make every run deterministic: a guarded run must equal a run over
the finite pushes alone, bit for bit. The raise and skip tests run for a
tf_keras model (`fit.training.fit`) and a Keras 3 model (`keras3.fit`), the
same checks on each (`_Keras2`, `_Keras3`).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_distbelief as tfdb
from tests.fixtures.fit import _logistic_model
from tf_distbelief import downpour, hooks
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


def _model(strategy, n, **config):
    model = _logistic_model(strategy, FEATURES, CLASSES)
    with strategy.scope():
        downpour.install(model, downpour.DownpourConfig(n_fetch=n, n_push=n, **config))
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
        callbacks=[downpour.DownpourMetrics(hooks.of(model).state)],
        **kwargs,
    )
    return result, lines


def _weights(model):
    return [w.numpy() for w in model.trainable_weights]


def _assert_equal_weights(model, reference):
    for got, want in zip(_weights(model), _weights(reference)):
        np.testing.assert_array_equal(got, want)


class _Keras2:
    """The tf_keras model with `downpour.install` and `fit.training.fit`."""

    id = "tf_keras"
    names = r"logits/kernel/part_0:0, logits/kernel/part_1:0, logits/bias/part_0:0, "
    names += r"logits/bias/part_1:0"
    skipped_line = "nonfinite: 2 pushes skipped so far"

    @staticmethod
    def run(strategy, n, steps, pattern, **kwargs):
        """`(model, downpour, nonfinite_skipped, lines)` of a 1-epoch run;
        on an error, the error's `run` attribute holds `(model, downpour)`."""
        model = _model(strategy, n)
        try:
            result, lines = _fit(model, steps, pattern, **kwargs)
        except tfdb.NonFiniteError as error:
            error.run = (model, hooks.of(model).state)
            raise
        assert result.history[0]["nonfinite_pushes"] == result.nonfinite_skipped
        return model, hooks.of(model).state, result.nonfinite_skipped, lines

    weights = staticmethod(_weights)


class _Keras3:
    """The same model in Keras 3, and `keras3.fit(downpour=...)`."""

    id = "keras3"
    names = r"sequential\w*_logits_kernel/part_0:0, sequential\w*_logits_kernel/"
    names += r"part_1:0, sequential\w*_logits_bias/part_0:0, "
    names += r"sequential\w*_logits_bias/part_1:0"
    skipped_line = "nonfinite_skipped=2"

    @staticmethod
    def run(strategy, n, steps, pattern, **kwargs):
        import keras

        from tf_distbelief import keras3

        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(
                    CLASSES,
                    kernel_initializer=keras.initializers.GlorotUniform(0),
                    name="logits",
                ),
            ]
        )
        batches = [(X, Y) if good else (X_NAN, Y) for good in pattern]
        xs, ys = zip(*batches)
        lines = []
        try:
            history = keras3.fit(
                model,
                dataset=tf.data.Dataset.from_tensor_slices(
                    (np.stack(xs), np.stack(ys))
                ),
                strategy=strategy,
                epochs=1,
                steps_per_epoch=steps,
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=(),
                optimizer=keras3.Adagrad(0.5),
                downpour=downpour.DownpourConfig(n_fetch=n, n_push=n),
                verbose=1,
                print_fn=lines.append,
                **kwargs,
            )
        except tfdb.NonFiniteError as error:
            # The run's `Downpour` went with it; the model holds the ps values.
            error.run = (model, None)
            raise
        return model, history.downpour, history.nonfinite_skipped, lines

    @staticmethod
    def weights(model):
        return [np.asarray(v.numpy()) for v in model.trainable_variables]


KERAS = pytest.mark.parametrize("k", [_Keras2, _Keras3], ids=lambda k: k.id)


@KERAS
def test_raise_stops_at_the_push_and_no_nan_reaches_the_ps(strategy, k):
    with pytest.raises(
        tfdb.NonFiniteError,
        match=r"Non-finite push \(NaN or inf\) from worker 0 at its step 3 for "
        + k.names
        + r": the push was not applied",
    ) as raised:
        k.run(strategy, 1, 6, [1, 1, 0])
    assert raised.value.step == 3
    model, state = raised.value.run
    if state is not None:
        assert int(state.update_count.numpy()) == 2
        assert int(state.optimizer.iterations.numpy()) == 2
        # The coordinator may run queued steps before it sees the error: the
        # halt refuses their pushes (`push_guard`, "Halt").
        assert int(state.halted.numpy()) == 1
    reference, _, _, _ = k.run(strategy, 1, 2, [1])
    for got, want in zip(k.weights(model), k.weights(reference)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n", [2, 3])
def test_raise_stops_a_compressed_push_with_update_stream_fetches(strategy, n):
    """With the outer rule and compression the push runs in called branches
    and under the stream's lock; the failure still reaches the user, named,
    and the ps keep the pushes before it."""
    model = _model(
        strategy,
        n,
        outer_learning_rate=0.35,
        outer_momentum=0.9,
        top_k_fraction=0.5,
        quantize_bits=2,
    )
    with pytest.raises(
        tfdb.NonFiniteError,
        match=rf"Non-finite push \(NaN or inf\) from worker 0 at its step {2 * n} ",
    ) as raised:
        _fit(model, 8, [1] * n + [0] * n)
    assert raised.value.step == 2 * n
    state = hooks.of(model).state
    assert int(state.update_count.numpy()) == 1
    assert int(state.halted.numpy()) == 1
    for w in _weights(model):
        assert np.all(np.isfinite(w))


@pytest.mark.parametrize("n", [1, 2])
def test_the_next_fit_after_a_raise_pushes_again(strategy, n):
    """The halt set by a refused push lasts until the next fit, and the
    replica that refused it is ready for that fit (its sums restarted, its
    cache refetched): clean data then trains, 2 more pushes."""
    model = _model(strategy, n)
    with pytest.raises(tfdb.NonFiniteError):
        _fit(model, 4 * n, [1] * n + [0] * n)
    state = hooks.of(model).state
    assert (int(state.halted.numpy()), int(state.update_count.numpy())) == (1, 1)
    _fit(model, 2 * n, [1])
    assert (int(state.halted.numpy()), int(state.update_count.numpy())) == (0, 3)


@KERAS
def test_skip_drops_and_counts_the_pushes(strategy, k):
    model, state, skipped, lines = k.run(strategy, 1, 6, [1, 1, 0], nonfinite="skip")
    assert skipped == 2
    assert k.skipped_line in " ".join(lines)
    (stats,) = state.stats()
    assert (stats.steps, stats.pushes, stats.nonfinite_pushes) == (6, 4, 2)
    assert int(state.optimizer.iterations.numpy()) == 4
    reference, _, _, _ = k.run(strategy, 1, 4, [1])
    for got, want in zip(k.weights(model), k.weights(reference)):
        np.testing.assert_array_equal(got, want)


def test_skip_restarts_the_replica_from_its_last_push(strategy):
    """n_fetch = n_push = 2 with a local AdaGrad step: the NaN of step 1 spoils
    the cache, the sums to push and the local accumulator; after the dropped
    push each is back where the last push left it, so 8 steps with a NaN in
    every other push equal 4 finite steps exactly."""
    model = _model(strategy, 2)
    result, _ = _fit(model, 8, [1, 0, 1, 1], nonfinite="skip")
    assert result.nonfinite_skipped == 2
    (stats,) = hooks.of(model).state.stats()
    assert (stats.steps, stats.pushes, stats.nonfinite_pushes) == (8, 2, 2)
    reference = _model(strategy, 2)
    _fit(reference, 4, [1])
    _assert_equal_weights(model, reference)
