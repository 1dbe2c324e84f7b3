"""Steps with no worker to run them: a bounded wait that names the workers.

TensorFlow's `ClusterCoordinator` keeps a lost worker's steps queued until a
worker serves again; with every worker gone for good, `fit` waited for ever.
`step_watch.StepWatch` (started by every `DistBeliefStrategy`) fails the
waiting `schedule`/`join` after `step_stall_timeout_secs` with none finished.

The child process trains on a real local cluster of 1 worker and 1 ps (the
digits model and data): steps that keep finishing, and an idle chief, longer
than the limit, are no stall; then the worker is killed and `fit` must raise
`StepStallError` naming it, having said every second (the report interval,
shortened here) what it waits for; the worker restarted, the same strategy
and model train again. A Sandblaster evaluation whose work portions outlast
the limit is no stall either: its objective bounds its own waits.
"""

from __future__ import annotations

import re
import textwrap
import time

import numpy as np
import pytest

from benchmarks import stragglers
from tests.fixtures.launch import _run_child
from tests.fixtures.sandblaster import (
    CE,
    _digits_train,
    _full_batch_grad,
    _logistic_model,
)
from tf_distbelief import sandblaster
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.job import config as job_config

# Longer than a digits step's first trace on a loaded 2-core CI machine.
STALL_SECS = 6

CHILD = textwrap.dedent(
    f"""
    import time

    from tf_distbelief import demos
    from tf_distbelief.demos import digits
    from tf_distbelief import cluster, console, job
    from tf_distbelief.faults import step_watch
    from tf_distbelief.fit import training
    from tf_distbelief import strategy as strategy_lib

    step_watch._REPORT_EVERY_SECS = 1.0

    def work():
        (x, y), _ = digits.load_data()
        data = training.dataset_creator(x, y, 32)
        with cluster.LocalCluster(num_workers=1, num_ps=1) as local:
            strategy = strategy_lib.DistBeliefStrategy(
                local.resolver_for(num_workers=1, num_ps=1),
                step_stall_timeout_secs={STALL_SECS},
            )
            config = job.JobConfig(num_workers=1, num_ps=1)
            model = job.compile_model(config, strategy, demos.spec("digits"))
            start = time.monotonic()
            while time.monotonic() - start < 2 * {STALL_SECS}:
                model.fit(data, epochs=1, steps_per_epoch=50, verbose=0)
            time.sleep({STALL_SECS} + 2)  # Idle: no step waits.
            print(f"trained and idle, stalls: {{strategy.step_watch.stalls}}",
                  flush=True)
            local.kill("worker", 0)
            killed = time.monotonic()
            try:
                model.fit(data, epochs=1, steps_per_epoch=50, verbose=0)
                print("fit without a worker returned", flush=True)
            except step_watch.StepStallError as e:
                secs = time.monotonic() - killed
                print(f"stalled after {{secs:.1f}} s: {{e}}", flush=True)
            local.restart("worker", 0)
            model.fit(data, epochs=1, steps_per_epoch=50, verbose=0)
            print(f"trained again, stalls: {{strategy.step_watch.stalls}}", flush=True)

    console.exit_when_done(work)
    """
)


@pytest.mark.slow
def test_fit_without_workers_fails_naming_them_and_trains_once_they_are_back():
    done = _run_child(CHILD, "step-watch", timeout_secs=300)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, err[-3000:]
    assert "trained and idle, stalls: 0" in out, err[-3000:]
    assert "fit without a worker returned" not in out
    stalled = re.search(r"stalled after ([\d.]+) s: (.*)", out)
    assert stalled, (out + err)[-3000:]
    assert STALL_SECS <= float(stalled[1]) < STALL_SECS + 30
    message = stalled[2]
    assert message.startswith("No step scheduled on the workers finished in "), message
    assert f"--step_stall_timeout_secs={STALL_SECS}); " in message
    assert re.search(
        r"not accepting connections: /job:worker/task:0 at [\d.]+:\d+\.", message
    )
    assert "rerun with the same --model_dir" in message
    report = re.search(
        r"waiting for a worker to run the scheduled steps: none finished "
        rf"for \d+ s of {STALL_SECS} s \(\d+ waiting\); not accepting connections: "
        r"/job:worker/task:0 at ",
        err,
    )
    assert report, err[-3000:]
    assert "trained again, stalls: 1" in out, err[-3000:]


@pytest.mark.slow
def test_a_sandblaster_evaluation_longer_than_the_limit_is_not_a_stall(local_cluster):
    """2 portions of 2.5 s each on 1 worker, with a 1 s step limit: the objective
    suspends the watch during an evaluation (it bounds its own waits, with
    `stall_timeout_secs`), and the evaluation is exact."""
    x, y = _digits_train()
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=1), step_stall_timeout_secs=1
    )
    objective = sandblaster.SandblasterObjective(
        strategy,
        _logistic_model(),
        CE,
        x,
        y,
        portions=2,
        backup_tasks=False,
        portion_delay_fn=stragglers.slow_worker(0, straggler_delay_secs=2.5),
    )
    w = np.random.default_rng(0).normal(size=650) * 0.1
    start = time.monotonic()
    loss, grad = objective(objective.ops.from_numpy(w))
    assert time.monotonic() - start >= 5.0  # No step finished for 2.5 s, twice.
    ref_loss, ref_grad = _full_batch_grad(w, x, y)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    got = objective.ops.to_numpy(grad)
    assert np.linalg.norm(got - ref_grad) <= 1e-12 * np.linalg.norm(ref_grad)
    assert strategy.step_watch.stalls == 0
    objective.close()


@pytest.mark.parametrize("secs", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_step_stall_timeout_is_refused_before_any_cluster(secs):
    rule = "`step_stall_timeout_secs` must be a finite number of seconds > 0"
    with pytest.raises(ValueError, match=rule):
        strategy_lib.DistBeliefStrategy(None, step_stall_timeout_secs=secs)


@pytest.mark.parametrize("secs", [0, -5, float("inf")])
def test_job_config_refuses_a_bad_step_stall_timeout(secs):
    rule = "`step_stall_timeout_secs` must be a finite number of seconds > 0"
    with pytest.raises(job_config.errors.ConfigError, match=rule):
        job_config.JobConfig(step_stall_timeout_secs=secs).validate()
