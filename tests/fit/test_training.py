"""`training.fit` on the shared local cluster: accuracy, resume, a killed worker."""

import os
import signal

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.fit import _shard_passes
from tests.fixtures.helpers import (
    bytes_received_by,
    tensorboard_scalars,
    wait_for_worker_recovery,
)
from tf_distbelief import demos, job, paths
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import digits
from tf_distbelief.downpour import DownpourConfig
from tf_distbelief.faults import resume
from tf_distbelief.fit import training


@pytest.fixture(scope="module")
def data():
    return digits.load_data()


def _compiled(local_cluster, config, spec=None):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(config.num_workers, config.num_ps),
        strategy_lib.make_partitioner(
            config.partitioner, config.num_ps, config.shard_bytes
        ),
    )
    return job.compile_model(config, strategy, spec or demos.spec("digits"))


@pytest.mark.slow
def test_fit_resumes_from_model_dir(local_cluster, data, tmp_path):
    (x_train, y_train), (x_test, y_test) = data
    config = job.JobConfig(
        num_workers=2, num_ps=2, partitioner="fixed", epochs=2, steps_per_epoch=100
    )
    lines = []
    model = _compiled(local_cluster, config)
    first = training.fit(
        model,
        training.dataset_creator(x_train, y_train, 32),
        epochs=2,
        steps_per_epoch=100,
        batch_size=32,
        model_dir=str(tmp_path),
        log_every_steps=50,
        print_fn=lines.append,
    )
    assert first.initial_epoch == 0 and first.epochs == 2
    assert [h["epoch"] for h in first.history] == [1, 2]

    # A new run in the same model_dir starts from the saved ps values.
    model = _compiled(local_cluster, config)
    lines.clear()
    second = training.fit(
        model,
        training.dataset_creator(x_train, y_train, 32),
        epochs=4,
        steps_per_epoch=100,
        batch_size=32,
        model_dir=str(tmp_path),
        log_every_steps=50,
        print_fn=lines.append,
    )
    assert lines[0].startswith("Resumed from ") and "at step 200 (epoch 2)" in lines[0]
    assert second.initial_epoch == 2 and second.epochs == 4
    assert (second.initial_step, second.steps) == (200, 400)
    assert [h["epoch"] for h in second.history] == [3, 4]
    # Checkpoints are numbered by their step.
    assert second.checkpoint_path.endswith("ckpt-400")
    assert training.accuracy(model, x_test, y_test) >= 0.95
    # Issue 12: one step axis across both runs. Each tag's steps, read from
    # the first run's event file and then the resumed run's, strictly
    # increase; the epoch scalars sit at the global steps of the epoch ends.
    scalars = tensorboard_scalars(paths.tensorboard_dir(str(tmp_path)))
    assert [s for s, _ in scalars["epoch/loss"]] == [100, 200, 300, 400]
    assert [s for s, _ in scalars["epoch/accuracy"]] == [100, 200, 300, 400]
    for tag, points in scalars.items():
        steps = [s for s, _ in points]
        assert steps == sorted(set(steps)), (tag, steps)
    assert max(s for points in scalars.values() for s, _ in points) == 400
    # Read while the workers trained: examples/s every 50 finished steps or so.
    interval = [s for s, _ in scalars["interval/examples_per_sec"]]
    assert interval and all(0 < s <= 400 for s in interval)
    assert [h["loss"] for h in first.history + second.history] == pytest.approx(
        [v for _, v in scalars["epoch/loss"]]
    )
    # The restored run did not start from scratch: its first epoch's loss is
    # below the first run's first epoch.
    assert second.history[0]["loss"] < first.history[0]["loss"]


def test_checkpoint_of_another_model_is_kept_and_reported(
    local_cluster, data, tmp_path
):
    (x_train, y_train), _ = data
    config = job.JobConfig(num_workers=1, num_ps=1, epochs=1, steps_per_epoch=5)
    model = _compiled(local_cluster, config)
    training.fit(
        model,
        training.dataset_creator(x_train, y_train, 32),
        epochs=1,
        steps_per_epoch=5,
        batch_size=32,
        model_dir=str(tmp_path),
        print_fn=lambda _: None,
    )
    before = sorted(os.listdir(tmp_path / "checkpoints"))
    model = _compiled(
        local_cluster,
        config,
        demos.spec("speech", speech_hidden_units=8, speech_classes=4),
    )
    with pytest.raises(
        resume.RestoreError,
        match=r"ckpt-5 does not restore exactly into this model \(\d+ mismatches\): "
        r"`dense_\d+/kernel:0` \(model/layer_with_weights-0/kernel\): shape "
        r"\(64, \d+\) in the checkpoint, \(\d+, 8\) here",
    ):
        training.fit(
            model,
            None,
            epochs=2,
            steps_per_epoch=5,
            batch_size=32,
            model_dir=str(tmp_path),
            print_fn=lambda _: None,
        )
    assert sorted(os.listdir(tmp_path / "checkpoints")) == before


