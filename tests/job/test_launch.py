"""The launch script and the cluster as separate OS processes (the slow tier).

Processes are found by a marker in their environment, which every child
inherits, so "no process left behind" is checked across the whole machine.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import uuid

import numpy as np
import portpicker
import pytest
import tensorflow as tf

import tf_distbelief as tfdb
from tests.fixtures.helpers import tensorboard_scalars
from tests.fixtures.launch import (
    README_ARGS,
    ROOT,
    TRAIN,
    _accuracy,
    _env,
    _marked_pids,
    _train,
    _train_ok,
    _wait_no_marked,
    readme_accuracy,
)
from tf_distbelief import cluster, paths
from tf_distbelief.demos import digits

# A line of TensorFlow's C++ logging (Abseil's prefix), or Abseil's banner.
CPP_LOG_LINE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]|WARNING: All log messages)",
    re.M,
)


@pytest.mark.slow
@pytest.mark.xdist_group("install")  # The session's one install.
def test_readme_main_job_streams_its_progress_and_leaves_no_process(
    installed, tmp_path
):
    """Issue 12: stdout is a pipe (docker, Kubernetes, `| tee`); each line
    arrives as it is written, and stdout and stderr hold no TensorFlow C++ log
    line on a CPU machine.

    The README's job as a user runs it after `pip install <checkout>`: the
    installed `tf-distbelief-train`, from an empty folder, reaches the test
    accuracy the README states.
    """
    marker = uuid.uuid4().hex
    stderr_file = tempfile.TemporaryFile(mode="w+")  # Never a full pipe.
    proc = subprocess.Popen(
        [sys.executable, installed.command, *README_ARGS],
        env=_env(
            marker,
            PYTHONUNBUFFERED="",
            TF_CPP_MIN_LOG_LEVEL="2",
            PYTHONPATH=installed.env["PYTHONPATH"],
        ),
        cwd=str(tmp_path),
        stdout=subprocess.PIPE,
        stderr=stderr_file,
        text=True,
    )
    try:
        lines = [proc.stdout.readline()]
        # Before TensorFlow loads (tens of seconds on a loaded machine).
        assert lines[0] == ("loading TensorFlow (local job: 2 workers, 2 ps)\n")
        while not lines[-1].startswith("epoch 1/5:") and lines[-1]:
            lines.append(proc.stdout.readline())
        # The first epoch's line, read while the job still runs (4 epochs to go).
        assert proc.poll() is None, lines
        assert re.match(
            r"^epoch 1/5: steps 100/500 loss=\d\.\d{4} accuracy=\d\.\d{4} "
            r"[\d,]+ examples/s, elapsed \d+s, ETA \d+s; goodput \d+\.\d%$",
            lines[-1],
        ), lines
        # The rest, line by line in a thread (a bounded wait), to time the
        # exit after the last line.
        last_line_at = [time.monotonic()]

        def read_rest():
            for line in proc.stdout:
                lines.append(line)
                last_line_at[0] = time.monotonic()

        reader = threading.Thread(target=read_rest, daemon=True)
        reader.start()
        proc.wait(timeout=900)
        exit_secs = time.monotonic() - last_line_at[0]
        reader.join(timeout=30)
        assert not reader.is_alive(), "stdout still open 30 s after the exit"
    finally:
        proc.kill()
        stderr_file.seek(0)
        stderr = stderr_file.read()
        stderr_file.close()
    assert proc.returncode == 0, stderr[-3000:]
    output = "".join(lines)
    # The chief ends within a few seconds of its last line (the local
    # cluster's tasks are stopped before it; the exit took 12-31 s before).
    assert exit_secs < 10.0, exit_secs
    assert "local cluster: 2 workers, 2 ps (127.0.0.1:" in output
    # Lines as the finished steps pass each 100 (the step the follower saw).
    assert re.search(
        r"^step \d+/500: [\d,]+ examples/s, elapsed \d+s, ETA ", output, re.M
    )
    last_epoch = (
        r"^epoch 5/5: steps 500/500 .* examples/s, elapsed \d+s, ETA 0s; "
        r"goodput \d+\.\d%$"
    )
    assert re.search(last_epoch, output, re.M)
    # The job's full console output ends with the test accuracy and the
    # job's goodput.
    assert re.fullmatch(r"test accuracy: 0\.\d{4}", output.splitlines()[-2])
    assert output.splitlines()[-1].startswith("goodput: ")
    assert _accuracy(output) >= 0.95
    # The README says "about 0.96-0.97": 0.01 under its low end, a few of
    # the 450 test digits.
    assert _accuracy(output) >= readme_accuracy()[0] - 0.01
    assert not CPP_LOG_LINE.search(output + stderr), (output + stderr)[-3000:]
    assert _wait_no_marked(marker) == []
    assert os.listdir(tmp_path) == []  # Nothing written where it ran.


@pytest.mark.parametrize(
    "flag,message",
    [
        ("--num_workers=0", r"flag --num_workers=0: 0 is not a positive integer"),
        ("--optimizer=adam", r"flag --optimizer=adam: value should be one of"),
        ("--model=resnet", r"flag --model=resnet: value should be one of"),
        ("--learning_rate=-1", r"flag --learning_rate=-1: -1.0 is not number >= 1e-12"),
        ("--epsilon=inf", r"flag --epsilon=inf: --epsilon must be a finite number"),
        ("--learning_rate=nan", r"flag --learning_rate=nan: --learning_rate must be"),
        ("--local_optimizer=adam", r"flag --local_optimizer=adam: value should be"),
        ("--gpus_per_worker=-1", r"flag --gpus_per_worker=-1: -1 is not a non-neg"),
        (
            "--lbfgs_checkpoint_every_iters=0",
            r"flag --lbfgs_checkpoint_every_iters=0: 0 is not a positive integer",
        ),
        (
            "--lbfgs_two_loop=dense",
            r"flag --lbfgs_two_loop=dense: value should be one of <vector_free\|vec",
        ),
        (
            "--portion_stall_timeout_secs=0",
            r"flag --portion_stall_timeout_secs=0.0: --portion_stall_timeout_secs must",
        ),
        (
            "--step_stall_timeout_secs=inf",
            r"flag --step_stall_timeout_secs=inf: --step_stall_timeout_secs must be",
        ),
    ],
)
def test_bad_flags_fail_at_parse_time(flag, message):
    proc = _train([flag], uuid.uuid4().hex, timeout=300)
    assert proc.returncode == 1
    assert re.search(message, proc.stderr), proc.stderr[-2000:]
    assert "local cluster" not in proc.stdout  # Nothing started.


# The launch script run as `__main__` in this child, without the re-execution
# in a private network namespace, so that the child sees what it imported.
_PARSE_ONLY = """
import runpy, sys
sys.argv = [sys.argv[1], "--noisolate_network", *sys.argv[2:]]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
except SystemExit as e:
    print("exit", e.code, "tensorflow" in sys.modules, "tf_keras" in sys.modules)
