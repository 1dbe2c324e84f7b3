"""Exact resume and step checkpoints (issue 10) on the shared local cluster.

One worker and a fixed batch make every run deterministic, so a resumed run
must equal an uninterrupted one bit for bit: every weight, every AdaGrad
accumulator, the iteration count and the step. The tests that say so run for
a tf_keras model (`fit.training.fit`) and a Keras 3 model (`keras3.fit`), the
same checks on each (`_Keras2`, `_Keras3`).
"""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tf_distbelief as tfdb
from tests.fixtures.launch import ROOT, _env
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.faults import resume, tf_keras_fit
from tf_distbelief.fit import training

VOCAB, DIM, CLASSES, IDS, BATCH = 40, 8, 3, 4, 16
# Every id of the table appears in the batch, some several times.
X = ((np.arange(BATCH * IDS) * 7) % VOCAB).reshape(BATCH, IDS).astype(np.int64)
Y = np.arange(BATCH, dtype=np.int64) % CLASSES


def _strategy(local_cluster, num_ps):
    return strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(1, num_ps),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(num_ps),
    )


def _model(
    local_cluster, num_ps, vocab=VOCAB, optimizer=tfdb.adagrad.Adagrad, strategy=None
):
    """The issue's model: `Embedding(40, 8)` cut into `num_ps` shards, AdaGrad.

    Left unbuilt (no input shape), as the demo `embedding` model is: `fit`
    builds it before restoring. `optimizer(0.5)` is made under the
    strategy's scope (its variables on the ps). A new strategy (a new
    connection to the cluster) unless `strategy` is given.
    """
    strategy = strategy or _strategy(local_cluster, num_ps)
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.layers.Embedding(
                    vocab,
                    DIM,
                    embeddings_initializer=tf_keras.initializers.RandomUniform(
                        -0.05, 0.05, seed=0
                    ),
                ),
                tf_keras.layers.GlobalAveragePooling1D(),
                tf_keras.layers.Dense(
                    CLASSES, kernel_initializer=tf_keras.initializers.GlorotUniform(1)
                ),
            ]
        )
        model.compile(
            optimizer(0.5),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
        )
    return model


def _fixed_batch():
    return tf_keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensors((X, Y)).repeat()
    )


def _fit(model, epochs, model_dir, lines=None, steps_per_epoch=1, **kwargs):
    return training.fit(
        model,
        _fixed_batch(),
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        batch_size=BATCH,
        model_dir=str(model_dir),
        print_fn=(lines.append if lines is not None else lambda _: None),
        **kwargs,
    )


def _values(checkpoint_path):
    """Every value a checkpoint holds but its own save counter."""
    reader = tf.train.load_checkpoint(checkpoint_path)
    return {
        key: reader.get_tensor(key)
        for key in reader.get_variable_to_shape_map()
        if key
        not in (
            "_CHECKPOINTABLE_OBJECT_GRAPH",
            "save_counter/.ATTRIBUTES/VARIABLE_VALUE",
        )
    }


def _assert_bit_equal(got, want):
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype, key
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)


@dataclasses.dataclass
class _Run:
    """What a test reads of a run of either Keras (`FitResult` or `History`)."""

    initial_step: int
    steps: int
    checkpoint_path: str
    epochs: list  # The epochs trained, from 1.
    steps_at_epoch_ends: list | None  # None: Keras 3 logs no step counts.


class _Keras2:
    """The tf_keras model and `fit.training.fit`."""

    id = "tf_keras"
    accumulator_prefix = "optimizer/_variables/"
    # The embedding table's key and name in a `RestoreError`.
    table = r"`embedding_\d+/embeddings:0` \(model/layer_with_weights-0/embeddings\)"

    @staticmethod
    def model(local_cluster, num_ps, vocab=VOCAB, strategy=None):
        return _model(local_cluster, num_ps, vocab=vocab, strategy=strategy)

    @staticmethod
    def fit(model, epochs, model_dir, lines=None, steps_per_epoch=1, **kwargs):
        result = _fit(model, epochs, model_dir, lines, steps_per_epoch, **kwargs)
        return _Run(
            result.initial_step,
            result.steps,
            result.checkpoint_path,
            [h["epoch"] for h in result.history],
            [h["steps"] for h in result.history],
        )

    @staticmethod
    def crash_after(step):
        """`fit` arguments of a run that crashes once `step` steps ran, and
        what it raises."""
        return {"callbacks": [_FailAtStep(step)]}, RuntimeError