class _KillWorkerAfterFirstEpoch(tf_keras.callbacks.Callback):
    def __init__(self, local_cluster):
        super().__init__()
        self.local_cluster = local_cluster
        self.killed = False

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.local_cluster.kill("worker", 1, signal.SIGKILL)
            self.killed = True


@pytest.mark.slow
@pytest.mark.parametrize("downpour", [False, True], ids=["stock", "downpour"])
def test_sigkill_of_a_worker_during_fit_does_not_stop_training(
    local_cluster, data, downpour
):
    (x_train, y_train), (x_test, y_test) = data
    config = job.JobConfig(
        num_workers=2,
        num_ps=2,
        epochs=4,
        steps_per_epoch=100,
        downpour=DownpourConfig(n_fetch=4, n_push=4) if downpour else None,
    )
    model = _compiled(local_cluster, config)
    killer = _KillWorkerAfterFirstEpoch(local_cluster)
    try:
        result = training.fit(
            model,
            training.dataset_creator(x_train, y_train, 32),
            epochs=4,
            steps_per_epoch=100,
            batch_size=32,
            callbacks=[killer],
            print_fn=lambda _: None,
        )
        assert killer.killed
        assert local_cluster.processes[("worker", 1)].poll() == -signal.SIGKILL
        assert [h["epoch"] for h in result.history] == [1, 2, 3, 4]
        assert training.accuracy(model, x_test, y_test) >= 0.95
    finally:
        local_cluster.restart("worker", 1)
        wait_for_worker_recovery(model.distribute_strategy)


def test_each_replica_reads_its_own_records(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(3, 1))
    records = np.arange(30, dtype=np.int64)
    # A batch of 10 is one whole pass over a worker's shard of 30 / 3 records.
    passes = _shard_passes(strategy, training.dataset_creator(records, records, 10))
    assert sorted(passes) == [0, 1, 2]
    for worker, batches in passes.items():
        # Worker i reads records i, i + 3, ...: every pass, each exactly once.
        assert all(b == list(range(worker, 30, 3)) for b in batches), worker
    # Together: every record of range(30) exactly once per pass.
    assert sorted(sum((b[0] for b in passes.values()), [])) == list(range(30))


def test_each_worker_is_sent_its_own_shard_only(local_cluster):
    """Making its dataset sends a worker its shard of the arrays (a third,
    with 3 workers), not every record; it reads the shard in the order of the
    whole arrays cut by `Dataset.shard` and then shuffled."""
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(3, 1))
    records = 3 * 2**18
    x = np.arange(records, dtype=np.float64)  # Each record its own index.
    y = np.arange(records, dtype=np.int64)
    whole = x.nbytes + y.nbytes  # 12.6 MB.
    pids = [local_cluster.processes[("worker", i)].pid for i in range(3)]
    before = bytes_received_by(pids)
    passes = _shard_passes(
        strategy, training.dataset_creator(x, y, 64), min_passes=1, sort=False
    )
    after = bytes_received_by(pids)
    for worker, pid in enumerate(pids):
        received = after[pid] - before[pid]
        # Its shard, and little more (the functions, the requests); arrays
        # held as constants of the dataset function reach every task whole.
        assert whole // 3 <= received < whole // 3 + whole // 8, (worker, received)

    @tf.function
    def first_batch(worker):  # Every record, then the worker's shard.
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shard(3, worker)
        ds = ds.shuffle(records // 3, seed=0, reshuffle_each_iteration=True)
        return next(iter(ds.batch(64)))[0]

    for worker, batches in passes.items():
        assert batches[0] == first_batch(worker).numpy().tolist(), worker


def test_each_keras3_replica_reads_its_own_records(local_cluster):
    """`keras3.fit(x, y)` gives each worker its shard, as `dataset_creator`."""
    from tf_distbelief.keras3 import training_setup as keras3_training_setup

    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(3, 1))
    records = np.arange(30, dtype=np.int64)
    dataset_fn = keras3_training_setup.arrays_dataset_fn(
        strategy, records, records, 10, 0
    )
    passes = _shard_passes(strategy, dataset_fn)
    assert sorted(passes) == [0, 1, 2]
    for worker, batches in passes.items():
        assert all(b == list(range(worker, 30, 3)) for b in batches), worker


def test_dataset_creator_without_a_strategy_reads_everything():
    records = np.arange(12, dtype=np.int64)
    creator = training.dataset_creator(records, records, 12, seed=1)
    (batch, _) = next(iter(creator(tf.distribute.InputContext())))
    assert sorted(batch.numpy().tolist()) == list(range(12))
    with pytest.raises(ValueError, match=r"`num_replicas` must be >= 1 or None"):
        training.dataset_creator(records, records, 12, num_replicas=0)
