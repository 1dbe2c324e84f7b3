"""Downpour `fit` in segments (`Downpour.run_steps`): exact semantics and counters."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.downpour import (
    BATCH_SIZE,
    STEPS,
    _ps_params,
    _simulate,
    _softmax_data,
    _softmax_model,
    _strategy,
)
from tf_distbelief import downpour
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import schedule as downpour_schedule


def _segments(num_steps, steps_per_execution, n_fetch, n_push):
    """Segments one replica runs: each ends at a fetch or push point or an end."""
    t, segments = 0, 0
    while t < num_steps:
        end = min(t + steps_per_execution, num_steps)
        while t < end:
            t += min(n_fetch - t % n_fetch, n_push - t % n_push, end - t)
            segments += 1
    return segments


def test_segment_count_helper():
    # n_fetch=3, n_push=2, 4 steps per function: [0 1] [2] [3] | [4 5] [6 7] |
    # [8] [9] [10 11].
    assert _segments(12, 4, 3, 2) == 8
    assert _segments(12, 12, 4, 4) == 3


@pytest.mark.parametrize(
    "n_fetch, n_push, steps_per_execution",
    [(3, 2, 4), (4, 4, 12), (2, 5, 1), (5, 3, 6)],
)
def test_fit_in_segments_matches_numpy_reference(
    local_cluster, n_fetch, n_push, steps_per_execution
):
    x, y, params = _softmax_data(seed=3)
    config = downpour_config.DownpourConfig(n_fetch, n_push, 0.05)
    model = _softmax_model(_strategy(local_cluster), params, steps_per_execution)
    replicas = downpour.install(model, config)
    assert replicas.runs_segments
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE).repeat()
    history = model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0)
    for got, want in zip(_ps_params(model), _simulate(params, x, y, config)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    (stats,) = replicas.stats()
    assert (stats.steps, stats.fetches, stats.pushes) == (
        STEPS,
        downpour_schedule.num_fetches(STEPS, n_fetch),
        downpour_schedule.num_pushes(STEPS, n_push),
    )
    assert int(replicas.update_count.numpy()) == stats.pushes
    assert int(model._train_counter.numpy()) == STEPS
    # The loss tracker saw the last batch of each segment only.
    tracker = model.compiled_loss._total_loss_mean
    segments = _segments(STEPS, steps_per_execution, n_fetch, n_push)
    assert int(tracker.count.numpy()) == segments * BATCH_SIZE
    assert set(history.history) == {"loss"}
    assert np.isfinite(history.history["loss"][0])


def test_fit_in_segments_two_workers_with_drops(local_cluster):
    x, y, params = _softmax_data(seed=4)
    config = downpour_config.DownpourConfig(4, 2, 0.01, max_staleness=0)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params, 6)
    replicas = downpour.install(model, config)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE).repeat()
    model.fit(dataset, epochs=2, steps_per_epoch=24, verbose=0)
    stats = replicas.stats()
    assert sum(s.steps for s in stats) == 48
    for s in stats:
        # Every second step ends with a push, applied or dropped; a drop
        # forces a fetch at the next segment, on top of every 4th step.
        assert s.pushes + s.dropped_pushes == downpour_schedule.num_pushes(s.steps, 2)
        assert s.fetches >= downpour_schedule.num_fetches(s.steps, 4)
    assert int(replicas.update_count.numpy()) == sum(s.pushes for s in stats)


def test_run_steps_needs_segments(local_cluster):
    x, y, params = _softmax_data()
    model = _softmax_model(_strategy(local_cluster), params)
    replicas = downpour.Downpour(
        model.distribute_strategy,
        model.trainable_variables,
        model.optimizer,
        downpour_config.DownpourConfig(1, 4),
    )
    assert not replicas.runs_segments
    with pytest.raises(ValueError, match=r"`run_steps` needs n_fetch > 1"):
        replicas.run_steps(None, 1, None)
