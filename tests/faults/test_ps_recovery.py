"""ps failure recovery (issue 10): a SIGKILLed ps task costs the steps since
the last checkpoint, not the job.

The slow tests run `launch/train.py` on its local cluster (which restarts a
lost task on its address) and SIGKILL a ps task found by the marker in its
environment and its `TF_CONFIG`.
"""

import functools
import os
import re
import socket
import threading
import time
import uuid

import pytest
import tensorflow as tf

from tests.fixtures import launch
from tests.fixtures.launch import ROOT
from tests.fixtures.ps_kill import (
    _kill_ps0_when,
    run_ps0_killed_after_second_checkpoint,
    start_job,
)
from tests.fixtures.sandblaster import _VALUE, _latest_iteration, _relative_errors
from tf_distbelief import job, paths
from tf_distbelief.cluster.local import local_cluster as local_lib
from tf_distbelief.faults import recovery

TRAIN = os.path.join(ROOT, "launch", "train.py")


def _accuracy(output):
    return float(re.findall(r"^test accuracy: ([0-9.]+)$", output, re.M)[-1])


@pytest.mark.slow
@pytest.mark.parametrize(
    "job",
    [
        pytest.param(
            "stock", marks=pytest.mark.xdist_group("downpour_launch_ps0_killed")
        ),
        pytest.param(
            "downpour", marks=pytest.mark.xdist_group("downpour_launch_ps0_killed")
        ),
        pytest.param(
            "keras3-stock", marks=pytest.mark.xdist_group("keras3_launch_ps0_killed")
        ),
        "keras3-downpour",
    ],
)
def test_ps_killed_after_the_second_checkpoint_is_recovered(request, tmp_path, job):
    """Stock: `--model=digits --num_workers=2 --num_ps=2` (5 epochs). Downpour:
    the job tests/job/test_launch.py's Downpour test checks too (one launch,
    `conftest.downpour_launch_ps0_killed`; 1,000 steps for 0.95). The same
    two with `--keras=3`: the stock one is the launch tests/keras3's export
    test checks too (`conftest.keras3_launch_ps0_killed`); the Downpour one
    is the Keras 3 Downpour digits run (2 workers, 2 ps, 1,000 steps)."""
    downpour = job.endswith("downpour")
    if job == "downpour":
        code, out, err = request.getfixturevalue("downpour_launch_ps0_killed")
    elif job == "keras3-stock":
        code, out, err, _ = request.getfixturevalue("keras3_launch_ps0_killed")
    elif job == "keras3-downpour":
        code, out, err = run_ps0_killed_after_second_checkpoint(
            tmp_path, ["--keras=3", *launch.DOWNPOUR_LAUNCH_ARGS]
        )
    else:
        code, out, err = run_ps0_killed_after_second_checkpoint(
            tmp_path, ["--model=digits", "--num_workers=2", "--num_ps=2"]
        )
    assert code == 0, err[-3000:]
    # TensorFlow's log of the failed closures (the gRPC chain, about 60
    # lines) is kept off the console: the job's own line names the loss.
    assert "cluster_coordinator.py" not in err, err[-3000:]
    # The line lists every task the error named (ps 1 too, at times): ps 0
    # must be among them, with its address.
    lost = re.search(
        r"^ps task lost: (?:\S+ at \S+, )*/job:ps/task:0 at 127\.0\.0\.1:(\d+)[ ,]",
        out,
        re.M,
    )
    assert lost, out
    assert re.search(
        rf"^local cluster: ps:0 at 127\.0\.0\.1:{lost[1]} exited \(code -9\); "
        "restarted on the same address, serving after",
        out,
        re.M,
    )
    restored = re.search(
        r"^restored ckpt-(\d+) \(step \1\): \d+ values equal the checkpoint bit "
        "for bit",
        out,
        re.M,
    )
    assert restored and int(restored[1]) >= 40, out
    assert re.search(rf"^Resumed from .*ckpt-{restored[1]} at step", out, re.M)
    epochs = 10 if downpour else 5
    assert re.search(
        rf"^epoch {epochs}/{epochs}: steps {epochs * 100}/{epochs * 100} ", out, re.M
    ), out
    assert _accuracy(out) >= 0.95
    if job == "keras3-downpour":
        # Each replica's counters came back with the checkpoint: the steps
        # add up to the job's, and each replica pushed every 4th step.
        summary = re.search(
            r"^downpour: 2 replicas, [\d,]+ steps \(([\d,]+), ([\d,]+)\), "
            r"[\d,]+ pushes \(([\d,]+), ([\d,]+)\),",
            out,
            re.M,
        )
        assert summary, out
        counts = [int(n.replace(",", "")) for n in summary.groups()]
        stats = [(counts[0], counts[2]), (counts[1], counts[3])]
        assert sum(steps for steps, _ in stats) == epochs * 100
        assert all(pushes == steps // 4 for steps, pushes in stats)


@pytest.mark.slow
@pytest.mark.xdist_group("lbfgs_digits_reference")
def test_ps_killed_during_sandblaster_resumes_to_the_uninterrupted_result(
    lbfgs_digits_reference, tmp_path
):
    """`train.py --optimizer=lbfgs --model_dir=D`, ps 0 SIGKILLed after the
    L-BFGS checkpoint of iteration 3: the chief recovers in the same process,
    resumes from that checkpoint and ends where an uninterrupted run ends (the
    reference, `conftest.lbfgs_digits_reference`, runs the same job in this
    process, for tests/sandblaster/test_sandblaster_resume.py's chief-loss test too)."""
    total = launch.LBFGS_REFERENCE_ITERS
    marker = uuid.uuid4().hex
    checkpoints = paths.sandblaster_dir(str(tmp_path / "model"))
    proc = start_job(
        [
            "--model=digits",
            "--optimizer=lbfgs",
            f"--portions={launch.LBFGS_REFERENCE_PORTIONS}",
            f"--lbfgs_max_iters={total}",
            "--num_workers=2",
            "--num_ps=2",
            f"--model_dir={tmp_path / 'model'}",
        ],
        marker,
        tmp_path,
    )
    code, out, err = _kill_ps0_when(
        proc, marker, tmp_path, lambda: _latest_iteration(checkpoints) >= 3
    )
    assert code == 0, err[-3000:]
    # TensorFlow's log of the failed closures (the gRPC chain, about 60
    # lines) is kept off the console: the job's own line names the loss.
    assert "cluster_coordinator.py" not in err, err[-3000:]
    # The line lists every task the error named (ps 1 too, at times): ps 0
    # must be among them, with its address.
    lost = re.search(
        r"^ps task lost: (?:\S+ at \S+, )*/job:ps/task:0 at 127\.0\.0\.1:(\d+)[ ,]",
        out,
        re.M,
    )
    assert lost, out
    assert re.search(
        rf"^local cluster: ps:0 at 127\.0\.0\.1:{lost[1]} exited \(code -9\); "
        "restarted on the same address, serving after",
        out,
        re.M,
    )
    recovered = re.search(
        r"^ps recovery 1: serving again after [0-9.]+ s; restoring every ps "
        r"variable and slot from ckpt-(\d+) \(iteration \1\)$",
        out,
        re.M,
    )
    assert recovered and 3 <= int(recovered[1]) < total, out
    assert re.search(
        rf"^Resumed L-BFGS from .*ckpt-{recovered[1]} at iteration {recovered[1]} ",
        out,
        re.M,
    ), out
    assert re.search(rf"^lbfgs: {total} iterations", out, re.M), out
    want = tf.train.load_checkpoint(tf.train.latest_checkpoint(lbfgs_digits_reference))
    got = tf.train.load_checkpoint(tf.train.latest_checkpoint(checkpoints))
    assert got.get_tensor("num_iters" + _VALUE) == total
    for key in ("x", "loss_history", "step_history"):
        a, b = got.get_tensor(key + _VALUE), want.get_tensor(key + _VALUE)
        assert a.shape == b.shape, key
        assert _relative_errors([a], [b])[0] <= 1e-9, key


@pytest.mark.slow
def test_ps_lost_before_any_checkpoint_is_an_error_naming_the_task(tmp_path):
    marker = uuid.uuid4().hex
    proc = start_job(
        ["--model=digits", "--num_workers=2", "--num_ps=1", "--log_every_steps=10"],
        marker,
        tmp_path,
    )

    def training():  # The ps holds the variables and steps have finished.
        return re.search(r"^step \d+/\d+: ", (tmp_path / "out").read_text(), re.M)

    code, _, err = _kill_ps0_when(proc, marker, tmp_path, training)
    assert code == 1
    assert re.search(
        r"PsLostError: Lost /job:ps/task:0 at 127\.0\.0\.1:\d+ during training; no "
        r"--model_dir\. To recover from a lost ps task, train with "
        r"--model_dir=DIR and --checkpoint_every_steps=N",
        err,
    ), err[-3000:]


def _unavailable(message):
    return tf.errors.UnavailableError(None, None, message)


def test_lost_ps_tasks_names_the_task_by_name_address_or_silence():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = f"127.0.0.1:{listening.getsockname()[1]}"
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            down = f"127.0.0.1:{closed.getsockname()[1]}"
        by_name = _unavailable("from remote target /job:ps/replica:0/task:0 while")
        assert recovery.lost_ps_tasks(by_name, [up, up]) == {"/job:ps/task:0": up}
        by_address = _unavailable(f"ipv4:{up}: Failed to connect")
        assert recovery.lost_ps_tasks(by_address, [down, up]) == {
            "/job:ps/task:0": down,  # Not listening.
            "/job:ps/task:1": up,  # Named by its address.
        }
        try:  # Wrapped by code that handled it.
            raise RuntimeError("a vector op failed") from by_name
        except RuntimeError as wrapped:
            assert recovery.lost_ps_tasks(wrapped, [up]) == {"/job:ps/task:0": up}
        # Not an unavailable task, or no ps named and every ps up: not a ps loss.
        assert recovery.lost_ps_tasks(ValueError("/job:ps/task:0"), [down]) == {}
        worker = _unavailable("from remote target /job:worker/replica:0/task:1")
        assert recovery.lost_ps_tasks(worker, [up]) == {}


def test_recovery_without_a_checkpoint_names_the_task_and_the_fix(tmp_path):
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{closed.getsockname()[1]}"
    calls = []

    def attempt():
        calls.append(True)
        raise _unavailable("from remote target /job:ps/replica:0/task:0")

    with pytest.raises(
        recovery.PsLostError,
        match=rf"Lost /job:ps/task:0 at {down} during training; {tmp_path} holds "
        r"no checkpoint yet .* --model_dir=DIR and --checkpoint_every_steps=N",
    ) as raised:
        recovery.run_with_ps_recovery(attempt, [down], str(tmp_path), 5.0, print)
    assert raised.value.tasks == {"/job:ps/task:0": down}
    assert len(calls) == 1


def test_a_task_that_never_serves_again_fails_within_ps_recovery_secs(tmp_path):
    checkpoint = tf.train.Checkpoint(v=tf.Variable(1.0))
    checkpoint.save(str(tmp_path / "checkpoints" / "ckpt"))
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        down = f"127.0.0.1:{closed.getsockname()[1]}"

    def attempt():
        raise _unavailable(f"ipv4:{down}: Connection refused")

    start = time.monotonic()
    with pytest.raises(
        recovery.PsLostError,
        match=rf"Lost /job:ps/task:0 at {down} during training and it did not "
        r"serve again within --ps_recovery_secs=0\.5 s\. .* resume from ckpt-1",
    ):
        recovery.run_with_ps_recovery(attempt, [down], str(tmp_path), 0.5, print)
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan")])
def test_ps_recovery_secs_is_validated(value):
    with pytest.raises(ValueError, match=r"`ps_recovery_secs` must be a finite"):
        job.JobConfig(ps_recovery_secs=value).validate()


def test_local_cluster_max_restarts_is_validated():
    with pytest.raises(ValueError, match=r"`max_restarts` must be an integer >= 0"):
        local_lib.LocalCluster(max_restarts=-1)


def test_a_ps_lost_again_and_again_without_a_new_checkpoint_ends_the_job(tmp_path):
    tf.train.Checkpoint(v=tf.Variable(1.0)).save(str(tmp_path / "checkpoints" / "ckpt"))
    lines, calls = [], []
    with socket.socket() as listening:  # The task "serves again" at once.
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = f"127.0.0.1:{listening.getsockname()[1]}"

        def attempt():
            calls.append(True)
            raise _unavailable("from remote target /job:ps/replica:0/task:0")

        with pytest.raises(
            recovery.PsLostError,
            match=rf"Lost /job:ps/task:0 at {up} again: 4 ps losses in a row with "
            r"no checkpoint after ckpt-1 \(step 1\) \(at most 3\)",
        ):
            recovery.run_with_ps_recovery(
                attempt, [up], str(tmp_path), 5.0, lines.append
            )
    assert len(calls) == 1 + recovery.MAX_RECOVERIES_WITHOUT_PROGRESS
    recovered = [line for line in lines if line.startswith("ps recovery ")]
    assert len(recovered) == 3
    for i, line in enumerate(recovered, 1):
        assert re.fullmatch(
            rf"ps recovery {i}: serving again after [0-9.]+ s; restoring every ps "
            r"variable and slot from ckpt-1 \(step 1\)",
            line,
        )


def _wait_for_lines(lines, count):
    """Waits (at most 120 s) until the cluster's report has `count` lines."""
    deadline = time.monotonic() + 120
    while len(lines) < count:
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)


