"""The non-finite guard (issue 10): no NaN or inf on the ps or in a checkpoint.

One worker and a fixed cycle of batches (two finite, one with a NaN feature)
make every run deterministic: the guarded run must equal a run over the
finite batches alone, bit for bit. The guard's tests run for a tf_keras model
(`fit.training.fit`) and a Keras 3 model (`keras3.fit`), the same checks on
each (`_Keras2`, `_Keras3`).
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_distbelief as tfdb
from tests.fixtures.fit import _logistic_model
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.faults import nonfinite
from tf_distbelief.fit import training

FEATURES, CLASSES, BATCH = 4, 3, 8
X = np.linspace(-1.0, 1.0, BATCH * FEATURES, dtype=np.float32).reshape(BATCH, -1)
Y = np.arange(BATCH, dtype=np.int64) % CLASSES
X_NAN = X.copy()
X_NAN[2, 1] = np.nan


def _model(strategy):
    model = _logistic_model(strategy, FEATURES, CLASSES)
    return model


def _data(nan_every):
    """Batch `X` repeated, every `nan_every`-th one `X_NAN` (0: never)."""

    def dataset_fn(_):
        good = tf.data.Dataset.from_tensors((X, Y))
        if not nan_every:
            return good.repeat()
        bad = tf.data.Dataset.from_tensors((X_NAN, Y))
        return good.repeat(nan_every - 1).concatenate(bad).repeat()

    return tf_keras.utils.experimental.DatasetCreator(dataset_fn)


@pytest.fixture(scope="module")
def strategy(local_cluster):
    return strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(1, 2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )


def _fit(model, steps, nan_every, **kwargs):
    lines = []
    result = training.fit(
        model,
        _data(nan_every),
        epochs=1,
        steps_per_epoch=steps,
        batch_size=BATCH,
        print_fn=lines.append,
        **kwargs,
    )
    return result, lines


def _weights(model):
    return [w.numpy() for w in model.weights]


class _Keras2:
    """The tf_keras model and `fit.training.fit`."""

    id = "tf_keras"
    # What `raise` says at the third step, and the step it names.
    raised = (
        r"Non-finite gradient \(NaN or inf\) at step 3 for "
        r"logits/kernel/part_0:0, logits/kernel/part_1:0, logits/bias/part_0:0, "
        r"logits/bias/part_1:0: the step was not applied"
    )
    raised_step = 3
    skipped_line = "nonfinite: 2 steps skipped so far"
    refused = r"logits/kernel/part_0:0, logits/kernel/part_1:0 hold NaN or inf"

    model = staticmethod(_model)

    @staticmethod
    def fit(model, steps, nan_every, **kwargs):
        """`(nonfinite_skipped, the epoch's logs, lines)` of a 1-epoch run."""
        result, lines = _fit(model, steps, nan_every, **kwargs)
        return result.nonfinite_skipped, result.history[0], lines

    @staticmethod
    def iterations(model):
        return model.optimizer.iterations.numpy()

    @staticmethod
    def weights(model):
        return _weights(model)

    @staticmethod
    def set_nan_kernel(model):
        kernel = model.get_layer("logits").kernel
        kernel.assign(tf.fill(kernel.shape, np.float32(np.nan)))


class _Keras3:
    """The same model in Keras 3, and `keras3.fit` with the same settings."""

    id = "keras3"
    # Keras 3's steps keep no global count on the worker: the weight is named.
    raised = r"a step's gradient of weight `sequential\w*/logits/kernel` held NaN"
    raised_step = None
    skipped_line = "nonfinite_skipped=2"
    refused = r"sequential\w*_logits_kernel:0 hold NaN or inf"

    @staticmethod
    def model(strategy):
        import keras

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
        return model, strategy

    @staticmethod
    def fit(model, steps, nan_every, **kwargs):
        import keras

        from tf_distbelief import keras3

        model, strategy = model
        good = tf.data.Dataset.from_tensors((X, Y))
        data = good
        if nan_every:  # `keras3.fit` repeats it.
            bad = tf.data.Dataset.from_tensors((X_NAN, Y))
            data = good.repeat(nan_every - 1).concatenate(bad)
        lines = []
        history = keras3.fit(
            model,
            dataset=data,
            strategy=strategy,
            epochs=1,
            steps_per_epoch=steps,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=(),
            optimizer=keras3.Adagrad(0.5),
            verbose=1,
            print_fn=lines.append,
            **kwargs,
        )
        logs = {k: v[0] for k, v in history.history.items()}
        return history.nonfinite_skipped, logs, lines

    @staticmethod
    def iterations(model):
        return None  # Keras 3's AdaGrad on the ps keeps no iteration count.

    @staticmethod
    def weights(model):
        return [np.asarray(v.numpy()) for v in model[0].weights]

    @staticmethod
    def set_nan_kernel(model):
        kernel = model[0].get_layer("logits").kernel
        kernel.assign(np.full(kernel.shape, np.nan, np.float32))


KERAS = pytest.mark.parametrize("k", [_Keras2, _Keras3], ids=lambda k: k.id)


@KERAS
def test_raise_stops_at_the_step_and_no_nan_reaches_the_ps(strategy, tmp_path, k):
    model = k.model(strategy)
    with pytest.raises(tfdb.NonFiniteError, match=k.raised) as raised:
        k.fit(model, 6, 3, model_dir=str(tmp_path), checkpoint_every_steps=1)
    assert raised.value.step == k.raised_step
    if k.iterations(model) is not None:
        assert k.iterations(model) == 2
    reference = k.model(strategy)
    k.fit(reference, 2, 0)
    for got, want in zip(k.weights(model), k.weights(reference)):
        np.testing.assert_array_equal(got, want)
    # Checkpoints of steps 1 and 2, all finite; none of step 3.
    names = sorted(os.listdir(tmp_path / "checkpoints"))
    assert [n for n in names if n.endswith(".index")] == [
        "ckpt-1.index",
        "ckpt-2.index",
    ]
    for step in (1, 2):
        reader = tf.train.load_checkpoint(
            str(tmp_path / "checkpoints" / f"ckpt-{step}")
        )
        for key in reader.get_variable_to_shape_map():
            value = reader.get_tensor(key)
            if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                assert np.isfinite(value).all(), key


@KERAS
def test_skip_skips_and_counts_the_steps(strategy, k):
    model = k.model(strategy)
    skipped, logs, lines = k.fit(model, 6, 3, nonfinite="skip")
    assert skipped == 2
    if k.iterations(model) is not None:
        assert k.iterations(model) == 4
    assert k.skipped_line in " ".join(lines)
    assert logs["nonfinite_skipped"] == 2
    reference = k.model(strategy)
    k.fit(reference, 4, 0)
    for got, want in zip(k.weights(model), k.weights(reference)):
        np.testing.assert_array_equal(got, want)


@KERAS
def test_a_checkpoint_with_a_nan_is_refused(strategy, tmp_path, k):
    model = k.model(strategy)
    k.set_nan_kernel(model)
    # Every step is skipped (NaN weights give NaN gradients); the epoch-end
    # checkpoint would hold the NaN kernel.
    with pytest.raises(
        tfdb.NonFiniteError,
        match=r"Refusing to write a checkpoint at step 2: "
        + k.refused
        + r"\. Nothing was written",
    ):
        k.fit(model, 2, 0, nonfinite="skip", model_dir=str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint")


def test_nonfinite_variables_names_only_the_nonfinite_ones(strategy):
    with strategy.scope():
        finite = tf.Variable(tf.ones([4, 2]), name="finite")
        inf = tf.Variable([1.0, np.inf], name="inf")
        count = tf.Variable(3, name="count")
    assert nonfinite.nonfinite_variables([finite, inf, count]) == ["inf:0"]
