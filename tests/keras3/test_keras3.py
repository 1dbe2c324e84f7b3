"""Keras 3 models trained on the ps (issue 13): `tf_distbelief.keras3`."""

import os
import re
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.launch import ROOT
from tf_distbelief import demos, job, keras3
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.adagrad import rule
from tf_distbelief.demos import digits
from tf_distbelief.keras3 import job as keras3_job
from tf_distbelief.keras3 import variables as variables_lib

FIXED2 = tf.distribute.experimental.partitioners.FixedShardsPartitioner(2)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def test_keras3_and_tf_keras_import_in_one_process():
    import tf_keras

    assert keras.__version__.startswith("3.")
    assert keras.backend.backend() == "tensorflow"
    assert tf_keras.__version__.startswith("2.")
    assert not isinstance(digits.build_keras3_model(), tf_keras.Model)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"learning_rate": 0.0}, r"`learning_rate` must be a finite number > 0"),
        ({"epsilon": -1.0}, r"`epsilon` must be a finite number >= 0"),
        (
            {"initial_accumulator_value": float("inf")},
            r"`initial_accumulator_value` must be a finite number >= 0",
        ),
    ],
)
def test_adagrad_rejects_bad_hyperparameters(kwargs, match):
    with pytest.raises(ValueError, match=match):
        keras3.Adagrad(**kwargs)


def test_optimizers_map_to_their_ps_rule_or_are_refused_by_name():
    import tf_distbelief as tfdb
    from tf_distbelief.keras3 import optimizer as optimizer_lib

    from_optimizer = optimizer_lib.from_optimizer
    got = from_optimizer(tfdb.adagrad.Adagrad(0.25, 0.5, epsilon=1e-3))
    assert got == keras3.Adagrad(0.25, 0.5, 1e-3)
    assert from_optimizer(None) == from_optimizer("adagrad") == keras3.Adagrad()
    assert from_optimizer("sgd") == keras3.SGD()
    # Keras 3's SGD keeps its learning rate as a float32.
    got = from_optimizer(keras.optimizers.SGD(0.25, momentum=0.9, nesterov=True))
    assert got == keras3.SGD(0.25, 0.9, True)
    assert from_optimizer(keras.optimizers.SGD(0.5)) == keras3.SGD(0.5)
    with pytest.raises(ValueError, match=r"`optimizer` must be None, 'adagrad'.*Adam"):
        from_optimizer(keras.optimizers.Adam())
    with pytest.raises(ValueError, match=r"`optimizer` must be None.*Adagrad"):
        from_optimizer(keras.optimizers.Adagrad())  # epsilon inside the sqrt
    with pytest.raises(ValueError, match=r"SGD` with `clipnorm`.*clipnorm=1.0"):
        from_optimizer(keras.optimizers.SGD(0.1, clipnorm=1.0))
    assert from_optimizer(keras.optimizers.SGD(0.5, weight_decay=0.0)) == keras3.SGD(
        0.5
    )
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)
    with pytest.raises(ValueError, match=r"learning-rate schedule is not applied"):
        from_optimizer(keras.optimizers.SGD(schedule))
    with pytest.raises(ValueError, match=r"`momentum` must be a finite number >= 0"):
        keras3.SGD(0.1, momentum=1.5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"epochs": 0}, r"`epochs` must be an int >= 1. Received: 0"),
        ({"steps_per_epoch": 2.5}, r"`steps_per_epoch` must be an int >= 1"),
        ({"y": np.zeros(3)}, r"one label per example. Received: 4 examples and 3"),
        ({"x": None, "y": None}, r"either `x` and `y`"),
    ],
)
def test_fit_rejects_bad_arguments_before_any_variable(kwargs, match):
    args = {"x": np.zeros((4, 64), np.float32), "y": np.zeros(4, np.int64)}
    args.update(kwargs)
    args.setdefault("steps_per_epoch", 1)
    with pytest.raises(ValueError, match=match):
        keras3.fit(digits.build_keras3_model(), strategy=None, **args)


