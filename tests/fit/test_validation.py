"""Exact validation on the coordinator (`validation.ExactValidation`) under fit."""

import glob

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import digits
from tf_distbelief.fit import training, validation

L2 = 1e-3
NUM_VAL = 96


def _value(variable):
    """A variable's whole value, its shards joined (NumPy)."""
    shards = getattr(variable, "variables", None)
    if shards:
        return np.concatenate([s.numpy() for s in shards], axis=0)
    return variable.numpy()


def _reference(model, x, y):
    """NumPy: mean cross-entropy over every example + the L2 penalty, accuracy."""
    first, second = model.layers
    w1, b1, w2, b2 = (
        _value(v).astype(np.float64)
        for v in (first.kernel, first.bias, second.kernel, second.bias)
    )
    h = np.maximum(x.astype(np.float64) @ w1 + b1, 0.0)
    logits = h @ w2 + b2
    top = logits.max(axis=1, keepdims=True)
    log_z = top[:, 0] + np.log(np.exp(logits - top).sum(axis=1))
    ce = log_z - logits[np.arange(len(y)), y]
    loss = ce.mean() + L2 * np.sum(w1**2)
    return loss, float(np.mean(logits.argmax(axis=1) == y))


def _model(local_cluster, learning_rate):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=2, num_ps=2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.layers.InputLayer(input_shape=(64,)),
                tf_keras.layers.Dense(
                    32,
                    activation="relu",
                    kernel_regularizer=tf_keras.regularizers.L2(L2),
                    kernel_initializer=tf_keras.initializers.GlorotUniform(seed=1),
                ),
                tf_keras.layers.Dense(
                    10, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=2)
                ),
            ]
        )
        model.compile(
            tf_keras.optimizers.SGD(learning_rate),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=5,
        )
    assert len(model.layers[0].kernel.variables) == 2  # Sharded over 2 ps.
    return model


