"""Downpour faults (section 4.1): checkpoints hold ps values; a restarted worker
rejoins and fetches before its first step."""

import math
import signal

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.helpers import wait_for_worker_recovery
from tf_distbelief import demos, hooks, job
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import digits
from tf_distbelief.downpour import DownpourConfig
from tf_distbelief.fit import training

N_FETCH = N_PUSH = 4


def _downpour_model(local_cluster):
    config = job.JobConfig(
        learning_rate=0.1,  # What these tests were set up with (the default was).
        num_workers=2,
        num_ps=2,
        partitioner="fixed",
        downpour=DownpourConfig(n_fetch=N_FETCH, n_push=N_PUSH),
        steps_per_execution=1,
    )
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(2, 2),
        strategy_lib.make_partitioner("fixed", 2, config.shard_bytes),
    )
    return job.compile_model(config, strategy, demos.spec("digits"))


@pytest.mark.slow
def test_checkpoint_holds_ps_values_not_a_cache(local_cluster, tmp_path):
    (x, y), _ = digits.load_data()
    model = _downpour_model(local_cluster)
    # 102 steps: not a multiple of n_push, so accumulators and caches are mid-cycle.
    result = training.fit(
        model,
        training.dataset_creator(x, y, 32),
        epochs=1,
        steps_per_epoch=102,
        batch_size=32,
        model_dir=str(tmp_path),
        print_fn=lambda _: None,
    )
    reader = tf.train.load_checkpoint(result.checkpoint_path)
    saved = {
        name: reader.get_tensor(name)
        for name in reader.get_variable_to_shape_map()
        if name.startswith("model/") and "OPTIMIZER" not in name
    }
    ps_values = {v.name: v.numpy() for v in model.trainable_variables}
    caches = [np.stack(c.read_all()) for c in hooks.of(model).state._caches]
    assert len(saved) == len(ps_values) // 2  # Shards saved as whole variables.
    flat_saved = np.sort(np.concatenate([t.ravel() for t in saved.values()]))
    flat_ps = np.sort(np.concatenate([t.ravel() for t in ps_values.values()]))
    np.testing.assert_array_equal(flat_saved, flat_ps)
    # The caches moved away from the ps by their local updates: a checkpoint of
    # a cache would differ.
    flat_caches = [
        np.sort(np.concatenate([c[w].ravel() for c in caches])) for w in range(2)
    ]
    assert all(not np.array_equal(fc, flat_ps) for fc in flat_caches)


class _KillThenRestart(tf_keras.callbacks.Callback):
    """Kills worker 1 after epoch 1 and restarts it after epoch 2."""

    def __init__(self, local_cluster):
        super().__init__()
        self.local_cluster = local_cluster

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.local_cluster.kill("worker", 1, signal.SIGKILL)
        elif epoch == 1:
            self.local_cluster.restart("worker", 1)


@pytest.mark.slow
def test_restarted_worker_rejoins_and_fetches_first(local_cluster):
    (x, y), (x_test, y_test) = digits.load_data()
    model = _downpour_model(local_cluster)
    try:
        result = training.fit(
            model,
            training.dataset_creator(x, y, 32),
            epochs=5,
            steps_per_epoch=100,
            batch_size=32,
            callbacks=[_KillThenRestart(local_cluster)],
            print_fn=lambda _: None,
        )
    finally:
        if local_cluster.processes[("worker", 1)].poll() is not None:
            local_cluster.restart("worker", 1)
        wait_for_worker_recovery(model.distribute_strategy)
    assert [h["epoch"] for h in result.history] == [1, 2, 3, 4, 5]
    first, restarted = hooks.of(model).state.stats()
    # The steps worker 1 ran before the kill died with its process: the two
    # replicas' counters add up to fewer than the 500 steps of the run.
    assert first.steps + restarted.steps < 500
    # Its counters restarted with the process: it ran steps after the restart,
    # and its first one fetched (fetches = ceil(steps / n_fetch) only if so).
    assert restarted.steps > 0
    assert restarted.fetches == math.ceil(restarted.steps / N_FETCH)
    assert training.accuracy(model, x_test, y_test) >= 0.9
