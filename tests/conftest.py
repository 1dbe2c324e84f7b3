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

from tests.fixtures.launch import (
    DOWNPOUR_LAUNCH_ARGS,
    KERAS3_LAUNCH_ARGS,
    LBFGS_REFERENCE_ITERS,
    LBFGS_REFERENCE_PORTIONS,
)
from tf_distbelief import cluster, paths, strategy  # noqa: E402

NUM_WORKERS = 3
NUM_PS = 3
# Each worker exposes 2 CPU devices, for model-parallel replicas (section 3).
CPU_DEVICES_PER_WORKER = 2


def pytest_configure(config):
    """Refuses `--dist loadgroup` with a pytest that makes xdist ignore its groups.

    The tests that share a session fixture (a launch of a minute or more) carry
    one `xdist_group` mark, so that one process runs them and the fixture once.
    pytest 9.2's structured node ids broke pytest-xdist 3.8's grouping (its
    group suffix on the node id no longer takes; pytest-xdist issue 1386):
    the marks were silently ignored, and CI ran those fixtures once per
    process. setup.py's `test` extra pins pytest below 9.2.
    """
    if config.getoption("dist", "no") != "loadgroup":
        return
    import xdist

    def minor(version):
        return tuple(int(part) for part in version.split(".")[:2])

    if minor(pytest.__version__) >= (9, 2) and minor(xdist.__version__) <= (3, 8):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} with pytest-xdist {xdist.__version__} "
            "ignores the xdist_group marks of `--dist loadgroup` (pytest-xdist "
            "issue 1386): install the versions setup.py's `test` extra pins "
            "(pip install -e '.[test]')."
        )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    """Puts the tests marked `slow` before the others, each part in its order.

    `--dist loadgroup` hands each test (or `xdist_group`) to the next free
    worker in collection order, after the groups: a test of half a minute
    collected near the end kept one worker busy while the other had nothing
    left. Run first, the slow tests are spread over both workers and the
    quick ones fill in at the end, so that the workers finish together.
    `trylast`, so that pytest's own grouping by module-scoped parameters
    comes first and is kept within each part.
    """
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("slow") is None)


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


@pytest.fixture(scope="session")
def downpour_launch_ps0_killed(tmp_path_factory):
    """One `launch/train.py` Downpour job whose ps 0 is SIGKILLed after its
    second checkpoint: `(returncode, stdout, stderr)`.

    `DOWNPOUR_LAUNCH_ARGS` with `--model_dir` and `--checkpoint_every_steps=20`.
    tests/faults/test_ps_recovery.py checks the recovery, tests/job/test_launch.py the
    Downpour progress lines and the test accuracy: one launch of about a minute
    (2 cores) serves both.
    """
    from tests.fixtures import ps_kill

    return ps_kill.run_ps0_killed_after_second_checkpoint(
        tmp_path_factory.mktemp("downpour_ps0_killed"), list(DOWNPOUR_LAUNCH_ARGS)
    )


@pytest.fixture(scope="session")
def keras3_launch_ps0_killed(tmp_path_factory):
    """One `launch/train.py --keras=3` job whose ps 0 is SIGKILLed after its
    second checkpoint: `(returncode, stdout, stderr, export_dir)`.

    `KERAS3_LAUNCH_ARGS` with `--model_dir`, `--checkpoint_every_steps=20` and
    `--export_dir`. tests/faults/test_ps_recovery.py checks the recovery,
    tests/keras3/test_keras3.py the training and the export: one launch (about
    35 s on 2 cores) serves both.
    """
    from tests.fixtures import ps_kill

    folder = tmp_path_factory.mktemp("keras3_ps0_killed")
    export_dir = folder / "export"
    return (
        *ps_kill.run_ps0_killed_after_second_checkpoint(
            folder, [*KERAS3_LAUNCH_ARGS, f"--export_dir={export_dir}"]
        ),
        export_dir,
    )


@pytest.fixture(scope="session")
def lbfgs_digits_reference(local_cluster, tmp_path_factory):
    """The Sandblaster checkpoint folder of an uninterrupted L-BFGS job.

    `train.py --model=digits --optimizer=lbfgs --portions=8 --lbfgs_max_iters=8`
    on 2 workers and 2 ps, run in this process (`job.train` on the shared
    cluster): the reference that the chief-loss and ps-loss launch tests
    (tests/sandblaster/test_sandblaster_resume.py,
    tests/faults/test_ps_recovery.py) must end at.
    """
    from tf_distbelief import demos, job
    from tf_distbelief.sandblaster import config as sandblaster_config

    model_dir = str(tmp_path_factory.mktemp("lbfgs_reference"))
    job.train(
        job.JobConfig(
            optimizer="lbfgs",
            model_dir=model_dir,
            sandblaster=sandblaster_config.SandblasterConfig(
                max_iters=LBFGS_REFERENCE_ITERS, portions=LBFGS_REFERENCE_PORTIONS
            ),
        ),
        demos.spec("digits"),
        local_cluster.resolver_for(num_workers=2, num_ps=2),
        print_fn=lambda line: None,
    )
    return paths.sandblaster_dir(model_dir)


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """A pip install of the checkout (`tests/fixtures/install.py`): its
    `target`, an `empty` folder to run in, the `env` that finds tf_distbelief
    there only, and its `command`.

    The tests that use it carry `xdist_group("install")`, so that one process
    installs once.
    """
    pytest.importorskip("setuptools")
    from tests.fixtures import install

    return install.pip_install_checkout(tmp_path_factory.mktemp("install"))


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