def test_fit_rejects_a_tf_keras_model():
    with pytest.raises(TypeError, match=r"`model` must be a Keras 3 `keras.Model`"):
        keras3.fit(
            digits.build_model(),
            np.zeros((4, 64)),
            np.zeros(4),
            strategy=None,
            steps_per_epoch=1,
        )


def _softmax_regression(seed=3):
    return keras.Sequential(
        [
            keras.Input(shape=(6,)),
            keras.layers.Dense(
                4,
                kernel_initializer=keras.initializers.GlorotUniform(seed),
                bias_initializer=keras.initializers.RandomNormal(seed=seed),
            ),
        ]
    )


def _numpy_steps(w, b, x, y, opt, steps):
    """AdaGrad on softmax regression in float64 NumPy (the independent reference)."""
    acc_w = np.full_like(w, opt.initial_accumulator_value)
    acc_b = np.full_like(b, opt.initial_accumulator_value)
    for _ in range(steps):
        logits = x @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        gw, gb = x.T @ p / len(y), p.mean(0)
        w, acc_w = rule.adagrad_update(w, acc_w, gw, opt.learning_rate, opt.epsilon)
        b, acc_b = rule.adagrad_update(b, acc_b, gb, opt.learning_rate, opt.epsilon)
    return w, b, acc_w, acc_b


@pytest.mark.slow
def test_ps_adagrad_matches_the_numpy_reference_and_shards(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 2), FIXED2)
    model = _softmax_regression()
    w0, b0 = (np.asarray(v.numpy(), np.float64) for v in model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 4, size=8)
    opt = keras3.Adagrad(0.3, initial_accumulator_value=0.2, epsilon=1e-3)
    # One full batch per step, one step per epoch: the 3 steps run in order.
    data = tf.data.Dataset.from_tensors((x, y))
    history = keras3.fit(
        model,
        dataset=data,
        strategy=strategy,
        epochs=3,
        steps_per_epoch=1,
        loss=LOSS,
        optimizer=opt,
    )
    weights = history.ps_weights
    for variable, slots in zip(weights.trainable, weights.accumulators):
        shards = variables_lib.shards_of(variable)
        devices = [s.device for s in shards]
        assert len(set(devices)) == 2 and all("/job:ps/" in d for d in devices)
        assert devices == [a.device for a in slots]
    w, b, acc_w, acc_b = _numpy_steps(w0, b0, x.astype(np.float64), y, opt, 3)
    got_w, got_b = (v.numpy() for v in model.trainable_variables)
    np.testing.assert_allclose(got_w, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, b, rtol=1e-5, atol=1e-6)
    got = [np.concatenate([a.numpy() for a in slots]) for slots in weights.accumulators]
    np.testing.assert_allclose(got[0], acc_w, rtol=1e-5)
    np.testing.assert_allclose(got[1], acc_b, rtol=1e-5)

    # Training on: the same ps variables and accumulators. A batch with NaN is
    # refused before any ps variable changes.
    before = weights.numpy()
    bad = tf.data.Dataset.from_tensors((np.full_like(x, np.nan), y))
    with pytest.raises(
        FloatingPointError,
        match=r"Epoch 1: a step's gradient of weight "
        r"`sequential\w*/dense\w*/kernel` held NaN or inf",
    ):
        keras3.fit(
            model,
            dataset=bad,
            strategy=strategy,
            steps_per_epoch=1,
            loss=LOSS,
            optimizer=opt,
            ps_weights=weights,
        )
    after = weights.numpy()
    for old, new in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(old, new)
    keras3.fit(
        model,
        dataset=data,
        strategy=strategy,
        steps_per_epoch=1,
        loss=LOSS,
        optimizer=opt,
        ps_weights=weights,
    )
    w, b, _, _ = _numpy_steps(w0, b0, x.astype(np.float64), y, opt, 4)
    np.testing.assert_allclose(
        model.trainable_variables[0].numpy(), w, rtol=1e-5, atol=1e-6
    )


