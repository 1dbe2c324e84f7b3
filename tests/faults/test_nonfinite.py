"""The non-finite guard (issue 10): no NaN or inf on the ps or in a checkpoint.

One worker and a fixed cycle of batches (two finite, one with a NaN feature)
make every run deterministic: the guarded run must equal a run over the
finite batches alone, bit for bit.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_distbelief as tfdb
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.faults import nonfinite
from tf_distbelief.fit import training

FEATURES, CLASSES, BATCH = 4, 3, 8
X = np.linspace(-1.0, 1.0, BATCH * FEATURES, dtype=np.float32).reshape(BATCH, -1)
Y = np.arange(BATCH, dtype=np.int64) % CLASSES
X_NAN = X.copy()
X_NAN[2, 1] = np.nan


def _model(strategy):
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


def test_raise_stops_at_the_step_and_no_nan_reaches_the_ps(strategy, tmp_path):
    model = _model(strategy)
    with pytest.raises(
        tfdb.NonFiniteError,
        match=r"Non-finite gradient \(NaN or inf\) at step 3 for "
        r"logits/kernel/part_0:0, logits/kernel/part_1:0, logits/bias/part_0:0, "
        r"logits/bias/part_1:0: the step was not applied",
    ) as raised:
        _fit(model, 6, 3, model_dir=str(tmp_path), checkpoint_every_steps=1)
    assert raised.value.step == 3
    assert model.optimizer.iterations.numpy() == 2
    reference = _model(strategy)
    _fit(reference, 2, 0)
    for got, want in zip(_weights(model), _weights(reference)):
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


def test_skip_skips_and_counts_the_steps(strategy):
    model = _model(strategy)
    result, lines = _fit(model, 6, 3, nonfinite="skip")
    assert result.nonfinite_skipped == 2
    assert model.optimizer.iterations.numpy() == 4
    assert "nonfinite: 2 steps skipped so far" in " ".join(lines)
    assert result.history[0]["nonfinite_skipped"] == 2
    reference = _model(strategy)
    _fit(reference, 4, 0)
    for got, want in zip(_weights(model), _weights(reference)):
        np.testing.assert_array_equal(got, want)


def test_a_checkpoint_with_a_nan_is_refused(strategy, tmp_path):
    model = _model(strategy)
    kernel = model.get_layer("logits").kernel
    kernel.assign(tf.fill(kernel.shape, np.float32(np.nan)))
    # Every step is skipped (NaN weights give NaN gradients); the epoch-end
    # checkpoint would hold the NaN kernel.
    with pytest.raises(
        tfdb.NonFiniteError,
        match=r"Refusing to write a checkpoint at step 2: logits/kernel/part_0:0, "
        r"logits/kernel/part_1:0 hold NaN or inf\. Nothing was written",
    ):
        _fit(model, 2, 0, nonfinite="skip", model_dir=str(tmp_path))
    assert not os.path.exists(tmp_path / "checkpoints" / "checkpoint")


def test_nonfinite_variables_names_only_the_nonfinite_ones(strategy):
    with strategy.scope():
        finite = tf.Variable(tf.ones([4, 2]), name="finite")
        inf = tf.Variable([1.0, np.inf], name="inf")
        count = tf.Variable(3, name="count")
    assert nonfinite.nonfinite_variables([finite, inf, count]) == ["inf:0"]
