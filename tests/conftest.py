"""Shared fixtures: one local cluster per pytest process.

Connecting the test process to a second cluster works but stalls for tens of
seconds while TensorFlow closes the old remote contexts, and reconnecting with
another cluster spec needs a new chief port, so every test that needs a cluster
shares one and makes its strategy from `local_cluster.resolver_for(...)`
(TensorFlow's own tests share one cluster per class). Tests that kill a task
restart it (`LocalCluster.restart`) before they return.
"""

import os
import sys
import threading
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from tf_distbelief import cluster  # noqa: E402

NUM_WORKERS = 3
NUM_PS = 3
# Each worker exposes 2 CPU devices, for model-parallel replicas (section 3).
CPU_DEVICES_PER_WORKER = 2


@pytest.fixture(scope="session")
def local_cluster():
    """A running `LocalCluster` of 3 workers (2 CPU devices each) and 3 ps tasks.

    Make each strategy with `local_cluster.resolver_for(num_workers, num_ps)`.
    """
    with cluster.LocalCluster(
        num_workers=NUM_WORKERS,
        num_ps=NUM_PS,
        cpu_devices_per_worker=CPU_DEVICES_PER_WORKER,
    ) as local:
        yield local


@pytest.fixture
def clean_tf_config(monkeypatch):
    """Removes `TF_CONFIG` for the test."""
    monkeypatch.delenv("TF_CONFIG", raising=False)


# How long a test waits for earlier tests' coordinator threads to go idle.
_IDLE_TIMEOUT_SECS = 60.0


def _busy_coordinator_threads() -> list[str]:
    """Names of ClusterCoordinator threads that are not waiting for work.

    A worker thread waits in `_CoordinatedClosureQueue.get` when idle; the
    failure handler waits on an event. Anything else is work in flight: a
    per-worker resource (variable, iterator) being created, a scheduled
    function, or a worker being reconnected (`update_server_def`).
    """
    frames = sys._current_frames()
    busy = []
    for thread in threading.enumerate():
        frame, stack = frames.get(thread.ident), []
        while frame is not None:
            stack.append(frame.f_code.co_name)
            frame = frame.f_back
        for loop, idle in (("_process_queue", "get"), ("_preemption_handler", "wait")):
            if loop in stack:
                i = stack.index(loop)
                if i == 0 or stack[i - 1] != idle:
                    busy.append(thread.name)
    return busy


@pytest.fixture(autouse=True)
def _earlier_coordinators_idle():
    """Waits until the ClusterCoordinators of earlier tests have no work in flight.

    Every test connects this process to the shared cluster anew (a new
    strategy). A per-worker resource an earlier coordinator was still creating
    at that moment (an iterator a finished `fit` had queued for a worker that
    got no step, or the caches of a trace that failed) crashed the process
    with SIGSEGV inside TensorFlow. TensorFlow offers no public wait for them
    (`ClusterCoordinator.join` waits for scheduled functions only), so this
    looks at the threads' stacks.
    """
    deadline = time.monotonic() + _IDLE_TIMEOUT_SECS
    quiet = 0
    while quiet < 2:  # Idle at two looks in a row, not between two closures.
        busy = _busy_coordinator_threads()
        if not busy:
            quiet += 1
        else:
            quiet = 0
            if time.monotonic() > deadline:
                warnings.warn(
                    f"ClusterCoordinator threads still busy after "
                    f"{_IDLE_TIMEOUT_SECS:g} s: {busy}",
                    stacklevel=1,
                )
                break
        time.sleep(0.05)
    yield
