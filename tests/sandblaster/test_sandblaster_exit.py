"""Sandblaster when no worker is left: a bounded wait, then a process that ends.

The `ClusterCoordinator` keeps a lost worker's work portions queued until a
worker can run them, so an objective evaluation with every worker gone would
wait for ever; `SandblasterObjective` gives up after `stall_timeout_secs`
with a `TimeoutError` naming the portions (a hang is a bug). The process must
then end: the threads waiting on the lost portions are daemon threads. Seen
before the fix: `benchmarks/sandblaster_bench.py` hung at exit after an
evaluation gave up, Python joining the objective's `ThreadPoolExecutor`
threads, whose `RemoteValue.fetch` never returned, until it was killed 11
minutes later.

The child process runs a real local cluster of 1 worker and 1 ps, evaluates
once, kills the worker (never restarted) and evaluates again; it ends with the
error, without `os._exit` (`console.exit_when_done`, which launch scripts and
benchmarks also use, is tested in `test_console`).
"""

from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest

from tests.fixtures.launch import _run_child
from tf_distbelief import sandblaster
from tf_distbelief.sandblaster import objective as objective_lib

STALL_SECS = 5


CHILD = textwrap.dedent(
    f"""
    import threading

    import numpy as np

    from benchmarks import stragglers
    from tests.fixtures.sandblaster import CE, _digits_train, _logistic_model
    from tf_distbelief import cluster
    from tf_distbelief import strategy as strategy_lib
    from tf_distbelief.sandblaster import objective

    def work():
        x, y = _digits_train()
        with cluster.LocalCluster(num_workers=1, num_ps=1, max_restarts=0) as local:
            strategy = strategy_lib.DistBeliefStrategy(
                local.resolver_for(num_workers=1, num_ps=1)
            )
            obj = objective.SandblasterObjective(
                strategy,
                _logistic_model(),
                CE,
                x,
                y,
                portions=4,
                backup_tasks=False,
                # 1 s per portion: the worker is killed with portions running.
                portion_delay_fn=stragglers.slow_worker(0, straggler_delay_secs=1.0),
                stall_timeout_secs={STALL_SECS},
            )
            point = obj.ops.from_numpy(obj.layout.read())
            loss, _ = obj(point)
            print(f"first evaluation: loss {{loss:.6f}}", flush=True)
            threading.Timer(1.5, local.kill, ("worker", 0)).start()
            obj(point)
            print("second evaluation returned", flush=True)

    work()
    """
)


@pytest.mark.slow
def test_evaluation_without_workers_times_out_and_the_process_ends():
    start = time.monotonic()
    done = _run_child(CHILD, "sandblaster-exit", timeout_secs=240)
    secs = time.monotonic() - start
    assert "first evaluation: loss" in done.stdout, done.stderr[-3000:]
    assert "second evaluation returned" not in done.stdout
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith("TimeoutError: Sandblaster: no copy of a work portion"), last
    assert f"within {STALL_SECS} s (`stall_timeout_secs`, launch flag" in last
    # The portions of evaluation 2 not finished when the worker died.
    assert "(evaluation, portion): [(2, " in last
    assert "on 1 workers" in last
    assert "still running" in done.stderr  # `_settle` named what it left behind.
    assert secs < 200


@pytest.mark.parametrize("secs", [0, -1.0, float("nan"), float("inf"), "5", True])
def test_stall_timeout_must_be_positive_seconds(secs):
    x, y = np.zeros((4, 2)), np.zeros(4)
    rule = "`stall_timeout_secs` must be a finite number of seconds > 0"
    with pytest.raises(ValueError, match=rule):
        objective_lib.SandblasterObjective(
            None, None, None, x, y, 2, stall_timeout_secs=secs
        )


@pytest.mark.parametrize("secs", [0, -5, float("inf"), None])
def test_config_refuses_a_bad_stall_timeout(secs):
    rule = "`stall_timeout_secs` must be a finite number of seconds > 0"
    with pytest.raises(ValueError, match=rule):
        sandblaster.SandblasterConfig(stall_timeout_secs=secs)
    assert sandblaster.SandblasterConfig().stall_timeout_secs == 600.0


# --- After a TimeoutError: the failed evaluation's slots come back -----------

RECOVER_CHILD = textwrap.dedent(
    """
    import threading
    import time

    import numpy as np

    from benchmarks import stragglers
    from tests.fixtures.sandblaster import (
        CE, _digits_train, _logistic_model, numpy_fun_and_grad,
    )
    from tf_distbelief import cluster
    from tf_distbelief import strategy as strategy_lib
    from tf_distbelief.sandblaster import objective

    PORTIONS = 4
    x, y = _digits_train()
    with cluster.LocalCluster(num_workers=1, num_ps=1) as local:
        strategy = strategy_lib.DistBeliefStrategy(
            local.resolver_for(num_workers=1, num_ps=1)
        )
        obj = objective.SandblasterObjective(
            strategy, _logistic_model(), CE, x, y, portions=PORTIONS,
            backup_tasks=False,
            # 0.5 s per portion: the worker is killed once one was accepted.
            portion_delay_fn=stragglers.slow_worker(0, straggler_delay_secs=0.5),
            stall_timeout_secs=120.0,
        )
        w = np.random.default_rng(0).normal(size=obj.layout.size) * 0.01
        point = obj.ops.from_numpy(w)
        ref_loss, ref_grad = numpy_fun_and_grad(x, y, PORTIONS)(w)
        obj(point)  # Traces and warms up.
        accepted = obj.stats.copies_accepted
        obj.stall_timeout_secs = 3.0

        def kill_after_one_accepted():
            # Portions take 0.5 s each: the next one is still running.
            deadline = time.monotonic() + 60
            while obj.stats.copies_accepted == accepted:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            local.kill("worker", 0)

        threading.Thread(target=kill_after_one_accepted, daemon=True).start()
        try:
            obj(point)
        except TimeoutError:
            print("accepted before the timeout:",
                  obj.stats.copies_accepted - accepted, flush=True)
        local.restart("worker", 0)
        obj.stall_timeout_secs = 120.0  # The worker reconnects meanwhile.
        for _ in range(2):
            loss, grad = obj(point)
            np.testing.assert_allclose(obj.ops.to_numpy(grad), ref_grad, rtol=1e-10)
            assert abs(loss - ref_loss) <= 1e-12 * abs(ref_loss), (loss, ref_loss)
        obj.join()
        print("evaluations after the restart: exact", flush=True)
        print("free slots:", obj._slot_pool.num_free, "of", obj._slot_pool.num_slots,
              flush=True)
        print("discarded:", obj.stats.copies_discarded, flush=True)
    """
)


@pytest.mark.slow
def test_evaluations_after_a_timeout_are_exact_and_get_every_slot_back():
    # Before the fix the slots of the portions accepted before the timeout were
    # never released, and a copy of the failed evaluation finishing after the
    # worker's restart was accepted into its ledger.
    done = _run_child(RECOVER_CHILD, "sandblaster-recover", timeout_secs=300)
    assert done.returncode == 0, done.stderr[-3000:]
    accepted = int(done.stdout.split("accepted before the timeout: ")[1].split()[0])
    assert 1 <= accepted <= 3, done.stdout
    assert "evaluations after the restart: exact" in done.stdout
    free = done.stdout.split("free slots: ")[1].split()
    assert free[0] == free[2], done.stdout  # Every slot free.
    # The copies of the failed evaluation that ran on: finished, not accepted.
    assert int(done.stdout.split("discarded: ")[1].split()[0]) >= 1, done.stdout
