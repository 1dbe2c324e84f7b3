"""Shared fixtures: one local cluster per pytest process.

Connecting the test process to a second cluster works but stalls for tens of
seconds while TensorFlow closes the old remote contexts, and reconnecting with
another cluster spec needs a new chief port, so every test that needs a cluster
shares one and makes its strategy from `local_cluster.resolver_for(...)`
(TensorFlow's own tests share one cluster per class). Tests that kill a task
restart it (`LocalCluster.restart`) before they return.
"""

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from tf_distbelief import cluster, strategy  # noqa: E402

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


@pytest.fixture(autouse=True)
def _earlier_coordinators_idle():
    """Waits until the ClusterCoordinators of earlier tests have no work in flight.

    Every test connects this process to the shared cluster anew (a new
    strategy); `DistBeliefStrategy` waits too, but a test may use TensorFlow's
    own strategy.
    """
    busy = strategy.wait_for_idle_coordinators()
    if busy:
        warnings.warn(f"ClusterCoordinator threads still busy: {busy}", stacklevel=1)
    yield