class _Keras3:
    """The same model in Keras 3, and `keras3.fit` with the same settings."""

    id = "keras3"
    accumulator_prefix = "optimizer/accumulators/"
    table = r"`sequential_\d+_embedding_\d+_embeddings:0` \(model/trainable/0\)"

    @staticmethod
    def model(local_cluster, num_ps, vocab=VOCAB, strategy=None):
        """`(model, strategy)`: the Keras 3 model is built outside the
        strategy; `keras3.fit` puts its weights on the ps."""
        import keras

        # Connected first: connecting resets the eager context, and with it
        # the variables of a model built before.
        strategy = strategy or _strategy(local_cluster, num_ps)
        model = keras.Sequential(
            [
                keras.Input((IDS,), dtype="int64"),
                keras.layers.Embedding(
                    vocab,
                    DIM,
                    embeddings_initializer=keras.initializers.RandomUniform(
                        -0.05, 0.05, seed=0
                    ),
                ),
                keras.layers.GlobalAveragePooling1D(),
                keras.layers.Dense(
                    CLASSES, kernel_initializer=keras.initializers.GlorotUniform(1)
                ),
            ]
        )
        return model, strategy

    @staticmethod
    def fit(
        model,
        epochs,
        model_dir,
        lines=None,
        steps_per_epoch=1,
        data=None,
        optimizer=None,
        **kwargs,
    ):
        import keras

        from tf_distbelief import keras3

        model, strategy = model
        history = keras3.fit(
            model,
            dataset=data or tf.data.Dataset.from_tensors((X, Y)),
            strategy=strategy,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=(),
            optimizer=optimizer or keras3.Adagrad(0.5),
            model_dir=str(model_dir),
            print_fn=(lines.append if lines is not None else lambda _: None),
            **kwargs,
        )
        first = history.initial_step // steps_per_epoch
        return _Run(
            history.initial_step,
            history.steps,
            history.checkpoint_path,
            [first + 1 + e for e in range(len(history.epoch))],
            None,
        )

    @staticmethod
    def crash_after(step):
        # Keras 3's loop calls no batch hooks: the step after `step` fails
        # on its worker (its batch), as a step that crashes.
        def check(index, batch):
            with tf.control_dependencies(
                [
                    tf.debugging.assert_less(
                        index, tf.constant(step, tf.int64), f"crash at step {step}"
                    )
                ]
            ):
                return tf.nest.map_structure(tf.identity, batch)

        data = tf.data.Dataset.from_tensors((X, Y)).repeat().enumerate().map(check)
        return {"data": data}, tf.errors.InvalidArgumentError


KERAS = pytest.mark.parametrize("k", [_Keras2, _Keras3], ids=lambda k: k.id)


@pytest.fixture(scope="module", params=[_Keras2, _Keras3], ids=lambda k: k.id)
def runs(request, local_cluster, tmp_path_factory):
    """A 3-step run and an uninterrupted 4-step run, both on 2 ps shards:
    `(keras, three, straight values)`."""
    k = request.param
    three = tmp_path_factory.mktemp("three")
    k.fit(k.model(local_cluster, 2), 3, three)
    straight = tmp_path_factory.mktemp("straight")
    result = k.fit(k.model(local_cluster, 2), 4, straight)
    return k, three, _values(result.checkpoint_path)