def _numpy_sgd_steps(w, b, x, y, opt, steps):
    """Keras 3's SGD rule on softmax regression in float64 NumPy."""
    m_w, m_b = np.zeros_like(w), np.zeros_like(b)
    lr, beta = opt.learning_rate, opt.momentum
    for _ in range(steps):
        logits = x @ w + b
        p = np.exp(logits - logits.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1.0
        gw, gb = x.T @ p / len(y), p.mean(0)
        if not beta:
            w, b = w - lr * gw, b - lr * gb
            continue
        m_w, m_b = beta * m_w - lr * gw, beta * m_b - lr * gb
        if opt.nesterov:
            w, b = w + beta * m_w - lr * gw, b + beta * m_b - lr * gb
        else:
            w, b = w + m_w, b + m_b
    return w, b, m_w, m_b


@pytest.mark.parametrize(
    "sgd",
    [{}, {"momentum": 0.8}, {"momentum": 0.8, "nesterov": True}],
    ids=["plain", "momentum", "nesterov"],
)
def test_ps_sgd_matches_the_numpy_reference_and_shards(local_cluster, sgd):
    """A `keras.optimizers.SGD` runs on the ps shards, as Keras 3 writes it."""
    from tf_distbelief.keras3 import optimizer as optimizer_lib

    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 2), FIXED2)
    # After connecting, which resets the eager context (and the optimizer's
    # own variables with it).
    opt = keras.optimizers.SGD(0.3, **sgd)
    model = _softmax_regression()
    w0, b0 = (np.asarray(v.numpy(), np.float64) for v in model.trainable_variables)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 4, size=8)
    history = keras3.fit(
        model,
        dataset=tf.data.Dataset.from_tensors((x, y)),
        strategy=strategy,
        epochs=4,
        steps_per_epoch=1,
        loss=LOSS,
        optimizer=opt,
    )
    rule = optimizer_lib.from_optimizer(opt)
    weights = history.ps_weights
    w, b, m_w, m_b = _numpy_sgd_steps(w0, b0, x.astype(np.float64), y, rule, 4)
    got_w, got_b = (v.numpy() for v in model.trainable_variables)
    np.testing.assert_allclose(got_w, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_b, b, rtol=1e-5, atol=1e-6)
    assert history.applied_steps == 4
    if not rule.momentum:
        assert weights.accumulators == []
        return
    for variable, slots in zip(weights.trainable, weights.accumulators):
        devices = [s.device for s in variables_lib.shards_of(variable)]
        assert len(set(devices)) == 2 and devices == [m.device for m in slots]
    got = [np.concatenate([m.numpy() for m in slots]) for slots in weights.accumulators]
    np.testing.assert_allclose(got[0], m_w, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got[1], m_b, rtol=1e-5, atol=1e-7)
    # Training on with AdaGrad would read the momentums as accumulators.
    with pytest.raises(ValueError, match=r"`ps_weights` holds momentums.*Adagrad"):
        keras3.fit(
            model,
            dataset=tf.data.Dataset.from_tensors((x, y)),
            strategy=strategy,
            steps_per_epoch=1,
            loss=LOSS,
            optimizer=keras3.Adagrad(),
            ps_weights=weights,
        )


