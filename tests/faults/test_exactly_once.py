"""Exactly-once step accounting (issue 10): a worker lost mid-step is retried
by the ClusterCoordinator, and no step is applied twice."""

import signal
import threading
import time

import numpy as np
import pytest

import models
from models import digits
from tests.fixtures.helpers import wait_for_worker_recovery
from tf_distbelief import job
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.downpour import DownpourConfig
from tf_distbelief.fit import training

# Steps per `fit` call; calls go on until worker 1 was killed KILLS times
# (each restart takes ~5 s, during which worker 0 trains alone). Without
# exactly-once accounting, 4 kills applied a step twice in the runs tried.
STEPS = 500
KILLS = 4


class _KillAndRestart(threading.Thread):
    """SIGKILLs worker 1 and restarts it, `KILLS` times while steps run.

    A thread, so that each kill lands at a random point of a step in flight
    on worker 1 (fit schedules far ahead of the workers).
    """

    def __init__(self, local_cluster, strategy):
        super().__init__(daemon=True)
        self.local_cluster = local_cluster
        self.strategy = strategy
        self.kills = 0

    def run(self):
        for _ in range(KILLS):
            wait_for_worker_recovery(self.strategy)  # Worker 1 back, stepping.
            time.sleep(1.0)
            self.local_cluster.kill("worker", 1, signal.SIGKILL)
            self.kills += 1
            self.local_cluster.restart("worker", 1)


def _model(local_cluster, downpour):
    config = job.JobConfig(
        num_workers=2,
        num_ps=1,
        steps_per_execution=1,
        downpour=downpour,
    )
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(2, 1))
    return job.compile_model(config, strategy, models.spec("digits"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "downpour",
    [None, DownpourConfig(n_fetch=1, n_push=1)],
    ids=["stock", "downpour"],
)
def test_worker_kills_never_apply_a_step_twice(local_cluster, downpour):
    (x, y), _ = digits.load_data()
    model = _model(local_cluster, downpour)
    killer = _KillAndRestart(local_cluster, model.distribute_strategy)
    calls = 0
    try:
        killer.start()
        while calls == 0 or killer.is_alive():
            training.fit(
                model,
                training.dataset_creator(x, y, 32),
                epochs=1,
                steps_per_epoch=STEPS,
                batch_size=32,
                print_fn=lambda _: None,
            )
            calls += 1
    finally:
        killer.join()
        if local_cluster.processes[("worker", 1)].poll() is not None:
            local_cluster.restart("worker", 1)
        wait_for_worker_recovery(model.distribute_strategy)
    assert killer.kills == KILLS
    assert int(model.optimizer.iterations.numpy()) == calls * STEPS
    if downpour is not None:
        # Every step pushes once (n_push=1): the ps counts each step's push.
        assert int(model.downpour.update_count.numpy()) == calls * STEPS
    assert np.all([np.isfinite(w.numpy()).all() for w in model.weights])