# One process runs them all: `runs` (a module fixture) is made once per Keras.
@pytest.mark.xdist_group("resume_runs")
@pytest.mark.parametrize("num_ps", [1, 2, 3])
def test_resume_of_sharded_adagrad_equals_an_uninterrupted_run(
    local_cluster, runs, tmp_path, num_ps
):
    k, three, straight = runs
    shutil.copytree(three, tmp_path, dirs_exist_ok=True)
    lines = []
    result = k.fit(k.model(local_cluster, num_ps), 4, tmp_path, lines)
    assert lines[0].startswith("Resumed from ") and "at step 3 (epoch 3)" in lines[0]
    assert (result.initial_step, result.steps) == (3, 4)
    _assert_bit_equal(_values(result.checkpoint_path), straight)
    # The test means something: the accumulators moved off their initial 0.1,
    # and the step and iteration count are those of 4 steps.
    accumulators = [
        v for key, v in straight.items() if key.startswith(k.accumulator_prefix)
    ]
    assert len(accumulators) == 3
    assert all((a > np.float32(0.1)).any() for a in accumulators)
    if k is _Keras2:  # Keras 3's AdaGrad on the ps keeps no iteration count.
        assert straight["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 4
    assert straight["step/.ATTRIBUTES/VARIABLE_VALUE"] == 4


def test_a_value_that_does_not_fit_is_an_error_naming_the_variable(
    local_cluster, runs, tmp_path
):
    k, three, _ = runs
    shutil.copytree(three, tmp_path, dirs_exist_ok=True)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(
        resume.RestoreError,
        match=k.table + r": shape \(40, 8\) in the checkpoint, \(41, 8\) here",
    ):
        k.fit(k.model(local_cluster, 2, vocab=VOCAB + 1), 4, tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before


def test_a_missing_slot_is_an_error_naming_it(local_cluster, tmp_path):
    # Written with SGD: no accumulators in the checkpoint for AdaGrad to find.
    _fit(_model(local_cluster, 2, optimizer=tf_keras.optimizers.SGD), 1, tmp_path)
    with pytest.raises(
        resume.RestoreError,
        match=r"optimizer/_accumulators \(holding "
        r"`accumulator/embedding_\d+/embeddings:0`, .*\): not in the checkpoint; "
        r"optimizer/momentums: in the checkpoint, holds no variable here",
    ):
        _fit(_model(local_cluster, 2), 2, tmp_path)


def test_a_keras3_checkpoint_of_another_optimizer_is_an_error_naming_it(
    local_cluster, tmp_path
):
    # Written with SGD with momentum: its momentums, of the accumulators'
    # shapes, must not restore as AdaGrad accumulators.
    from tf_distbelief import keras3

    momentum = keras3.SGD(0.1, momentum=0.9)
    _Keras3.fit(_Keras3.model(local_cluster, 2), 1, tmp_path, optimizer=momentum)
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    with pytest.raises(
        resume.RestoreError,
        match=r"optimizer/accumulators \(holding .*\): not in the checkpoint; "
        r"optimizer/momentums: in the checkpoint, holds no variable here",
    ):
        _Keras3.fit(_Keras3.model(local_cluster, 2), 2, tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before
    # Plain SGD keeps no slot: the momentums are still refused.
    with pytest.raises(resume.RestoreError, match=r"optimizer/momentums"):
        _Keras3.fit(
            _Keras3.model(local_cluster, 2), 2, tmp_path, optimizer=keras3.SGD(0.1)
        )
    # The same optimizer resumes.
    result = _Keras3.fit(
        _Keras3.model(local_cluster, 2), 2, tmp_path, optimizer=momentum
    )
    assert (result.initial_step, result.steps) == (1, 2)


class _FailAtStep(tf_keras.callbacks.Callback):
    """Stops `fit` with an error once `step` steps are scheduled (a crash)."""

    def __init__(self, step):
        super().__init__()
        self._supports_tf_logs = True
        self.step = step
        self.seen = 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise RuntimeError(f"crash at step {self.step}")


@KERAS
def test_step_checkpoints_resume_mid_epoch_to_exactly_the_steps_requested(
    local_cluster, tmp_path, k
):
    every, steps_per_epoch, epochs = 4, 10, 2
    # One connection for the three runs: a new one while the crashed run's
    # steps are still in flight crashes TensorFlow (see conftest.py).
    strategy = _strategy(local_cluster, 2)
    crashed = tmp_path / "crashed"
    crash, error = k.crash_after(7)
    with pytest.raises(error, match="crash at step 7"):
        k.fit(
            k.model(local_cluster, 2, strategy=strategy),
            epochs,
            crashed,
            steps_per_epoch=steps_per_epoch,
            checkpoint_every_steps=every,
            **crash,
        )
    tf.distribute.experimental.coordinator.ClusterCoordinator(strategy).join()
    # Steps 5-7 are lost: at most `every` steps.
    assert tf.train.latest_checkpoint(crashed / "checkpoints").endswith("ckpt-4")
    lines = []
    resumed = k.fit(
        k.model(local_cluster, 2, strategy=strategy),
        epochs,
        crashed,
        lines,
        steps_per_epoch=steps_per_epoch,
        checkpoint_every_steps=every,
    )
    assert lines[0].endswith("at step 4 (epoch 0, 4 steps into epoch 1)")
    assert (resumed.initial_step, resumed.steps) == (4, 20)
    assert resumed.epochs == [1, 2]
    if resumed.steps_at_epoch_ends is not None:
        assert resumed.steps_at_epoch_ends == [10, 20]
    # Checkpoints at every 4th step and at epoch ends; the last 3 kept.
    names = sorted(
        n for n in os.listdir(crashed / "checkpoints") if n.endswith(".index")
    )
    assert names == ["ckpt-12.index", "ckpt-16.index", "ckpt-20.index"]
    straight = k.fit(
        k.model(local_cluster, 2, strategy=strategy),
        epochs,
        tmp_path / "straight",
        steps_per_epoch=steps_per_epoch,
    )
    got, want = _values(resumed.checkpoint_path), _values(straight.checkpoint_path)
    if k is _Keras2:  # Keras 3's AdaGrad on the ps keeps no iteration count.
        assert got["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 20
    assert got["step/.ATTRIBUTES/VARIABLE_VALUE"] == 20
    assert got["epoch/.ATTRIBUTES/VARIABLE_VALUE"] == 2
    _assert_bit_equal(got, want)


def test_steps_per_epoch_none_is_a_named_error():
    with pytest.raises(
        ValueError,
        match=r"`steps_per_epoch` must be an int >= 1 under parameter-server "
        r"training .* Received: None",
    ):
        training.fit(None, None, epochs=1, steps_per_epoch=None, batch_size=1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"checkpoint_every_steps": -1},
            r"`checkpoint_every_steps` must be an int >= 0",
        ),
        ({"checkpoint_every_steps": 5}, r"`checkpoint_every_steps` needs `model_dir`"),
        ({"nonfinite": "ignore"}, r"`nonfinite` must be one of raise, skip"),
    ],
)
def test_bad_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        training.fit(None, None, epochs=1, steps_per_epoch=1, batch_size=1, **kwargs)


# A child process trains a small model with step checkpoints, then its files
# may grow to `LIMIT` bytes only (`RLIMIT_FSIZE`, SIGXFSZ ignored: a write
# beyond fails with EFBIG, as on a full disk) and the next checkpoint fails.
_FAILED_WRITE = """
import json, resource, signal, sys
import numpy as np, tensorflow as tf, tf_keras
from tf_distbelief.faults import resume, tf_keras_fit

model_dir, limit = sys.argv[1], int(sys.argv[2])
tf.random.set_seed(0)
model = tf_keras.Sequential([tf_keras.Input([64]), tf_keras.layers.Dense(256)])
model.compile(tf_keras.optimizers.Adagrad(0.1), "mse")
step = tf.Variable(0, dtype=tf.int64)
epoch = tf.Variable(0, dtype=tf.int64)
manager = tf.train.CheckpointManager(
    tf.train.Checkpoint(model=model, optimizer=model.optimizer, step=step, epoch=epoch),
    model_dir, max_to_keep=3)
x, y = np.ones([12, 64], np.float32), np.zeros([12, 256], np.float32)
saver = tf_keras_fit.Checkpointer(
    manager, step, epoch, steps_per_epoch=6, every_steps=2)
model.fit(x, y, batch_size=2, epochs=1, callbacks=[saver], verbose=0)
np.save(model_dir + ".npy", model.get_weights()[0])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
try:
    model.fit(x, y, batch_size=2, epochs=2, initial_epoch=1, callbacks=[saver],
              verbose=0)
except resume.CheckpointWriteError as e:
    print(json.dumps({"error": str(e), "cause": type(e.__context__).__name__}))
"""


def test_a_failed_checkpoint_write_leaves_only_whole_checkpoints(tmp_path):
    model_dir = str(tmp_path / "checkpoints")
    proc = subprocess.run(
        [sys.executable, "-c", _FAILED_WRITE, model_dir, str(16 * 1024)],
        cwd=ROOT,
        env=_env(f"failed-write-{os.getpid()}"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["cause"] == "OutOfRangeError"  # EFBIG: "File too large".
    assert report["error"].startswith(f"Writing checkpoint {model_dir}/ckpt-8 failed")
    assert "File too large" in report["error"]
    assert f"the last whole checkpoint, {model_dir}/ckpt-6, is" in report["error"]
    # Only the whole checkpoints 2, 4, 6 and the state file naming ckpt-6.
    names = sorted(os.listdir(model_dir))
    assert names == ["checkpoint"] + [
        f"ckpt-{n}.{part}"
        for n in (2, 4, 6)
        for part in ("data-00000-of-00001", "index")
    ], names
    assert tf.train.latest_checkpoint(model_dir) == f"{model_dir}/ckpt-6"
    # And training state restores from it exactly.
    model = tf_keras.Sequential([tf_keras.Input([64]), tf_keras.layers.Dense(256)])
    model.compile(tf_keras.optimizers.Adagrad(0.1), "mse")
    tf_keras_fit.build(model)
    step = tf.Variable(0, dtype=tf.int64)
    epoch = tf.Variable(0, dtype=tf.int64)
    resume.restore(
        tf.train.Checkpoint(
            model=model, optimizer=model.optimizer, step=step, epoch=epoch
        ),
        f"{model_dir}/ckpt-6",
    )
    assert (int(step.numpy()), int(epoch.numpy())) == (6, 1)
    np.testing.assert_array_equal(model.get_weights()[0], np.load(model_dir + ".npy"))


def test_save_whole_records_as_the_manager_s_own_save_and_sees_new_objects(tmp_path):
    """`save_whole` writes through a traced function: the folder, the state
    file and `max_to_keep` are as `CheckpointManager.save` leaves them, and an
    object added to the checkpoint after a write is in the next one."""
    a = tf.Variable([1.0, 2.0])
    ours = tf.train.Checkpoint(a=a)
    theirs = tf.train.Checkpoint(a=a)
    ours_manager = tf.train.CheckpointManager(ours, str(tmp_path / "ours"), 2)
    theirs_manager = tf.train.CheckpointManager(theirs, str(tmp_path / "theirs"), 2)
    for number in (2, 4):
        a.assign_add([1.0, 1.0])
        resume.save_whole(ours_manager, number)
        theirs_manager.save(checkpoint_number=number)
    b = tf.Variable(7.0)
    ours.b = theirs.b = b  # Added after two writes.
    resume.save_whole(ours_manager, 6)
    theirs_manager.save(checkpoint_number=6)
    for manager in (ours_manager, theirs_manager):
        folder = manager.directory
        assert [os.path.basename(p) for p in manager.checkpoints] == [
            "ckpt-4",
            "ckpt-6",
        ]
        state = tf.train.get_checkpoint_state(folder)
        assert state.model_checkpoint_path == os.path.join(folder, "ckpt-6")
        assert sorted(os.listdir(folder)) == [
            "checkpoint",
            *(
                f"ckpt-{n}.{part}"
                for n in (4, 6)
                for part in ("data-00000-of-00001", "index")
            ),
        ]
    got = tf.train.load_checkpoint(str(tmp_path / "ours" / "ckpt-6"))
    want = tf.train.load_checkpoint(str(tmp_path / "theirs" / "ckpt-6"))
    keys = sorted(want.get_variable_to_shape_map())
    assert sorted(got.get_variable_to_shape_map()) == keys
    assert "b/.ATTRIBUTES/VARIABLE_VALUE" in keys
    for key in keys:
        if key != "_CHECKPOINTABLE_OBJECT_GRAPH":
            np.testing.assert_array_equal(got.get_tensor(key), want.get_tensor(key))