class _EpochLogs(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.logs = []
        self.ended = False

    def on_epoch_end(self, epoch, logs=None):
        # The model holds the epoch's trained weights when callbacks run.
        kernel = self.model.trainable_variables[0].numpy()
        self.logs.append((epoch, dict(logs), kernel.copy()))

    def on_train_end(self, logs=None):
        self.ended = True


_LOAD_AND_PREDICT = """
import sys, numpy as np, keras
assert "TF_CONFIG" not in __import__("os").environ
model = keras.models.load_model(sys.argv[1])
np.save(sys.argv[3], model.predict(np.load(sys.argv[2]), batch_size=128, verbose=0))
"""


@pytest.mark.slow
def test_digits_trains_to_95_percent_and_saves_as_keras(local_cluster, tmp_path):
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 2), FIXED2)
    model = digits.build_keras3_model(seed=0)
    initial = model.trainable_variables[0].numpy().copy()
    epoch_logs = _EpochLogs()
    history = keras3.fit(
        model,
        x_train,
        y_train,
        strategy=strategy,
        epochs=5,
        steps_per_epoch=100,
        batch_size=32,
        loss=LOSS,
        metrics=["accuracy"],
        callbacks=[epoch_logs],
        validation_data=(x_test, y_test),
    )
    assert isinstance(history, keras.callbacks.History)
    assert history.epoch == [0, 1, 2, 3, 4]
    assert set(history.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert [e for e, _, _ in epoch_logs.logs] == history.epoch and epoch_logs.ended
    assert epoch_logs.logs[-1][1] == {k: v[-1] for k, v in history.history.items()}
    assert not np.array_equal(epoch_logs.logs[0][2], initial)
    assert history.history["loss"][-1] < history.history["loss"][0]
    # Every weight on both ps tasks, two shards each.
    for variable in history.ps_weights.trainable:
        assert len({s.device for s in variables_lib.shards_of(variable)}) == 2
    # The trained values are in the Keras 3 model's own variables.
    trained, _ = history.ps_weights.numpy()
    for variable, value in zip(model.trainable_variables, trained):
        np.testing.assert_array_equal(variable.numpy(), value)
    predictions = model.predict(x_test, batch_size=128, verbose=0)
    accuracy = float(np.mean(predictions.argmax(1) == y_test))
    assert accuracy >= 0.95, accuracy
    assert history.history["val_accuracy"][-1] == pytest.approx(accuracy, abs=1e-6)

    path = str(tmp_path / "digits.keras")
    model.save(path)
    np.save(tmp_path / "x.npy", x_test)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_AND_PREDICT,
            path,
            str(tmp_path / "x.npy"),
            str(tmp_path / "p.npy"),
        ],
        check=True,
        env=env,
        cwd=str(tmp_path),
        timeout=300,
    )
    np.testing.assert_array_equal(np.load(tmp_path / "p.npy"), predictions)


def test_training_imports_no_tf_keras():
    code = (
        "import sys, tf_distbelief.keras3 as k; k.fit, k.Adagrad, k.PsWeights; "
        "k.PartitionedDense, k.PartitionedLocallyConnected2D; "
        "assert 'tf_keras' not in sys.modules, 'tf_keras imported'"
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=300)


def test_keras3_job_refuses_what_it_lacks_before_any_server():
    config = job.JobConfig(optimizer="lbfgs")
    with pytest.raises(
        ValueError,
        match=r"`optimizer` must be 'adagrad' or 'sgd' with Keras 3.*'lbfgs'",
    ):
        keras3_job.check_config(config)


def test_keras3_job_splits_only_a_model_parallel_model():
    config = job.JobConfig(devices_per_replica=2)
    keras3_job.TRAINER.check(config, demos.spec("digits", keras=3))
    spec = job.ModelSpec(
        name="user_mlp",
        build_model=lambda devices: digits.build_keras3_model(),
        load_data=digits.load_data,
    )
    with pytest.raises(
        ValueError,
        match=r"`devices_per_replica` > 1 needs a model with a model-parallel "
        r"version .*Received: model='user_mlp'",
    ):
        keras3_job.TRAINER.check(config, spec)


def test_keras3_job_runs_whole_functions_in_an_epoch():
    from tf_distbelief import downpour

    def steps(**kwargs):
        return keras3_job._steps_per_execution(job.JobConfig(**kwargs))

    assert steps(steps_per_epoch=100, steps_per_execution=10) == 10
    assert steps(steps_per_epoch=25, steps_per_execution=10) == 5
    assert steps(steps_per_epoch=7, steps_per_execution=10) == 7
    assert steps(steps_per_epoch=13, steps_per_execution=10) == 1
    one = downpour.DownpourConfig(1, 4)
    assert steps(steps_per_epoch=100, steps_per_execution=10, downpour=one) == 1


