"""Sandblaster when a worker is lost holding accepted gradient slots (§4.2).

Each worker keeps the gradients of the portions it ran in slots of its own
(`sandblaster.objective`); they reach the ps only in the reduction at the end
of the evaluation. A worker lost between its copies' acceptance and that
reduction takes them with it: the evaluation must run again and return the
exact gradient, never one with portions missing or read from a rebuilt
worker's empty slots.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import tensorflow as tf

from benchmarks import stragglers
from tests.fixtures.sandblaster import (
    CE,
    _digits_train,
    _logistic_model,
    _strategy,
    numpy_fun_and_grad,
)
from tf_distbelief.sandblaster import objective as objective_lib

PORTIONS = 8


def _objective_and_reference(local_cluster, seed, **kwargs):
    """A logistic-regression objective on 2 workers and 2 ps, a point (seed)
    and NumPy's loss and gradient there."""
    x, y = _digits_train()
    strategy = _strategy(local_cluster, num_workers=2, num_ps=2)
    objective = objective_lib.SandblasterObjective(
        strategy, _logistic_model(), CE, x, y, portions=PORTIONS, **kwargs
    )
    w = np.random.default_rng(seed).normal(size=objective.layout.size) * 0.01
    return objective, objective.ops.from_numpy(w), numpy_fun_and_grad(x, y, PORTIONS)(w)


@pytest.mark.slow
def test_worker_lost_before_the_reduction_reruns_the_evaluation(local_cluster, caplog):
    objective, point, (ref_loss, ref_grad) = _objective_and_reference(
        local_cluster,
        seed=0,
        backup_tasks=False,
        # Worker 0 sleeps 0.2 s after each portion, so worker 1 surely runs
        # (and holds the accepted slots of) some of them.
        portion_delay_fn=stragglers.slow_worker(0, straggler_delay_secs=0.2),
    )
    loss, grad = objective(point)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(objective.ops.to_numpy(grad), ref_grad, rtol=1e-10)

    reduce = objective._reduce
    held_by = []

    def restart_worker_1_then_reduce(slots, workers):
        objective._reduce = reduce  # Once.
        held_by.extend(workers)
        local_cluster.restart("worker", 1)
        return reduce(slots, workers)

    objective._reduce = restart_worker_1_then_reduce
    with caplog.at_level(logging.WARNING):
        loss, grad = objective(point)
    assert 1 in held_by
    assert "lost gradient slots" in caplog.text
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(objective.ops.to_numpy(grad), ref_grad, rtol=1e-10)
    assert objective.stats.evaluations == 2
    assert objective.stats.copies_accepted == 3 * PORTIONS  # One rerun.
    objective.close()


# What the reduction raised in CI when worker 1 restarted: the reduction runs on
# the ps, so the message names ps task 0 as the relay of the worker's error.
_RELAYED_BY_PS = (
    "RecvTensor expects a different device incarnation: 1 vs. 2. Your worker "
    'job ("/job:worker/replica:0/task:1") was probably restarted.\n'
    "Additional GRPC error information from remote target "
    "/job:ps/replica:0/task:0/device:CPU:0 while calling "
    "/tensorflow.eager.EagerService/RunComponentFunction"
)


@pytest.mark.slow
def test_worker_error_relayed_by_a_live_ps_reruns(local_cluster, caplog):
    objective, point, (ref_loss, ref_grad) = _objective_and_reference(
        local_cluster, seed=1, backup_tasks=False
    )
    reduce = objective._reduce

    def relayed_error_once(slots, workers):
        objective._reduce = reduce
        raise tf.errors.AbortedError(None, None, _RELAYED_BY_PS)

    objective._reduce = relayed_error_once
    with caplog.at_level(logging.WARNING):
        loss, grad = objective(point)
    assert "AbortedError: RecvTensor expects" in caplog.text
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    np.testing.assert_allclose(objective.ops.to_numpy(grad), ref_grad, rtol=1e-10)
    assert objective.stats.evaluations == 1

    objective.close()