@pytest.mark.slow
def test_local_cluster_restarts_a_lost_task_at_most_max_restarts_times():
    lines = []
    wait_for_lines = functools.partial(_wait_for_lines, lines)
    with local_lib.LocalCluster(
        num_workers=1, num_ps=1, restart_lost_tasks=True, max_restarts=1,
        report=lines.append,
    ) as cluster:  # fmt: skip
        address = cluster.jobs["ps"][0]
        cluster.kill("ps", 0)
        wait_for_lines(1)
        cluster.kill("ps", 0)  # The restarted process.
        wait_for_lines(2)
        time.sleep(1)
        assert cluster.processes[("ps", 0)].poll() == -9  # Left down.
    assert re.fullmatch(
        rf"local cluster: ps:0 at {address} exited \(code -9\); restarted on the "
        r"same address, serving after [0-9.]+ s \(restart 1 of at most 1\)",
        lines[0],
    )
    assert lines[1:] == [
        f"local cluster: ps:0 at {address} exited (code -9); not restarted: 1 "
        "restarts done (`max_restarts`)"
    ]


@pytest.mark.slow
def test_tasks_restarted_by_a_thread_outlive_that_thread():
    # Linux's parent-death signal follows the thread that forked the task:
    # before `server.popen_for_life`, the supervisor thread, returning once
    # `max_restarts` were used up, took the task it had restarted down with it
    # (SIGKILL), as did any short-lived thread that called `restart`.
    lines = []
    wait_for_lines = functools.partial(_wait_for_lines, lines)
    with local_lib.LocalCluster(
        num_workers=2, num_ps=1, restart_lost_tasks=True, max_restarts=1,
        report=lines.append,
    ) as cluster:  # fmt: skip
        cluster.kill("worker", 0)
        wait_for_lines(1)  # Restarted by the supervisor thread.
        cluster.kill("worker", 1)
        wait_for_lines(2)  # Not restarted: the supervisor thread returns.
        assert "not restarted" in lines[1]
        thread = threading.Thread(target=cluster.restart, args=("ps", 0))
        thread.start()
        thread.join()
        time.sleep(2)
        assert cluster.processes[("worker", 0)].poll() is None, lines
        assert cluster.processes[("ps", 0)].poll() is None
        assert cluster.processes[("worker", 1)].poll() == -9