def test_keras3_job_refuses_downpour_with_sgd_before_any_server():
    from tf_distbelief import downpour

    config = job.JobConfig(optimizer="sgd", downpour=downpour.DownpourConfig(4, 4))
    with pytest.raises(ValueError, match=r"'adagrad' with Keras 3 and `downpour`"):
        keras3_job.check_config(config)


def test_keras3_job_takes_downpour_checkpoints_and_nonfinite_skip():
    from tf_distbelief import downpour

    keras3_job.check_config(
        job.JobConfig(
            downpour=downpour.DownpourConfig(4, 4),
            model_dir="/tmp/model",
            checkpoint_every_steps=20,
            nonfinite="skip",
            export_dir="/tmp/export",
        )
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"checkpoint_every_steps": -1}, r"`checkpoint_every_steps` must be an int"),
        ({"checkpoint_every_steps": 5}, r"`checkpoint_every_steps` needs `model_dir`"),
        ({"nonfinite": "ignore"}, r"`nonfinite` must be one of raise, skip"),
        ({"log_every_steps": -5}, r"`log_every_steps` must be an int >= 0.*-5"),
        ({"initial_epoch": -1}, r"`initial_epoch` must be an int >= 0.*-1"),
        (
            {"validation_data": (np.zeros((3, 4)),)},
            r"`validation_data` must be `\(x_val, y_val\)`.*1 items",
        ),
        (
            {"validation_data": (np.zeros((3, 4)), np.zeros(2))},
            r"`validation_data` must be.*3 examples, 2 labels",
        ),
    ],
)
def test_fit_rejects_bad_reliability_arguments(kwargs, match):
    x, y = np.zeros((4, 64), np.float32), np.zeros(4, np.int64)
    with pytest.raises(ValueError, match=match):
        keras3.fit(
            digits.build_keras3_model(),
            x,
            y,
            strategy=None,
            steps_per_epoch=1,
            **kwargs,
        )


def test_nonfinite_modes_are_the_fault_layers():
    from tf_distbelief.faults import settings

    # `keras3.fit` takes the fault layer's modes, and refuses another one
    # with the fault layer's message listing them.
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Argument `nonfinite` must be one of "
            f"{', '.join(settings.NONFINITE_MODES)}. "
            "Received: 'neither'"
        ),
    ):
        keras3.fit(
            digits.build_keras3_model(),
            np.zeros((4, 64), np.float32),
            np.zeros(4, np.int64),
            strategy=None,
            steps_per_epoch=1,
            nonfinite="neither",
        )


def test_only_models_with_a_keras3_builder_take_keras_3():
    spec = demos.spec("digits", keras=3)
    assert isinstance(spec.build_model(None), keras.Model)
    with pytest.raises(ValueError, match=r"`model` must be one of digits with Keras 3"):
        demos.spec("speech", keras=3)


def test_tf_keras_and_keras_3_jobs_print_their_epochs_in_one_format(local_cluster):
    """The job's two trainers (`launch/train.py` and `--keras=3`): the same
    line, field for field (`fit.lines`)."""
    from tf_distbelief.faults import goodput

    line = re.compile(
        r"epoch (\d)/2: steps (\d+)/40 loss=\d+\.\d{4} accuracy=\d\.\d{4} "
        r"[\d,]+ examples/s, elapsed \d+s, ETA \d+s; goodput \d+\.\d%"
    )
    config = job.JobConfig(epochs=2, steps_per_epoch=20, log_every_steps=0)
    for keras_version, trainer in ((2, job.TF_KERAS), (3, keras3_job.TRAINER)):
        lines = []
        with goodput.active(goodput.Goodput()):
            trainer.train(
                config.validate(),
                demos.spec("digits", keras=keras_version),
                local_cluster.resolver_for(2, 1),
                lines.append,
            )
        epochs = [line.fullmatch(li) for li in lines if li.startswith("epoch")]
        assert all(epochs) and len(epochs) == 2, (keras_version, lines)
        assert [(m[1], m[2]) for m in epochs] == [("1", "20"), ("2", "40")]


