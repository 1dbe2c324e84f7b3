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

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tests.test_launch import ROOT, _env
from tf_distbelief import sandblaster
from tf_distbelief.sandblaster import objective as objective_lib
from tf_distbelief.sandblaster import schedule as schedule_lib

STALL_SECS = 5

CHILD = textwrap.dedent(
    f"""
    import threading

    import numpy as np

    from tests import stragglers
    from tests.test_sandblaster import CE, _digits_train, _logistic_model
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
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        cwd=ROOT,
        env=_env(f"sandblaster-exit-{os.getpid()}"),
        capture_output=True,
        text=True,
        timeout=240,
    )
    secs = time.monotonic() - start
    assert "first evaluation: loss" in done.stdout, done.stderr[-3000:]
    assert "second evaluation returned" not in done.stdout
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.rstrip().splitlines()[-1]
    assert last.startswith("TimeoutError: Sandblaster: no copy of a work portion"), last
    assert f"within {STALL_SECS} s (`stall_timeout_secs`)" in last
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


class _FakeRemote:
    """A `RemoteValue` whose `fetch` waits until `finish` (a worker back)."""

    def __init__(self, hang: bool):
        self.finished = threading.Event()
        if not hang:
            self.finished.set()

    def fetch(self):
        self.finished.wait()
        # Loss share 0.25 (float64 bits), worker 0, incarnation 7.
        return np.array([np.float64(0.25).view(np.int64), 0, 7], np.int64)


class _FakeCoordinator:
    """Runs each portion at once, except those in `hang` (a worker gone)."""

    def __init__(self):
        self.hang, self.remotes = set(), []

    def schedule(self, fn, args):
        del fn
        portion = int(args[0].numpy()[0])
        self.remotes.append(_FakeRemote(portion in self.hang))
        return self.remotes[-1]

    def workers_back(self):
        self.hang = set()
        for remote in self.remotes:
            remote.finished.set()


def _objective_on_fake_cluster(portions=4, num_workers=1):
    """A `SandblasterObjective`'s coordinator side, on `_FakeCoordinator`."""
    obj = object.__new__(objective_lib.SandblasterObjective)
    obj.stall_timeout_secs = 0.5
    obj.portions, obj.backup_tasks, obj.num_workers = portions, False, num_workers
    obj.stats = sandblaster.SandblasterStats()
    obj._slot_pool = schedule_lib.SlotPool(portions + 2 * num_workers)
    obj._in_flight, obj._eval_id, obj._ledger = {}, 0, None
    obj.coordinator, obj.portion_function = _FakeCoordinator(), None
    obj._x_eval = obj.grad = object()
    obj._reduce = lambda slots, workers: [7] * num_workers
    return obj


def test_an_evaluation_after_a_timeout_gets_every_slot_back():
    # 3 of 4 portions accepted, the 4th's worker gone: TimeoutError. Before the
    # fix the 3 accepted slots were never released, so once the workers were
    # back the next evaluation found no free slot and raised at once
    # ("Waited for 0 copies"), and every one after it too.
    obj = _objective_on_fake_cluster()
    obj.coordinator.hang = {3}
    with pytest.raises(TimeoutError, match=r"\(evaluation, portion\): \[\(1, 3\)\]"):
        obj(obj._x_eval)
    assert obj._slot_pool.num_free == obj._slot_pool.num_slots - 1  # (1, 3) runs.
    obj.coordinator.workers_back()
    for _ in range(3):
        loss, _ = obj(obj._x_eval)
        assert loss == 1.0
    assert obj._slot_pool.num_free == obj._slot_pool.num_slots
    assert obj.stats.evaluations == 3
    assert obj.stats.copies_discarded == 1  # The late (1, 3).


def test_a_late_copy_of_a_failed_evaluation_is_discarded():
    # Before the fix `join` accepted the late copy into the failed evaluation's
    # ledger: counted in `copies_accepted`, its slot never released.
    obj = _objective_on_fake_cluster()
    obj.coordinator.hang = {3}
    with pytest.raises(TimeoutError):
        obj(obj._x_eval)
    obj.coordinator.workers_back()
    obj.join()
    assert obj._slot_pool.num_free == obj._slot_pool.num_slots
    assert (obj.stats.copies_accepted, obj.stats.copies_discarded) == (3, 1)
