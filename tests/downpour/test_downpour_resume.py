"""Downpour resume (issue 10): a replica's own state survives a resume.

A replica's cache, its gradient sums, its local AdaGrad accumulator, its step
counter and its counters live on its worker (`per_worker_variable=True`);
`training.fit` checkpoints them per replica (`downpour.replica_state`) and
writes them back to the workers on a resume. With 1 worker and a fixed batch
a resumed run equals an uninterrupted one bit for bit, at a push boundary and
between pushes: the ps variables, the ps AdaGrad accumulators, the iteration
count, and every per-worker variable (caches, pending sums, local AdaGrad
accumulators, step counters, the residuals of compressed pushes).
"""

import shutil

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.fit import _logistic_model
from tf_distbelief import downpour, hooks
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.downpour import replica_state
from tf_distbelief.faults import resume
from tf_distbelief.fit import training
from tf_distbelief.tf_internals import variables as tf_variables

FEATURES, CLASSES, BATCH = 4, 3, 8
X = np.linspace(-1.0, 1.0, BATCH * FEATURES, dtype=np.float32).reshape(BATCH, -1)
Y = np.arange(BATCH, dtype=np.int64) % CLASSES
N = 2  # n_fetch = n_push.
STEPS_PER_EPOCH = 2 * N


@pytest.fixture(scope="module")
def strategy(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(1, 2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    downpour.enable(strategy)
    return strategy


def _model(strategy, local_optimizer, n_fetch=N, n_push=N, **push_rules):
    model = _logistic_model(strategy, FEATURES, CLASSES)
    with strategy.scope():
        config = downpour.DownpourConfig(
            n_fetch=n_fetch,
            n_push=n_push,
            local_optimizer=local_optimizer,
            **push_rules,
        )
        downpour.install(model, config)
    return model


def _fit(
    model,
    epochs,
    model_dir=None,
    steps_per_epoch=STEPS_PER_EPOCH,
    lines=None,
    callbacks=(),
):
    data = tf_keras.utils.experimental.DatasetCreator(
        lambda _: tf.data.Dataset.from_tensors((X, Y)).repeat()
    )
    return training.fit(
        model,
        data,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        batch_size=BATCH,
        model_dir=model_dir,
        print_fn=(lambda _: None) if lines is None else lines.append,
        callbacks=callbacks,
    )


class _Crash(Exception):
    """The job's process ending mid-run (`_CrashAt`)."""


class _CrashAt(tf_keras.callbacks.Callback):
    """Ends the run as a crash would when epoch `epoch` begins: after the
    checkpoint of the epoch before, and before the job's end of training
    (the outer rule's last round)."""

    def __init__(self, epoch: int):
        super().__init__()
        self._epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self._epoch:
            raise _Crash(f"crashed at epoch {epoch}")


def _state(model):
    """The ps variables, the ps AdaGrad accumulators and the iteration count."""
    optimizer = model.optimizer
    rules = hooks.of(model).state._exchange.rules
    momentums = [m.numpy() for m in getattr(rules, "momentums", [])]
    return [v.numpy() for v in model.trainable_weights] + [
        a.numpy() for a in optimizer._accumulators
    ] + momentums, int(optimizer.iterations.numpy())


@pytest.mark.slow
@pytest.mark.parametrize(
    "push_rules",
    [{}, {"outer_learning_rate": 0.7, "staleness_scaled": True}],
    ids=["plain", "outer_nesterov"],
)
def test_resume_at_a_push_boundary_equals_an_uninterrupted_run(
    strategy, tmp_path, push_rules
):
    """With the outer optimizer its momentum slots restore too (issue 14)."""
    first = _model(strategy, "sgd", **push_rules)
    _fit(first, 1, str(tmp_path))
    resumed = _model(strategy, "sgd", **push_rules)
    result = _fit(resumed, 2, str(tmp_path))
    assert result.initial_step == STEPS_PER_EPOCH
    uninterrupted = _model(strategy, "sgd", **push_rules)
    _fit(uninterrupted, 2)
    if push_rules:  # 2 sharded variables, 2 shards each: 4 momentum slots.
        momentums = hooks.of(uninterrupted).state._exchange.rules.momentums
        assert len(momentums) == 4
        assert all(np.abs(m.numpy()).max() > 0 for m in momentums)
    got, got_iterations = _state(resumed)
    want, want_iterations = _state(uninterrupted)
    assert got_iterations == want_iterations == 2 * STEPS_PER_EPOCH // N
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def _worker_state(model):
    """Worker 0's value of every per-worker Downpour variable, by name."""
    return {
        name: v.read_all()[0].numpy()
        for name, v in hooks.of(model).state.worker_variables().items()
    }


def _snapshot(model):
    """`_state`, `_worker_state` and the ps update count, as NumPy values."""
    state, iterations = _state(model)
    count = int(hooks.of(model).state.update_count.numpy())
    return state, iterations, _worker_state(model), count


def _assert_same_state(got_model, want_model, but=()):
    """Equal ps state, and per-worker state but the variables named in `but`
    (each a model, or a model's `_snapshot`)."""
    got, got_iterations, got_workers, got_count = (
        got_model if isinstance(got_model, tuple) else _snapshot(got_model)
    )
    want, want_iterations, want_workers, want_count = (
        want_model if isinstance(want_model, tuple) else _snapshot(want_model)
    )
    assert got_iterations == want_iterations
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(got_workers) == sorted(want_workers)
    for name in sorted(set(want_workers) - set(but)):
        np.testing.assert_array_equal(got_workers[name], want_workers[name], name)
    assert got_count == want_count


def test_saved_replicas_counts_the_replicas_in_checkpoint_keys():
    prefix = "downpour/replicas"
    keys = [
        "step/.ATTRIBUTES/VARIABLE_VALUE",
        f"{prefix}/0/saved/.ATTRIBUTES/VARIABLE_VALUE",
        f"{prefix}/2/saved/.ATTRIBUTES/VARIABLE_VALUE",
        f"{prefix}/2/values/seen/.ATTRIBUTES/VARIABLE_VALUE",
    ]
    assert replica_state.saved_replicas(keys) == 3
    assert replica_state.saved_replicas(keys[:1]) is None


@pytest.mark.slow
def test_resume_between_pushes_with_local_adagrad_equals_an_uninterrupted_run(
    strategy, tmp_path
):
    # n_fetch=3, n_push=2, a checkpoint at step 5: one step's gradient not
    # yet pushed, a cache fetched 2 steps before, the local AdaGrad
    # accumulator grown over 5 steps.
    spe, config = 5, dict(n_fetch=3, n_push=2)
    first = _model(strategy, "adagrad", **config)
    _fit(first, 1, str(tmp_path), steps_per_epoch=spe)
    at_checkpoint = _worker_state(first)
    assert at_checkpoint["stats/steps"] == spe
    assert np.any(at_checkpoint["dense/accumulator/0"] != 0)

    # A resume with nothing left to train writes the state back only.
    lines = []
    restored = _model(strategy, "adagrad", **config)
    _fit(restored, 1, str(tmp_path), steps_per_epoch=spe, lines=lines)
    assert not any("start fresh" in line for line in lines), lines
    _assert_same_state(restored, first)

    resumed = _model(strategy, "adagrad", **config)
    result = _fit(resumed, 2, str(tmp_path), steps_per_epoch=spe)
    assert result.initial_step == spe
    uninterrupted = _model(strategy, "adagrad", **config)
    _fit(uninterrupted, 2, steps_per_epoch=spe)
    _assert_same_state(resumed, uninterrupted)
    assert _worker_state(resumed)["stats/steps"] == 2 * spe
    assert int(resumed.optimizer.iterations.numpy()) == 2 * spe // 2


@pytest.mark.slow
@pytest.mark.parametrize("sparse_fetches", [False, True], ids=["whole", "sparse"])
def test_resume_with_a_compression_residual_equals_an_uninterrupted_run(
    strategy, tmp_path, sparse_fetches
):
    """What compressed pushes have not sent yet (each replica's residual) is
    replica state: a checkpoint at step 5 holds a non-zero residual and one
    step's unpushed gradient, and the resumed run ends bit for bit where the
    uninterrupted one does. With sparse fetches the resumed replica's mirror
    of the ps is new, so its first fetch moves the whole model: the same
    state, other bytes fetched."""
    spe = 5
    config = dict(
        n_fetch=3,
        n_push=2,
        adagrad_accumulator="mean",
        top_k_fraction=0.5,
        quantize_bits=2,
        quantize_chunk=2,
        sparse_fetches=sparse_fetches,
    )
    first = _model(strategy, "adagrad", **config)
    _fit(first, 1, str(tmp_path), steps_per_epoch=spe)
    at_checkpoint = _worker_state(first)
    assert np.any(at_checkpoint["dense/residual/0"] != 0)
    assert np.any(at_checkpoint["dense/accumulator/0"] != 0)
    resumed = _model(strategy, "adagrad", **config)
    result = _fit(resumed, 2, str(tmp_path), steps_per_epoch=spe)
    assert result.initial_step == spe
    uninterrupted = _model(strategy, "adagrad", **config)
    _fit(uninterrupted, 2, steps_per_epoch=spe)
    counter = "stats/sparse_bytes_fetched"
    if sparse_fetches:
        # The resumed run's fetch at step 6 moved the whole model, the
        # uninterrupted run's the entries changed since step 3 (on this
        # 15-entry model, with their positions, about as many bytes).
        got, want = _worker_state(resumed), _worker_state(uninterrupted)
        assert got[counter] > at_checkpoint[counter] > 0
        assert got[counter] != want[counter]
    _assert_same_state(resumed, uninterrupted, but=(counter,))
    assert np.any(_worker_state(resumed)["dense/residual/0"] != 0)


@pytest.mark.slow
def test_resume_with_stream_fetches_equals_an_uninterrupted_run(
    strategy, local_cluster, tmp_path
):
    """With the outer rule, compressed pushes keep the unsent progress in the
    cache and a mirror of the ps (`downpour.stream_fetch`): both are replica
    state. A checkpoint at step 5 (mid-round, the cache ahead of its mirror)
    resumes bit for bit: the new process's log starts elsewhere, so the
    resumed replica's first fetch is whole and moves its cache by what its
    mirror moved, as replaying the log would have."""
    spe = 5
    config = dict(
        n_fetch=3,
        n_push=3,
        outer_learning_rate=0.35,
        outer_momentum=0.9,
        top_k_fraction=0.5,
        quantize_bits=2,
        quantize_chunk=2,
    )
    run, copy = tmp_path / "run", tmp_path / "copy"
    first = _model(strategy, "adagrad", **config)
    with pytest.raises(_Crash):  # Mid-job: no last round yet.
        _fit(first, 2, str(run), steps_per_epoch=spe, callbacks=[_CrashAt(1)])
    shutil.copytree(run, copy)  # The checkpoint at step 5, resumed twice.
    at_checkpoint = _worker_state(first)
    assert at_checkpoint["stream/mirrored"] == 1
    resumed = _model(strategy, "adagrad", **config)
    result = _fit(resumed, 2, str(run), steps_per_epoch=spe)
    assert result.initial_step == spe
    uninterrupted = _model(strategy, "adagrad", **config)
    _fit(uninterrupted, 2, steps_per_epoch=spe)
    # The resumed fetch at step 6 was whole: other bytes fetched.
    _assert_same_state(resumed, uninterrupted, but=("stats/stream_bytes_fetched",))
    want = _snapshot(uninterrupted)  # Read before the cluster changes.
    first_logs = len(hooks.of(first).state._stream.groups)
    # Into one ps task: both shards of each variable share a log there (one
    # log, where the checkpoint's run had two); the same resume, bit for bit.
    partitioner = tf.distribute.experimental.partitioners.FixedShardsPartitioner
    try:
        one_ps = strategy_lib.DistBeliefStrategy(
            local_cluster.resolver_for(1, 1), partitioner(2)
        )
        downpour.enable(one_ps)
        moved = _model(one_ps, "adagrad", **config)
        assert len(hooks.of(moved).state._stream.groups) == 1
        assert first_logs == 2
        result = _fit(moved, 2, str(copy), steps_per_epoch=spe)
        assert result.initial_step == spe
        _assert_same_state(moved, want, but=("stats/stream_bytes_fetched",))
    finally:
        # Connected to the module's cluster again (1 worker, 2 ps): its
        # `strategy` runs the tests after this one.
        strategy_lib.DistBeliefStrategy(
            local_cluster.resolver_for(1, 2), partitioner(2)
        )


@pytest.mark.slow
def test_checkpoint_without_replica_state_starts_replicas_fresh(strategy, tmp_path):
    # A checkpoint as written before the replica state was saved.
    first = _model(strategy, "adagrad")
    _fit(first, 1)
    step = tf.Variable(STEPS_PER_EPOCH, dtype=tf.int64)
    epoch = tf.Variable(1, dtype=tf.int64)
    tf.train.CheckpointManager(
        tf.train.Checkpoint(
            model=first, optimizer=first.optimizer, epoch=epoch, step=step
        ),
        str(tmp_path / "checkpoints"),
        max_to_keep=1,
    ).save(checkpoint_number=STEPS_PER_EPOCH)
    lines = []
    restored = _model(strategy, "adagrad")
    _fit(restored, 1, str(tmp_path), lines=lines)
    assert any(
        "holds no Downpour replica state" in line and "starts fresh" in line
        for line in lines
    ), lines
    got, got_iterations = _state(restored)
    want, want_iterations = _state(first)
    assert got_iterations == want_iterations
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    workers = _worker_state(restored)
    assert workers["stats/steps"] == 0 and workers["seen"] == 0
    np.testing.assert_array_equal(
        workers["dense/local_accumulator/0"],
        np.full((FEATURES // 2, CLASSES), 0.1, np.float32),
    )


@pytest.mark.slow
def test_replica_state_of_another_local_optimizer_is_an_error_naming_it(
    strategy, tmp_path
):
    _fit(_model(strategy, "adagrad"), 1, str(tmp_path))
    with pytest.raises(
        resume.RestoreError, match="local_accumulator.S0: a value with no variable"
    ):
        _fit(_model(strategy, "sgd"), 2, str(tmp_path))


@pytest.mark.slow
def test_fewer_workers_get_their_replicas_back_and_drop_the_rest(
    local_cluster, tmp_path
):
    def strategy_of(num_workers):
        strategy = strategy_lib.DistBeliefStrategy(
            local_cluster.resolver_for(num_workers, 2),
            tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
        )
        downpour.enable(strategy)
        return strategy

    _fit(_model(strategy_of(2), "adagrad", 3, 2), 1, str(tmp_path))
    latest = tf.train.latest_checkpoint(str(tmp_path / "checkpoints"))
    reader = tf.train.load_checkpoint(latest)
    lines = []
    restored = _model(strategy_of(1), "adagrad", 3, 2)
    _fit(restored, 1, str(tmp_path), lines=lines)
    assert any(
        "holds the state of 2 Downpour replicas; this run has 1 workers: "
        "replicas 0..0 get theirs back, the state of replicas 1..1 is dropped" in line
        for line in lines
    ), lines
    workers = _worker_state(restored)
    for name, value in workers.items():
        key = "downpour/replicas/0/values/" + name.replace("/", ".S")
        np.testing.assert_array_equal(
            value, reader.get_tensor(key + "/.ATTRIBUTES/VARIABLE_VALUE"), name
        )
    assert (
        reader.get_tensor("downpour/replicas/1/saved/.ATTRIBUTES/VARIABLE_VALUE") == 1
    )


@pytest.mark.slow
def test_a_replica_state_holding_nan_is_saved_as_start_fresh(strategy):
    """`capture` copies a replica's state in one call and checks it there:
    a NaN in the worker's accumulator makes the replica 'start fresh', named."""
    model = _model(strategy, "adagrad")
    _fit(model, 1)
    state = replica_state.ReplicaState(hooks.of(model).state)
    assert state.capture() == []
    assert int(state.replicas[0].saved.numpy()) == 1
    name = "dense/accumulator/0"
    accumulator = tf_variables.worker_variable(
        hooks.of(model).state.worker_variables()[name], 0, 60.0
    )
    value = accumulator.read_value().numpy()
    np.testing.assert_array_equal(state.replicas[0].values[name].numpy(), value)
    value.flat[0] = np.nan
    accumulator.assign(value)
    (line,) = state.capture()
    assert "Downpour replica 0 saved as 'start fresh'" in line, line
    assert f"{name} hold NaN or inf" in line, line
    assert int(state.replicas[0].saved.numpy()) == 0