def test_progress_lines_follow_the_finished_steps(local_cluster):
    """`log_every_steps`: lines read while the workers train, stock and
    Downpour in segments, one per multiple passed, on the global step axis."""
    from tf_distbelief import downpour

    (x_train, y_train), _ = digits.load_data()
    for config, spe in ((None, 1), (downpour.DownpourConfig(4, 4), 10)):
        strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 1))
        lines = []
        keras3.fit(
            digits.build_keras3_model(),
            x_train,
            y_train,
            strategy=strategy,
            epochs=2,
            steps_per_epoch=200,
            steps_per_execution=spe,
            loss=LOSS,
            metrics=(),
            downpour=config,
            log_every_steps=50,
            print_fn=lines.append,
        )
        steps = [
            int(m[1])
            for m in map(
                re.compile(r"step (\d+)/400: [\d,]+ examples/s, elapsed ").match, lines
            )
            if m
        ]
        assert steps and steps == sorted(steps) and steps[-1] <= 400, lines
        # At most one line per multiple of 50 passed.
        assert len({s // 50 for s in steps}) == len(steps), steps


@pytest.mark.slow
def _numpy_digits_eval(checkpoint, x, y):
    """(accuracy, mean cross-entropy) of the digits MLP whose weights are in
    `checkpoint`, by NumPy: the four values found by their shapes."""
    reader = tf.train.load_checkpoint(checkpoint)
    by_shape = {}
    for name, shape in reader.get_variable_to_shape_map().items():
        if name.startswith("model/") and name.endswith("VARIABLE_VALUE"):
            assert tuple(shape) not in by_shape, (name, shape)
            by_shape[tuple(shape)] = reader.get_tensor(name).astype(np.float64)
    hidden = np.maximum(x @ by_shape[(64, 64)] + by_shape[(64,)], 0.0)
    logits = hidden @ by_shape[(64, 10)] + by_shape[(10,)]
    shifted = logits - logits.max(1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(1, keepdims=True))
    loss = -np.mean(log_softmax[np.arange(len(y)), y])
    return float(np.mean(logits.argmax(1) == y)), float(loss)


def test_evaluator_evaluates_every_keras3_checkpoint(local_cluster, tmp_path):
    """The `evaluator` task of a Keras 3 job: each checkpoint in `model_dir`,
    in order, loaded into a model of its own (no cluster) and evaluated; each
    step's accuracy and loss are those of its checkpoint's weights (NumPy),
    the last one's the trained model's. (Not compared with each other: two
    async workers at AdaGrad 0.2 do not make each checkpoint better than the
    one before; 150 steps once scored 0.818 against 0.920 at 50.)"""
    from tests.fixtures.helpers import tensorboard_scalars
    from tf_distbelief import paths

    (x_train, y_train), (x_test, y_test) = digits.load_data()
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 2))
    model = digits.build_keras3_model()
    keras3.fit(
        model,
        x_train,
        y_train,
        strategy=strategy,
        epochs=3,
        steps_per_epoch=50,
        loss=LOSS,
        optimizer=keras3.Adagrad(0.2),
        model_dir=str(tmp_path),  # The last 3 checkpoints are kept.
    )
    lines = []
    config = job.JobConfig(model_dir=str(tmp_path), epochs=3, steps_per_epoch=50)
    results = keras3_job.evaluate_checkpoints(
        config, demos.spec("digits", keras=3), print_fn=lines.append
    )
    assert sorted(results) == [50, 100, 150]
    assert lines[-1] == "evaluator: done"
    for step in (50, 100, 150):
        assert any(
            re.match(rf"evaluator: \S+/ckpt-{step} \(step {step}\): accuracy=", li)
            for li in lines
        ), lines
    trained = float(np.mean(model.predict(x_test, verbose=0).argmax(1) == y_test))
    assert results[150]["accuracy"] == pytest.approx(trained, abs=1e-6)
    # Each step's figures are its own checkpoint's: a NumPy forward pass of
    # the weights read from that file gives the same accuracy and loss.
    checkpoints = paths.checkpoint_dir(str(tmp_path))
    for step in (50, 100, 150):
        accuracy, loss = _numpy_digits_eval(
            os.path.join(checkpoints, f"ckpt-{step}"), x_test, y_test
        )
        assert results[step]["accuracy"] == pytest.approx(accuracy, abs=1e-6), step
        assert results[step]["loss"] == pytest.approx(loss, rel=1e-5), step
    board = tensorboard_scalars(paths.eval_tensorboard_dir(str(tmp_path)))
    assert [s for s, _ in board["eval/accuracy"]] == [50, 100, 150]


