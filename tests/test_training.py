"""`training.fit` on the shared local cluster: accuracy, resume, a killed worker."""

import os
import signal

import pytest
import tf_keras

import models
from models import digits
from tests.helpers import wait_for_worker_recovery
from tf_distbelief import job, training
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.downpour import DownpourConfig


@pytest.fixture(scope="module")
def data():
    return digits.load_data()


def _compiled(local_cluster, config):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(config.num_workers, config.num_ps),
        job.make_partitioner(config.partitioner, config.num_ps, config.shard_bytes),
    )
    return job.compile_model(config, strategy, models.spec("digits"))


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
        print_fn=lines.append,
    )
    assert lines[0].startswith("Resumed from ") and "at epoch 2" in lines[0]
    assert second.initial_epoch == 2 and second.epochs == 4
    assert [h["epoch"] for h in second.history] == [3, 4]
    assert second.checkpoint_path.endswith("ckpt-4")
    assert training.accuracy(model, x_test, y_test) >= 0.95
    assert any(
        n.startswith("events.out.tfevents")
        for n in os.listdir(tmp_path / training.TENSORBOARD_SUBDIR)
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
    before = sorted(os.listdir(tmp_path / training.CHECKPOINT_SUBDIR))
    other = job.JobConfig(
        num_workers=1, num_ps=1, model="speech", speech_hidden_units=8, speech_classes=4
    )
    model = _compiled(local_cluster, other)
    with pytest.raises(
        ValueError, match=r"does not match this model.*nothing was deleted"
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
    assert sorted(os.listdir(tmp_path / training.CHECKPOINT_SUBDIR)) == before


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