class _Reference(tf_keras.callbacks.Callback):
    """At each epoch end: the NumPy figures, what the logs say, the lr."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.rows = []

    def on_epoch_end(self, epoch, logs=None):
        loss, acc = _reference(self.model, self.x, self.y)
        lr = float(tf_keras.backend.get_value(self.model.optimizer.learning_rate))
        self.rows.append(dict(logs, ref_loss=loss, ref_acc=acc, lr_now=lr))


@pytest.fixture(scope="module")
def data():
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    return (x_train, y_train), (x_test[:NUM_VAL], y_test[:NUM_VAL])


@pytest.mark.slow
def test_val_loss_is_exact_and_reaches_callbacks(local_cluster, data, tmp_path):
    (x_train, y_train), (x_val, y_val) = data
    model = _model(local_cluster, 0.1)
    reference = _Reference(x_val, y_val)
    # 96 examples in batches of 40: the last batch is short (16).
    val = tf.data.Dataset.from_tensor_slices((x_val, y_val)).batch(40)
    result = training.fit(
        model,
        training.dataset_creator(x_train, y_train, 32),
        epochs=4,
        steps_per_epoch=20,
        batch_size=32,
        model_dir=str(tmp_path),
        callbacks=[reference],
        print_fn=lambda line: None,
        validation_data=val,
        validation_freq=2,
    )
    history = model.history.history
    # Validated after epochs 2 and 4 only (validation_freq=2).
    assert len(history["val_loss"]) == 2
    assert ["val_loss" in row for row in reference.rows] == [False, True, False, True]
    checked = [row for row in reference.rows if "val_loss" in row]
    for row, val_loss, val_acc in zip(
        checked, history["val_loss"], history["val_accuracy"]
    ):
        assert abs(row["val_loss"] - row["ref_loss"]) <= 1e-6, row
        assert abs(val_loss - row["ref_loss"]) <= 1e-6
        assert val_acc == pytest.approx(row["ref_acc"], abs=1e-7)
    assert [r["val_loss"] for r in result.history if "val_loss" in r] == pytest.approx(
        history["val_loss"], abs=0
    )
    # The same figures as arrays, after training (the weights are final).
    exact = validation.ExactValidation((x_val, y_val), batch_size=40)
    exact.set_model(model)
    with model.distribute_strategy.scope():  # As inside `fit`.
        arrays = exact.evaluate()
    final_loss, final_acc = _reference(model, x_val, y_val)
    assert abs(arrays["loss"] - final_loss) <= 1e-6
    assert arrays["accuracy"] == pytest.approx(final_acc, abs=1e-7)
    # TensorBoard (training.Progress) got the val_ scalars.
    tags = set()
    for path in glob.glob(str(tmp_path / "tensorboard" / "events.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags.update(v.tag for v in event.summary.value)
    assert {"epoch/val_loss", "epoch/val_accuracy", "epoch/loss"} <= tags


@pytest.mark.slow
def test_reduce_lr_on_plateau_acts_on_the_exact_val_loss(local_cluster, data):
    (x_train, y_train), (x_val, y_val) = data
    model = _model(local_cluster, 0.2)
    min_delta, factor = 0.2, 0.5
    plateau = tf_keras.callbacks.ReduceLROnPlateau(
        "val_loss", factor=factor, patience=1, min_delta=min_delta, verbose=0
    )
    reference = _Reference(x_val, y_val)
    training.fit(
        model,
        training.dataset_creator(x_train, y_train, 32),
        epochs=6,
        steps_per_epoch=15,
        batch_size=32,
        callbacks=[plateau, reference],
        print_fn=lambda line: None,
        validation_data=(x_val, y_val),
    )
    # Keras's rule (patience 1, no cooldown), replayed on the NumPy figures:
    # the rate halves after an epoch whose loss is not below best - min_delta.
    best, lr, expected = np.inf, 0.2, []
    for row in reference.rows:
        assert abs(row["val_loss"] - row["ref_loss"]) <= 1e-6
        if row["ref_loss"] < best - min_delta:
            best = row["ref_loss"]
        else:
            lr *= factor
        expected.append(lr)
    assert [r["lr_now"] for r in reference.rows] == pytest.approx(expected, rel=1e-6)
    # The case holds both outcomes (val_loss about 1.71, 1.17, 0.85, 0.70, ...:
    # improvements of 0.54, 0.31, then under min_delta as the rate falls).
    assert 0.2 > expected[-1] and expected[1] == 0.2, expected


def test_an_infinite_validation_dataset_needs_validation_steps():
    ds = tf.data.Dataset.from_tensor_slices(([[1.0]], [0])).batch(1).repeat()
    with pytest.raises(
        validation.InfiniteValidationDataError,
        match=r"infinite dataset .* `validation_steps` is None",
    ):
        validation.ExactValidation(ds)
    assert validation.ExactValidation(ds, validation_steps=3).validation_steps == 3
    with pytest.raises(ValueError, match=r"`validation_freq` must be an int >= 1"):
        validation.ExactValidation(ds, validation_freq=0, validation_steps=3)
    with pytest.raises(ValueError, match=r"`validation_steps` must be an int >= 1"):
        validation.ExactValidation(ds, validation_steps=0)
    with pytest.raises(ValueError, match=r"`validation_data` must be a finite"):
        validation.ExactValidation("data.csv")
    with pytest.raises(ValueError, match=r"`timeout_secs` must be > 0"):
        validation.ExactValidation(ds, validation_steps=3, timeout_secs=0)


def test_exact_validation_without_a_cluster_matches_evaluate():
    (_, _), (x, y) = digits.load_data()
    model = digits.build_model()
    model.compile(
        "sgd",
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    exact = validation.ExactValidation((x, y), batch_size=64)
    exact.set_model(model)
    expected = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    assert exact.evaluate() == pytest.approx(expected, abs=1e-7)