# A plain process (no cluster, no `TF_CONFIG`, no tf_distbelief): the
# SavedModel's `serving_default` and `model.keras`, on the same batch.
_LOAD_EXPORT = """
import os, sys, numpy as np, tensorflow as tf, keras
assert "TF_CONFIG" not in os.environ
export_dir, x = sys.argv[1], np.load(sys.argv[2])
serve = tf.saved_model.load(os.path.join(export_dir, "saved_model"))
(served,) = serve.signatures["serving_default"](tf.constant(x)).values()
model = keras.models.load_model(os.path.join(export_dir, "model.keras"))
np.save(sys.argv[3], np.stack([served.numpy(), model(x, training=False).numpy()]))
assert "tf_distbelief" not in sys.modules
"""


@pytest.mark.slow
@pytest.mark.xdist_group("keras3_launch_ps0_killed")
def test_launch_keras_3_trains_digits_and_exports_for_serving(
    keras3_launch_ps0_killed, tmp_path
):
    """`conftest.keras3_launch_ps0_killed`: the job recovers from the loss of
    ps 0 (tests/faults/test_ps_recovery.py) and still trains to 0.95 and
    exports a SavedModel with `serving_default` and `model.keras`."""
    from tests.fixtures.launch import _accuracy

    code, output, stderr, export_dir = keras3_launch_ps0_killed
    assert code == 0, stderr[-3000:]
    assert re.search(
        r"^epoch 5/5: steps 500/500 loss=[0-9.]+ accuracy=[0-9.]+", output, re.M
    )
    assert _accuracy(output) >= 0.95
    assert re.search(
        rf"^exported: {export_dir}/saved_model {export_dir}/model.keras$",
        output,
        re.M,
    )
    _, (x_test, y_test) = digits.load_data()
    np.save(tmp_path / "x.npy", x_test)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    subprocess.run(
        [
            sys.executable,
            "-c",
            _LOAD_EXPORT,
            str(export_dir),
            str(tmp_path / "x.npy"),
            str(tmp_path / "p.npy"),
        ],
        check=True,
        env=env,
        cwd=str(tmp_path),
        timeout=300,
    )
    served, loaded = np.load(tmp_path / "p.npy")
    np.testing.assert_array_equal(served, loaded)
    # TensorBoard: the epoch scalars at each epoch end on the global step
    # axis (the run resumed at a checkpoint after the ps loss continues the
    # curves), and the job's goodput.
    from tests.fixtures.helpers import tensorboard_scalars
    from tf_distbelief import paths

    # Progress lines while the workers trained (--log_every_steps=100).
    step_line = r"^step (\d+)/500: [\d,]+ examples/s, "
    shown = [int(m) for m in re.findall(step_line, output, re.M)]
    assert shown and all(0 < m <= 500 for m in shown), output
    board = tensorboard_scalars(paths.tensorboard_dir(str(export_dir.parent / "model")))
    assert [s for s, _ in board["interval/examples_per_sec"]]
    loss_steps = [s for s, _ in board["epoch/loss"]]
    assert loss_steps[-1] == 500 and {100, 200, 300, 400, 500} <= set(loss_steps)
    assert [s for s, _ in board["epoch/accuracy"]] == loss_steps
    assert all(v > 0 for _, v in board["epoch/examples_per_sec"])
    assert [s for s, _ in board["goodput/percent"]][-1] == 500
    assert float(np.mean(served.argmax(1) == y_test)) == pytest.approx(
        _accuracy(output), abs=1e-4
    )