"""


# absl's `--help` exits with 1, as its usage errors do; a refused Downpour
# setting exits with its one line (status 1).
@pytest.mark.parametrize(
    "flags, code",
    [
        (["--help"], 1),
        (["--optimizer=adam"], 1),
        (
            ["--n_fetch=2"],
            "train.py: error: --n_fetch: Downpour settings, ignored without "
            "--downpour: add --downpour.",
        ),
        (
            ["--downpour", "--top_k_fraction=0"],
            "train.py: error: Downpour settings: `--top_k_fraction` must be in "
            "(0, 1] (the fraction of entries a push sends) or None (off). "
            "Received: 0.0",
        ),
    ],
)
def test_flags_are_answered_before_tensorflow_loads(flags, code):
    # `--help`, a bad value, a Downpour flag without --downpour and one
    # `DownpourConfig` refuses: no TensorFlow, so the answer takes a fraction
    # of a second, not its load.
    proc = subprocess.run(
        [sys.executable, "-c", _PARSE_ONLY, TRAIN, *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"exit {code} False False" in proc.stdout, proc.stdout + proc.stderr
    assert "loading TensorFlow" not in proc.stdout


def test_bad_tf_config_fails_before_any_server():
    marker = uuid.uuid4().hex
    tf_config = json.dumps(
        {"cluster": {"ps_hosts": ["127.0.0.1:1"]}, "task": {"type": "ps", "index": 0}}
    )
    proc = _train([], marker, timeout=300, TF_CONFIG=tf_config)
    assert proc.returncode == 1
    assert "Unknown job name(s) ['ps_hosts']" in proc.stderr


def test_taken_port_is_a_clear_error(tmp_path, monkeypatch):
    # The cluster's temporary folder is made in `tmp_path`: none is left.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        local = cluster.LocalCluster(num_workers=1, num_ps=1, ports={"worker": [port]})
        with pytest.raises(
            tfdb.ClusterStartError,
            match=rf"Local task worker:0 at 127.0.0.1:{port} exited with code 1 "
            rf"before listening \(port {port} is already in use\)",
        ):
            local.start()
    assert all(p.poll() is not None for p in local.processes.values())
    assert os.listdir(tmp_path) == []


def test_a_picked_port_taken_before_its_task_binds_it_is_picked_again(monkeypatch):
    # portpicker's free port can be taken by another process before the task
    # binds it (two test runs at once): the cluster starts again on others.
    from tf_distbelief.cluster.local import local_cluster

    picked = []
    pick = local_cluster.portpicker.pick_unused_port
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]

        def worker_port_taken():  # Picked in order: chief, worker, ps.
            picked.append(port if len(picked) == 1 else pick())
            return picked[-1]

        monkeypatch.setattr(
            local_cluster.portpicker, "pick_unused_port", worker_port_taken
        )
        reports = []
        local = cluster.LocalCluster(num_workers=1, num_ps=1, report=reports.append)
        try:
            local.start()
            assert local.jobs["worker"] != [f"127.0.0.1:{port}"]
            assert all(p.poll() is None for p in local.processes.values())
        finally:
            local.stop()
    assert len(picked) == 6  # Two starts of 3 tasks.
    assert len(reports) == 1 and re.fullmatch(
        rf"local cluster: Local task worker:0 at 127.0.0.1:{port} exited with "
        rf"code 1 before listening \(port {port} is already in use\)\..*"
        r"Starting again on other ports\.",
        reports[0],
        re.DOTALL,
    ), reports


def test_a_running_local_cluster_refuses_a_second_start():
    local = cluster.LocalCluster(num_workers=1, num_ps=1).start()
    try:
        pids = sorted(p.pid for p in local.processes.values())
        with pytest.raises(
            tfdb.ClusterStartError,
            match=r"This LocalCluster is running \(ps \['127\.0\.0\.1:\d+'\], "
            r"workers \['127\.0\.0\.1:\d+'\]\): call stop\(\) before starting it "
            r"again\.",
        ):
            local.start()
        assert sorted(p.pid for p in local.processes.values()) == pids
        assert all(p.poll() is None for p in local.processes.values())
    finally:
        local.stop()
    assert all(p.poll() is not None for p in local.processes.values())


def test_a_local_cluster_makes_its_folder_when_it_starts(tmp_path, monkeypatch):
    # One never started (here only asked for its GPU assignment) leaves none.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    local = cluster.LocalCluster(num_workers=2, num_ps=1, visible_gpus=[])
    assert local.gpu_assignment == {}
    assert local.log_tail("ps", 0) == ""
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_killed_chief_leaves_no_process():
    marker = uuid.uuid4().hex
    script = textwrap.dedent("""
        import time
        from tf_distbelief import cluster
        cluster.LocalCluster(num_workers=2, num_ps=1).start()
        print("up", flush=True)
        time.sleep(600)
    """)
    chief = subprocess.Popen(
        [sys.executable, "-c", script],
        env=_env(marker),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert chief.stdout.readline().strip() == "up"
        assert len(_marked_pids(marker)) == 4  # The chief and its 3 tasks.
        chief.send_signal(signal.SIGKILL)
        chief.wait(30)
        assert _wait_no_marked(marker) == []
    finally:
        chief.kill()


@pytest.mark.slow
def test_tf_config_cluster_of_separate_processes(tmp_path):
    """chief, 2 workers, 2 ps and an evaluator, each `launch/train.py` with its
    own TF_CONFIG."""
    marker = uuid.uuid4().hex
    jobs = {
        "chief": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
        "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(2)],
        "ps": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(2)],
        "evaluator": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
    }
    procs = {}
    try:
        for job in ("ps", "worker", "chief", "evaluator"):
            for index in range(len(jobs[job])):
                tf_config = json.dumps(
                    {"cluster": jobs, "task": {"type": job, "index": index}}
                )
                procs[(job, index)] = subprocess.Popen(
                    [
                        sys.executable,
                        TRAIN,
                        "--model=digits",
                        "--chief_gone_secs=3",
                        f"--model_dir={tmp_path}",
                    ],
                    env=_env(marker, TF_CONFIG=tf_config),
                    cwd=ROOT,
                    stdout=open(tmp_path / f"{job}{index}.out", "w"),
                    stderr=subprocess.STDOUT,
                )
        chief = procs[("chief", 0)]
        assert chief.wait(900) == 0, (tmp_path / "chief0.out").read_text()[-3000:]
        output = (tmp_path / "chief0.out").read_text()
        assert "local cluster" not in output
        assert _accuracy(output) >= 0.95
        # Servers end by themselves once the chief is gone (--chief_gone_secs);
        # the evaluator after the last epoch's checkpoint.
        for key, proc in procs.items():
            assert proc.wait(120) == 0, key
        # Each server says where it serves, and why it leaves.
        for job in ("ps", "worker"):
            for index, address in enumerate(jobs[job]):
                out = (tmp_path / f"{job}{index}.out").read_text().splitlines()
                assert out == [
                    f"loading TensorFlow (TF_CONFIG task {job}:{index})",
                    f"{job} {index} serving at {address}",
                    f"{job} {index} leaving: the job ended, the chief gone 3 s",
                ], out
        evaluator = (tmp_path / "evaluator0.out").read_text()
        assert "evaluator: done" in evaluator
        # Issue 12: every checkpoint (one per epoch) evaluated and named, its
        # scalars at its step.
        steps = [100, 200, 300, 400, 500]
        for step in steps:
            assert re.search(
                rf"^evaluator: \S+/checkpoints/ckpt-{step} \(step {step}\): "
                r"accuracy=0\.\d{4} loss=",
                evaluator,
                re.M,
            ), evaluator[-2000:]
        assert re.search(r"ckpt-500 \(step 500\): accuracy=0\.9[5-9]", evaluator)
        scalars = tensorboard_scalars(tmp_path / "tensorboard" / "eval")
        assert [s for s, _ in scalars["eval/accuracy"]] == steps
        assert [s for s, _ in scalars["eval/loss"]] == steps
        assert _wait_no_marked(marker) == []
    finally:
        for proc in procs.values():
            proc.kill()


@pytest.mark.slow
def test_sandblaster_through_the_launch_script():
    output = _train_ok(
        [
            "--model=digits",
            "--optimizer=lbfgs",
            "--portions=16",
            "--lbfgs_max_iters=100",
            "--num_workers=2",
            "--num_ps=2",
        ]
    )
    last = re.search(r"^lbfgs: (\d+) iterations, .*backup copies \d+", output, re.M)
    assert last, output[-3000:]
    # A line per iteration (--lbfgs_log_every_iters=1) before the last one.
    shown = re.findall(
        r"^lbfgs iteration (\d+)/100: loss \S+, gradient norm \S+, \d+ "
        r"evaluations, \d+\.\d s$",
        output,
        re.M,
    )
    assert [int(i) for i in shown] == list(range(1, int(last[1]) + 1))
    assert _accuracy(output) >= 0.93


@pytest.mark.slow
@pytest.mark.xdist_group("downpour_launch_ps0_killed")
def test_downpour_through_the_launch_script(downpour_launch_ps0_killed):
    """`conftest.DOWNPOUR_LAUNCH_ARGS`: `--downpour --n_fetch=4 --n_push=4` on 2
    workers and 2 ps, 1,000 steps. 500 steps (the default 5 epochs) left test
    accuracy between 0.947 and 0.964 before AdaGrad counted a push as its
    steps, and once at 0.64 after; 1,000 steps gave 0.976-0.982 in 4 runs.

    The launch is the one tests/faults/test_ps_recovery.py SIGKILLs ps 0 of (with
    `--model_dir` and checkpoints every 20 steps): the job must show its
    Downpour progress and reach the accuracy through that loss as well, and
    one launch of about a minute serves both tests.
    """
    code, output, stderr = downpour_launch_ps0_killed
    assert code == 0, stderr[-3000:]
    # The epoch's Downpour figures in words, units on the bytes.
    epoch = re.search(r"^epoch 10/10: .*$", output, re.M)
    assert epoch, output[-3000:]
    assert re.search(
        r" examples/s, elapsed \d+s, ETA 0s; staleness \d+\.\d\d, fetched "
        r"[\d.]+ kB/step, pushed [\d.]+ kB/step; goodput \d+\.\d%$",
        epoch[0],
    ), epoch[0]
    # The run's figures in one line: integers, units, no reprs.
    assert re.search(
        r"^downpour: 2 replicas, [\d,]+ steps \([\d,]+, [\d,]+\), [\d,]+ pushes "
        r"\([\d,]+, [\d,]+\), [\d,]+ fetches, staleness mean \d+\.\d\d max \d+, "
        r"fetched [\d.]+ MB, pushed [\d.]+ MB$",
        output,
        re.M,
    ), output[-3000:]
    assert "ReplicaStats(" not in output
    assert _accuracy(output) >= 0.95


# A plain process (no cluster, no tf_distbelief): the exported SavedModel's
# `serving_default` on the test set.
_SERVED_ACCURACY = """
import sys, numpy as np, tensorflow as tf
serve = tf.saved_model.load(sys.argv[1])
x, y = np.load(sys.argv[2]), np.load(sys.argv[3])
(logits,) = serve.signatures["serving_default"](tf.constant(x)).values()
assert "tf_distbelief" not in sys.modules
print(f"{np.mean(logits.numpy().argmax(-1) == y):.4f}")
"""


@pytest.mark.slow
@pytest.mark.parametrize("keras", ["2", "3"])
def test_model_parallel_replicas_through_the_launch_script(keras, tmp_path):
    """Downpour on 2 workers whose replicas each span 2 CPU devices, with a
    tf_keras model and with a Keras 3 one; the export serves in a plain
    process with the accuracy the job printed."""
    output = _train_ok(
        [
            f"--keras={keras}",
            "--model=digits",
            "--devices_per_replica=2",
            "--downpour",
            "--n_fetch=4",
            "--n_push=4",
            "--epochs=8",
            "--learning_rate=0.3",
            "--num_workers=2",
            "--num_ps=2",
            f"--export_dir={tmp_path / 'export'}",
        ]
    )
    assert _accuracy(output) >= 0.9
    _, (x_test, y_test) = digits.load_data()
    np.save(tmp_path / "x.npy", x_test), np.save(tmp_path / "y.npy", y_test)
    served = subprocess.run(
        [
            sys.executable,
            "-c",
            _SERVED_ACCURACY,
            str(tmp_path / "export" / "saved_model"),
            str(tmp_path / "x.npy"),
            str(tmp_path / "y.npy"),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=str(tmp_path),
    )
    assert float(served.stdout.split()[-1]) == pytest.approx(
        _accuracy(output), abs=1e-4
    )


def test_devices_per_replica_needs_a_model_parallel_model():
    proc = _train(
        ["--model=embedding", "--devices_per_replica=2"], uuid.uuid4().hex, timeout=300
    )
    assert proc.returncode == 1
    assert "`devices_per_replica` > 1 needs a model with a model-parallel " in (
        proc.stderr
    )
    assert "local cluster" not in proc.stdout


def _checkpoint_values(path, prefix=""):
    reader = tf.train.load_checkpoint(path)
    return {
        key: reader.get_tensor(key)
        for key in reader.get_variable_to_shape_map()
        if key.startswith(prefix)
    }


@pytest.mark.slow
def test_embedding_resume_keeps_every_adagrad_accumulator(tmp_path):
    """Issue 10: a resumed run's accumulators never fall below the last run's."""
    args = ["--model=embedding", "--steps_per_epoch=50", f"--model_dir={tmp_path}"]
    _train_ok([*args, "--epochs=1"])
    output = _train_ok([*args, "--epochs=2"])
    assert re.search(r"^Resumed from .*ckpt-50 at step 50 \(epoch 1\)$", output, re.M)
    checkpoints = tmp_path / "checkpoints"
    first = _checkpoint_values(str(checkpoints / "ckpt-50"), "optimizer/")
    second = _checkpoint_values(str(checkpoints / "ckpt-100"), "optimizer/")
    assert first["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 50
    assert second["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == 100
    accumulators = [k for k in first if k.startswith("optimizer/_variables/")]
    # The embedding table (sharded over the 2 ps), the Dense kernel and bias.
    assert len(accumulators) == 3
    for key in accumulators:
        assert (second[key] >= first[key]).all(), key
        assert (second[key] > first[key]).any(), key  # The second run trained.
    # The local cluster's task logs are kept in the model_dir.
    logs = sorted(os.listdir(tmp_path / "cluster"))
    assert [name for name in logs if name.endswith(".log")] == [
        "ps_0.log",
        "ps_1.log",
        "worker_0.log",
        "worker_1.log",
    ]


@pytest.mark.slow
def test_nonfinite_stops_the_job_naming_the_step_and_no_checkpoint_holds_it(
    tmp_path,
):
    marker = uuid.uuid4().hex
    proc = _train(
        [
            "--optimizer=sgd",
            "--learning_rate=1e30",
            f"--model_dir={tmp_path}",
            # A checkpoint at every step, so that the last good one is there.
            "--checkpoint_every_steps=1",
            "--steps_per_execution=1",
        ],
        marker,
    )
    assert proc.returncode == 1
    # One line: the coordinator's log of the failed check (TensorFlow's graph
    # stack, about 1,300 lines) and the traceback are kept off the console.
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and re.fullmatch(
        r"train\.py: error: Non-finite gradient \(NaN or inf\) at step \d+ for "
        r"dense/kernel:0, .*--nonfinite=skip\) to skip such steps\.",
        lines[0],
    ), proc.stderr[-3000:]
    assert "test accuracy" not in proc.stdout
    assert _wait_no_marked(marker) == []
    index_files = list((tmp_path / "checkpoints").glob("ckpt-*.index"))
    assert index_files
    for index in index_files:
        for key, value in _checkpoint_values(str(index)[: -len(".index")]).items():
            if getattr(value, "dtype", None) is not None and value.dtype.kind == "f":
                assert np.isfinite(value).all(), (index.name, key)


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, unit",
    [([], "steps"), (["--downpour", "--n_fetch=2", "--n_push=2"], "pushes")],
    ids=["stock", "downpour"],
)
def test_nonfinite_skip_ends_the_job_with_a_warning_counting_what_it_skipped(
    flags, unit
):
    """With `--nonfinite=skip` the same job ends (exit 0, the user asked to
    skip), and its last lines say how many of its steps (Downpour: pushes)
    did nothing."""
    marker = uuid.uuid4().hex
    proc = _train(
        [
            "--optimizer=sgd",
            "--learning_rate=1e30",
            "--nonfinite=skip",
            "--steps_per_execution=1",
            *flags,
        ],
        marker,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("warning:")]
    match = re.fullmatch(
        rf"warning: ([\d,]+) of ([\d,]+) {unit} skipped for a NaN or inf "
        r"gradient \(--nonfinite=skip\): their updates were not applied",
        line,
    )
    assert match, line
    skipped, made = (int(g.replace(",", "")) for g in match.groups())
    assert 0 < skipped <= made
    assert "test accuracy" in proc.stdout
    assert _wait_no_marked(marker) == []


@pytest.mark.parametrize(
    "flags,message",
    [
        (
            ["--checkpoint_every_steps=5"],
            r"--checkpoint_every_steps needs --model_dir",
        ),
        (["--nonfinite=ignore"], r"flag --nonfinite=ignore: value should be one of"),
        (
            ["--preemption_signal=SIGKILL"],
            r"flag --preemption_signal=SIGKILL: value should be one of",
        ),
    ],
)
def test_reliability_flags_fail_at_parse_time(flags, message):
    proc = _train(flags, uuid.uuid4().hex, timeout=300)
    assert proc.returncode == 1
    assert re.search(message, proc.stderr), proc.stderr[-2000:]
    assert "local cluster" not in proc.stdout


# A signal mid-epoch: 2,000 steps per epoch, a progress line every 50 steps,
# and no interval checkpoint before the epoch's end.
_MID_EPOCH_ARGS = (
    "--epochs=2",
    "--steps_per_epoch=2000",
    "--log_every_steps=50",
    "--checkpoint_every_steps=10000",
)


def _signal_mid_training(args, sig, marker, tmp_path, trigger):
    """Starts `launch/train.py args` in a session of its own, sends `sig` to
    its process group once a line starts with `trigger`; returns the lines
    before the signal, those after, the exit status and the seconds from the
    signal to the exit."""
    temp = tmp_path / "tmp"
    temp.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, TRAIN, *args],
        env=_env(marker, TMPDIR=str(temp)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    before = []
    for text in proc.stdout:
        before.append(text)
        if text.startswith(trigger):
            break
    sent = time.monotonic()
    os.killpg(proc.pid, sig)
    after = proc.stdout.read().splitlines()
    code = proc.wait(timeout=60)
    return before, after, code, time.monotonic() - sent


def _saved_at_the_signal(name, before, after, grace_secs=25):
    """The step of the stop line of a save at the signal; checks the line."""
    stopped = [a for a in after if a.startswith(f"{name}: job stopped")]
    assert len(stopped) == 1, "".join(before) + "\n".join(after)
    found = re.fullmatch(
        rf"{name}: job stopped at step (\d+), saved at the signal in ([\d.]+) s; "
        r"a rerun resumes from ckpt-\1 \(step \1\)",
        stopped[0],
    )
    assert found, stopped[0]
    assert float(found.group(2)) < grace_secs
    # The job's goodput line, as at a job's own end, just before the stop
    # line (an orchestrator's accounting of a preempted job reads it).
    (line,) = [a for a in after if a.startswith("goodput: ")]
    assert after.index(line) == after.index(stopped[0]) - 1, after
    step = int(found.group(1))
    # Mid-epoch, after the last progress line before the signal: the step
    # reached, not an earlier checkpoint's (there is none before step 2000).
    seen = [int(m) for m in re.findall(r"^step (\d+)/", "".join(before), re.M)]
    assert seen and seen[-1] <= step < 2000, (seen, stopped[0])
    return step


def _rerun_resumes_at(args, step, tmp_path):
    """Reruns `args`; checks it resumes at `step` exactly, then stops it."""
    marker = uuid.uuid4().hex
    before, after, code, _ = _signal_mid_training(
        args, signal.SIGINT, marker, tmp_path, "restored "
    )
    text = "".join(before)
    assert re.search(rf"^Resumed from .*ckpt-{step} at step {step} ", text, re.M), text
    assert re.search(
        rf"^restored ckpt-{step} \(step {step}\): \d+ values equal the checkpoint "
        "bit for bit",
        text,
        re.M,
    ), text
    assert code == 130, text + "\n".join(after)
    assert _wait_no_marked(marker) == []
    # The stopped job removed its model_dir lock (no takeover of a lock left
    # behind), and so did this one.
    assert "model_dir: took over" not in text, text
    assert not (tmp_path / "run" / paths.LOCK_FILE).exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, code, line",
    [
        (signal.SIGINT, 130, "SIGINT (Ctrl-C): job stopped; no model_dir: a rerun"),
        (signal.SIGTERM, 143, "SIGTERM: job stopped at step "),
    ],
)
def test_a_signal_to_the_jobs_process_group_stops_it_in_one_line(
    sig, code, line, tmp_path
):
    # What a terminal's Ctrl-C does (the signal reaches the foreground
    # process group), and a scheduler's SIGTERM: the chief ends every task,
    # none is restarted, nothing is left. With a model_dir, SIGTERM first
    # saves the step reached (mid-epoch, no interval checkpoint before it),
    # and a rerun resumes from exactly that step.
    marker, temp = uuid.uuid4().hex, tmp_path / "tmp"
    args = [*README_ARGS, "--epochs=50", "--steps_per_execution=10"]
    trigger = "epoch 2/"  # Mid-training, after a checkpoint.
    if sig == signal.SIGTERM:
        args = [*README_ARGS, *_MID_EPOCH_ARGS, f"--model_dir={tmp_path / 'run'}"]
        trigger = "step "
    before, after, status, secs = _signal_mid_training(
        args, sig, marker, tmp_path, trigger
    )
    assert status == code, "".join(before) + "\n".join(after)
    assert secs < 10
    assert len(after) <= 5 and any(a.startswith(line) for a in after), after
    assert not any("restarted" in text for text in [*before, *after])
    assert _wait_no_marked(marker) == []
    assert os.listdir(temp) == []  # No cluster folder, no autograph file.
    if sig == signal.SIGTERM:
        step = _saved_at_the_signal("SIGTERM", before, after)
        checkpoints = tmp_path / "run" / "checkpoints"
        assert sorted(p.name for p in checkpoints.glob("*.index")) == [
            f"ckpt-{step}.index"
        ]
        # Every step scheduled before the signal ran once or not at all
        # (those not started were cancelled): the optimizer applied exactly
        # the steps the checkpoint records.
        values = _checkpoint_values(str(checkpoints / f"ckpt-{step}"))
        assert values["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == step
        assert values["step/.ATTRIBUTES/VARIABLE_VALUE"] == step
        _rerun_resumes_at(args, step, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "trainer, sig",
    [
        (["--downpour", "--n_fetch=4", "--n_push=4"], signal.SIGTERM),
        # A scheduler's own signal (Slurm's `--signal=USR1@60`).
        (["--keras=3", "--preemption_signal=SIGUSR1"], signal.SIGUSR1),
    ],
    ids=["downpour", "keras3"],
)
def test_a_preemption_signal_mid_epoch_saves_the_step_reached(trainer, sig, tmp_path):
    # Downpour (each replica's state saved with the ps values) and Keras 3:
    # the save at the signal is the step reached, and the rerun starts there.
    marker = uuid.uuid4().hex
    args = [*README_ARGS, *trainer, *_MID_EPOCH_ARGS, f"--model_dir={tmp_path}/run"]
    before, after, code, secs = _signal_mid_training(
        args, sig, marker, tmp_path, "step "
    )
    assert code == 128 + sig, "".join(before) + "\n".join(after)
    assert secs < 25
    step = _saved_at_the_signal(signal.Signals(sig).name, before, after)
    assert _wait_no_marked(marker) == []
    _rerun_resumes_at(args, step, tmp_path)


@pytest.mark.slow
def test_a_save_that_misses_the_grace_period_is_abandoned_whole(tmp_path):
    # A grace period too short for any save: the job still ends at once with
    # 143 and one line, the state file names the last whole checkpoint (or
    # none), and the folder holds nothing else.
    marker = uuid.uuid4().hex
    run = tmp_path / "run"
    args = [
        *README_ARGS,
        *_MID_EPOCH_ARGS[:-1],
        "--checkpoint_every_steps=50",
        "--preemption_grace_secs=0.01",
        f"--model_dir={run}",
    ]
    before, after, code, secs = _signal_mid_training(
        args, signal.SIGTERM, marker, tmp_path, "step "
    )
    assert code == 143, "".join(before) + "\n".join(after)
    assert secs < 10
    (stopped,) = [a for a in after if a.startswith("SIGTERM: job stopped")]
    assert stopped.startswith(
        "SIGTERM: job stopped; the save at the signal did not finish within "
        "--preemption_grace_secs=0.01 and was abandoned, nothing of it kept; "
    ), stopped
    assert _wait_no_marked(marker) == []
    checkpoints = run / "checkpoints"
    latest = tf.train.latest_checkpoint(str(checkpoints))
    if latest is None:
        assert stopped.endswith("yet: a rerun starts over"), stopped
        assert not list(checkpoints.glob("ckpt-*"))
        return
    name = os.path.basename(latest)
    assert stopped.endswith(f"a rerun resumes from {name} (step {name[5:]})")
    kept = set(
        tf.train.get_checkpoint_state(str(checkpoints)).all_model_checkpoint_paths
    )
    for path in checkpoints.iterdir():
        if path.name != "checkpoint":
            prefix = str(checkpoints / re.sub(r"\.(index|data-.*)$", "", path.name))
            assert prefix in kept, path.name