# --- Downpour ---------------------------------------------------------------


def _keras3_softmax_model(params):
    from tests.fixtures import downpour as tdp

    kernel, bias = params
    return keras.Sequential(
        [
            keras.Input(shape=(tdp.NUM_FEATURES,), dtype="float64"),
            keras.layers.Dense(
                tdp.NUM_CLASSES,
                dtype="float64",
                kernel_initializer=keras.initializers.Constant(kernel),
                bias_initializer=keras.initializers.Constant(bias),
            ),
        ]
    )


# Sparse fetches of top-k pushes (`push_rules.sparse_fetches`).
SPARSE = {"top_k_fraction": 0.25, "sparse_fetches": True}
# The outer rule (its stale pushes damped by default).
OUTER = {"outer_learning_rate": 0.7, "outer_momentum": 0.5}


@pytest.mark.slow
@pytest.mark.parametrize(
    "partitioner, local_optimizer, local_learning_rate, adagrad_accumulator, "
    "steps_per_execution, push_rules",
    [
        (None, "adagrad", None, "squares", 1, {}),
        (FIXED2, "sgd", 0.05, "mean", 1, {}),
        (None, "adagrad", None, "squares", 4, {}),
        (FIXED2, "sgd", 0.05, "mean", 6, {}),
        # Unsharded: top-k selects per shard, the reference per variable.
        (None, "sgd", 0.05, "mean", 4, SPARSE),
        # The outer rule: `fit` ends with its last round.
        (FIXED2, "adagrad", None, "mean", 4, OUTER),
    ],
    ids=[
        "whole",
        "sharded",
        "whole-segments",
        "sharded-segments",
        "whole-segments-sparse-fetches",
        "sharded-segments-outer-last-round",
    ],
)
def test_downpour_matches_the_numpy_reference(
    local_cluster,
    partitioner,
    local_optimizer,
    local_learning_rate,
    adagrad_accumulator,
    steps_per_execution,
    push_rules,
):
    """The same run as tests/downpour/test_downpour.py's, with a Keras 3 model.

    With `steps_per_execution` > 1 each function runs its steps in segments
    (`Downpour.run_steps`): the same parameters, step for step. With sparse
    fetches, also the bytes the reference counts. With the outer rule `fit`
    ends with its last round (`downpour.final_round`), as the reference's.
    """
    from tests.fixtures import downpour as tdp
    from tf_distbelief.downpour import config as downpour_config
    from tf_distbelief.downpour import schedule

    x, y, params = tdp._softmax_data()
    config = downpour_config.DownpourConfig(
        3,
        2,
        local_learning_rate=local_learning_rate,
        local_optimizer=local_optimizer,
        adagrad_accumulator=adagrad_accumulator,
        **push_rules,
    )
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(1, 2), partitioner
    )
    model = _keras3_softmax_model(params)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(tdp.BATCH_SIZE)
    history = keras3.fit(
        model,
        dataset=data,
        strategy=strategy,
        steps_per_epoch=tdp.STEPS,
        loss=keras.losses.SparseCategoricalCrossentropy(
            from_logits=True, dtype="float64"
        ),
        optimizer=keras3.Adagrad(tdp.LEARNING_RATE),
        downpour=config,
        steps_per_execution=steps_per_execution,
    )
    got, _ = history.ps_weights.numpy()
    want, (want_stats,) = schedule.simulate(
        params,
        tdp._softmax_grad,
        [tdp._batches(x, y)],
        config,
        schedule.adagrad_ps(tdp.LEARNING_RATE),
        final_round=True,
    )
    for got_value, want_value in zip(got, want):
        np.testing.assert_allclose(got_value, want_value, rtol=0, atol=1e-6)
    (stats,) = history.downpour.stats()
    assert (stats.steps, stats.fetches, stats.pushes) == (12, 4, 6)
    if push_rules is SPARSE:
        assert stats.bytes_fetched == want_stats.bytes_fetched
        assert stats.bytes_fetched < stats.fetches * sum(p.nbytes for p in params)
