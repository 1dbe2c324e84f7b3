"""Console output (issue 12): flushed progress lines, TensorFlow's start-up
noise kept out, messages cut in the middle, and the evaluator's loop."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import numpy as np
import portpicker
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures import launch
from tests.fixtures.helpers import tensorboard_scalars
from tests.fixtures.launch import ROOT
from tf_distbelief import console
from tf_distbelief.downpour import report
from tf_distbelief.downpour.schedule import ReplicaStats
from tf_distbelief.fit import evaluation, lines, progress

# A line of TensorFlow's C++ logging (Abseil's prefix), or Abseil's banner.
CPP_LOG_LINE = re.compile(
    r"^([IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \S+:\d+\]|WARNING: All log messages)",
    re.M,
)
GRPC_LINE = re.compile(r"Failed to remove function remotely|grpc_status|GRPC error")

# Lines TensorFlow 2.21 printed on this CPU machine at import (before Abseil
# is initialised) and at the first device query.
ONEDNN = (
    b"I0000 00:00:1796097866.525827   10271 port.cc:153] oneDNN custom "
    b"operations are on. You may see slightly different numerical results.\n"
)
BANNER = (
    b"WARNING: All log messages before absl::InitializeLog() is called are "
    b"written to STDERR\n"
)
CUINIT = (
    b"E0000 00:00:1796097870.360002   10271 cuda_platform.cc:52] failed call to "
    b"cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)\n"
)
REAL_ERROR = b"E1130 12:00:01.000001   10271 server.cc:10] Could not bind port 2222\n"


def test_shorten_keeps_the_start_and_the_cause_at_the_end():
    cause = "Cause: shape (10,) in the checkpoint, (20,) here"
    text = "Graph execution error: Detected at node RestoreV2_1 " + "x " * 2000 + cause
    short = console.shorten(text, 300)
    assert len(short) <= 300
    assert short.startswith("Graph execution error: Detected at node RestoreV2_1")
    assert short.endswith(cause)
    omitted = int(re.search(r"\[\.\.\. (\d+) characters \.\.\.\]", short).group(1))
    kept = len(short) - len(f" [... {omitted} characters ...] ")
    assert kept + omitted == len(" ".join(text.split()))
    assert console.shorten("a  short\n message") == "a short message"
    with pytest.raises(ValueError, match=r"`max_chars` must be >= 40. Received: 5"):
        console.shorten(text, 5)


def test_starting_line_reads_the_cluster_size_before_tensorflow(tmp_path):
    flagfile = tmp_path / "job.flags"
    flagfile.write_text("--num_workers=4\n--model=digits\n")
    line = console.starting_line
    assert line(["train.py"], {}, 2, 2) == (
        "loading TensorFlow (local job: 2 workers, 2 ps)"
    )
    assert line(["train.py", f"--flagfile={flagfile}", "--num_ps=1"], {}, 2, 2) == (
        "loading TensorFlow (local job: 4 workers, 1 ps)"
    )
    for bad in ("--num_ps=x", "--num_workers=0"):  # Named at the full parse.
        assert line(["train.py", bad], {}, 2, 2) == "loading TensorFlow (local job)"
    tf_config = '{"cluster": {}, "task": {"type": "ps", "index": 1}}'
    assert line(["train.py"], {"TF_CONFIG": tf_config}, 2, 2) == (
        "loading TensorFlow (TF_CONFIG task ps:1)"
    )


def test_startup_noise_is_what_the_log_level_would_have_dropped():
    noise = console.is_startup_noise
    for line in (ONEDNN, BANNER):
        assert noise(line, level=2, gpu=False) and noise(line, level=1, gpu=True)
        assert not noise(line, level=0, gpu=False)
    assert noise(CUINIT, level=2, gpu=False)
    assert not noise(CUINIT, level=2, gpu=True)  # A GPU host: a real error.
    assert not noise(REAL_ERROR, level=2, gpu=False)
    assert noise(REAL_ERROR, level=3, gpu=False)
    assert not noise(b"/x.py:3: UserWarning: something\n", level=3, gpu=False)


def test_gpu_expected_follows_cuda_visible_devices():
    assert not console.gpu_expected({"CUDA_VISIBLE_DEVICES": ""})
    assert not console.gpu_expected({"CUDA_VISIBLE_DEVICES": "-1"})
    has_nvidia = any(re.fullmatch(r"nvidia\d+", n) for n in os.listdir("/dev"))
    assert console.gpu_expected({}) == has_nvidia


def test_quiet_startup_drops_the_noise_and_keeps_the_rest_in_order(capfd, monkeypatch):
    monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with console.quiet_tensorflow_startup():
        for line in (BANNER, ONEDNN, b"kept\n", CUINIT, REAL_ERROR, b"kept too\n"):
            os.write(2, line)
    assert capfd.readouterr().err == "kept\n" + REAL_ERROR.decode() + "kept too\n"


def test_a_tensorflow_import_prints_nothing_at_log_level_2():
    code = "from tf_distbelief import console; console.import_tensorflow_quietly()"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout, proc.stderr) == ("", "")


def test_a_quiet_script_refuses_extra_arguments_and_keeps_tf_to_errors():
    code = (
        "from absl import app, logging\n"
        "from tf_distbelief import console\n"
        "def main(argv):\n"
        "    console.start_quiet_script(argv)\n"
        "    import tensorflow as tf\n"
        "    tf.get_logger().warning('dropped')\n"
        "    logging.info('dropped too')\n"
        "    print(tf.get_logger().level, logging.get_verbosity())\n"
        "app.run(main)\n"
    )

    def run(*args):
        return subprocess.run(
            [sys.executable, "-c", code, *args],
            cwd=ROOT,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            capture_output=True,
            text=True,
            timeout=300,
        )

    proc = run()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (proc.stdout, proc.stderr) == ("40 -1\n", "")  # ERROR; WARNING.
    proc = run("extra")
    assert proc.returncode == 1
    assert "Unexpected arguments: ['extra']" in proc.stderr


def test_counts_are_integers_and_figures_carry_units():
    assert console.count(1234.6) == "1,235" and console.count(7) == "7"
    assert [console.size(n) for n in (512, 19240, 962000, 1923000, 3.4e9)] == [
        "512 B",
        "19.2 kB",
        "962 kB",
        "1.9 MB",
        "3.4 GB",
    ]
    assert lines.metrics({"accuracy": 0.96, "nonfinite_skipped": 0, "loss": 0.1}) == (
        "loss=0.1000 accuracy=0.9600 nonfinite_skipped=0"
    )


def test_downpour_epoch_words_and_summary_line_are_short():
    # An epoch's logs as `DownpourMetrics` leaves them.
    logs = {
        "loss": 1.1032,
        "accuracy": 0.6175,
        "bytes_fetched_per_step": 19240.0,
        "bytes_pushed_per_step": 19240.0,
        "nonfinite_pushes": 0,
        "replica0/staleness": 0.6,
        "replica0/steps": 20,
        "replica1/staleness": 0.2667,
        "replica1/steps": 30,
    }
    words, rest = report.epoch_words(logs)
    # The replicas' staleness weighted by their steps: (12 + 8) / 50.
    assert words == "staleness 0.40, fetched 19.2 kB/step, pushed 19.2 kB/step"
    assert rest == {"loss": 1.1032, "accuracy": 0.6175}
    assert report.epoch_words({"loss": 1.0}) == ("", {"loss": 1.0})
    nonfinite, _ = report.epoch_words(dict(logs, nonfinite_pushes=3))
    assert nonfinite == words + ", 3 non-finite pushes dropped"
    line = lines.RunClock(0, 100).epoch_line(1, 2, 50, rest, 341.2, words, 26.04)
    assert re.fullmatch(
        r"epoch 1/2: steps 50/100 loss=1\.1032 accuracy=0\.6175 341 examples/s, "
        r"elapsed 0s, ETA 0s; staleness 0\.40, fetched 19\.2 kB/step, pushed "
        r"19\.2 kB/step; goodput 26\.0%",
        line,
    ), line
    assert len(line) <= 165  # 330 characters with the figures as logs.

    stats = [
        ReplicaStats(50, 50, 50, 0, 0, 22, 1, 962000, 962000),
        ReplicaStats(1500, 1500, 1498, 2, 0, 18, 3, 28860000, 28821520),
    ]
    assert report.summary_line(stats) == (
        "downpour: 2 replicas, 1,550 steps (50, 1,500), 1,548 pushes (50, 1,498), "
        "1,550 fetches, 2 stale pushes dropped, staleness mean 0.03 max 3, "
        "fetched 29.8 MB, pushed 29.8 MB"
    )
    assert report.summary_line([]).startswith("downpour: no counters (a worker lost")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_tf_config_server_says_where_it_serves_and_why_it_leaves(signum):
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    cluster = {
        job: [f"127.0.0.1:{portpicker.pick_unused_port()}"]
        for job in ("chief", "worker")
    }
    cluster["ps"] = [address]
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_distbelief.cluster.server_main"],
        cwd=ROOT,
        env=dict(os.environ, TF_CONFIG=tf_config),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # The first line comes once the server listens (readline waits).
        assert proc.stdout.readline() == f"ps 0 serving at {address}\n"
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert out == f"ps 0 leaving: {signal.Signals(signum).name}\n"
    assert not CPP_LOG_LINE.search(err), err[-3000:]


def _digits_dense(seed=0):
    tf_keras.utils.set_random_seed(seed)
    model = tf_keras.Sequential([tf_keras.layers.Dense(10, input_shape=(64,))])
    model.compile(
        "sgd",
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class _SlowSteps(tf_keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.15)  # Steps the follower thread (every 0.5 s) can see.


def test_progress_lines_name_the_epoch_steps_speed_and_eta():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(256, 64)).astype("float32"), rng.integers(0, 10, 256)
    lines = []
    callback = progress.Progress(
        32, log_every_steps=4, print_fn=lines.append, epochs=2, steps_per_epoch=8
    )
    _digits_dense().fit(
        x, y, batch_size=32, epochs=2, verbose=0, callbacks=[_SlowSteps(), callback]
    )
    epochs = [line for line in lines if line.startswith("epoch")]
    assert len(epochs) == 2
    assert re.match(
        r"^epoch 1/2: steps 8/16 loss=\d+\.\d{4} accuracy=\d\.\d{4} "
        r"[\d,]+ examples/s, elapsed \d+s, ETA \d+s$",
        epochs[0],
    ), epochs[0]
    last = r"^epoch 2/2: steps 16/16 .* examples/s, elapsed \d+s, ETA 0s$"
    assert re.match(last, epochs[1])
    steps = [line for line in lines if line.startswith("step")]
    assert steps, lines
    shown = []
    for line in steps:
        match = re.match(
            r"^step (\d+)/16: [\d,]+ examples/s, elapsed \d+s, ETA \d+s$", line
        )
        assert match, line
        shown.append(int(match.group(1)))
    # One line each time the finished steps pass a multiple of 4.
    assert shown == sorted(set(shown)) and shown[0] >= 4
    assert len({s // 4 for s in shown}) == len(shown)
    assert [h["steps"] for h in callback.history] == [8, 16]


def test_the_evaluator_writes_each_checkpoint_at_its_step(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(200, 64)).astype("float32"), rng.integers(0, 10, 200)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    trained = _digits_dense(seed=1)
    trained(x[:1])
    weights = {
        s: [w + 0.1 * s * rng.normal(size=w.shape) for w in trained.get_weights()]
        for s in (10, 20, 30)
    }
    step = tf.Variable(0, dtype=tf.int64)
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(model=trained, step=step), str(tmp_path / "ckpt"), 3
    )
    for s, w in weights.items():
        trained.set_weights(w)
        step.assign(s)
        manager.save(checkpoint_number=s)
    lines = []
    model = _digits_dense(seed=2)
    model(x[:1])
    results = evaluation.evaluate_checkpoints(
        model,
        data,
        str(tmp_path / "ckpt"),
        last_step=30,
        tensorboard_dir=str(tmp_path / "eval"),
        steps_per_epoch=10,
        print_fn=lines.append,
    )
    assert sorted(results) == [10, 20, 30]
    for s, (kernel, bias) in weights.items():
        logits = x @ kernel + bias  # NumPy, independent of the model.
        accuracy = np.mean(np.argmax(logits, axis=1) == y)
        assert results[s]["accuracy"] == pytest.approx(accuracy)
        shown = rf"ckpt-{s} \(step {s}\): .*accuracy="
        assert any(re.search(shown, line) for line in lines)
    events = tensorboard_scalars(tmp_path / "eval")
    assert [s for s, _ in events["eval/accuracy"]] == [10, 20, 30]
    assert [s for s, _ in events["eval/loss"]] == [10, 20, 30]
    assert lines[-1] == "evaluator: evaluated 3 checkpoints"

    # A run that ends later than any checkpoint comes: a bounded wait, named.
    with pytest.raises(TimeoutError, match=r"after step 30 in .*ckpt; the run ends "):
        evaluation.evaluate_checkpoints(
            model, data, str(tmp_path / "ckpt"), 40, timeout_secs=1, print_fn=print
        )


@pytest.mark.slow
def test_a_library_run_ends_with_at_most_one_grpc_line(tmp_path):
    script = textwrap.dedent(
        f"""
        import tf_keras
        import tf_distbelief as tfdb
        from tf_distbelief.fit import training
        from tf_distbelief.demos import digits

        (x, y), (x_test, y_test) = digits.load_data()
        with tfdb.cluster.LocalCluster(1, 1, log_dir={str(tmp_path)!r}) as local:
            strategy = tfdb.DistBeliefStrategy(local.resolver)
            with strategy.scope():
                model = digits.build_model()
                model.compile(
                    tfdb.adagrad.Adagrad(0.1),
                    tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
            training.fit(
                model, training.dataset_creator(x, y, 32), epochs=1,
                steps_per_epoch=20, batch_size=32,
            )
            print(f"test accuracy: {{training.accuracy(model, x_test, y_test)}}")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1].startswith("test accuracy: ")
    grpc = [line for line in proc.stderr.splitlines() if GRPC_LINE.search(line)]
    assert len(grpc) <= 1, "\n".join(grpc[:10])
    # The child tasks log at the parent's level: no C++ INFO lines, and no
    # cuInit error on a machine without a GPU.
    for name in ("worker_0.log", "ps_0.log"):
        log = (tmp_path / name).read_text()
        if console.gpu_expected():
            log = "\n".join(li for li in log.splitlines() if "cuInit" not in li)
        assert not CPP_LOG_LINE.search(log), log[-2000:]


def _loud_env(**more):
    """This process's environment without the log levels that quiet TensorFlow."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY")
    }
    return dict(env, **more)


# TensorFlow's C++ lines: Abseil's prefix, its banner, or a source path.
TF_CPP_TEXT = re.compile(r"^[IWEF]\d{4} |external/local_xla|absl::InitializeLog", re.M)


def test_console_quiet_silences_tensorflow_at_import_and_first_device_query():
    """Unset levels print TensorFlow's lines at import; `console.quiet()` first
    leaves stderr empty."""
    code = (
        "import tensorflow as tf\n"
        "tf.config.list_physical_devices()\n"
        "print(int(tf.constant(1) + 1))\n"
    )
    for quiet, expect_quiet in (("", False), (_QUIET_CALL, True)):
        proc = subprocess.run(
            [sys.executable, "-c", quiet + code],
            cwd=ROOT,
            env=_loud_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert (proc.returncode, proc.stdout) == (0, "2\n"), proc.stderr[-3000:]
        if expect_quiet:
            assert proc.stderr == ""
        else:  # What the call silences.
            assert TF_CPP_TEXT.search(proc.stderr), proc.stderr[-3000:]


_QUIET_CALL = "from tf_distbelief import console\nconsole.quiet()\n"


@pytest.mark.slow
def test_console_quiet_silences_a_program_using_a_local_cluster(tmp_path):
    """The README's kind of program with `console.quiet()` first, at
    TensorFlow's default levels: no C++ log line from this process, at start,
    while training or at exit, nor in its tasks' logs, which say where each
    task served and why it left."""
    script = _QUIET_CALL + textwrap.dedent(
        f"""
        import tf_keras
        import tf_distbelief as tfdb
        from tf_distbelief.demos import digits

        (x, y), (x_test, y_test) = digits.load_data()
        with tfdb.cluster.LocalCluster(1, 1, log_dir={str(tmp_path)!r}) as local:
            strategy = tfdb.DistBeliefStrategy(local.resolver)
            with strategy.scope():
                model = digits.build_model()
                model.compile(
                    tfdb.adagrad.Adagrad(0.1),
                    tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                )
            tfdb.fit.fit(
                model, tfdb.fit.dataset_creator(x, y, 32), epochs=1,
                steps_per_epoch=20, batch_size=32,
            )
            print(f"test accuracy: {{tfdb.fit.accuracy(model, x_test, y_test)}}")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=str(tmp_path),
        env=_loud_env(PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    assert re.fullmatch(r"epoch 1/1: steps 20/20 loss=.*; goodput \d+\.\d%", out[0])
    assert out[1].startswith("goodput: ") and out[2].startswith("test accuracy: ")
    assert not TF_CPP_TEXT.search(proc.stderr), proc.stderr[-3000:]
    for job in ("worker", "ps"):
        log = (tmp_path / f"{job}_0.log").read_text()
        assert not TF_CPP_TEXT.search(log), log[-3000:]
        assert re.search(rf"^{job} 0 serving at 127\.0\.0\.1:\d+$", log, re.M), log
        assert re.search(rf"^{job} 0 leaving: SIGTERM$", log, re.M), log


@pytest.mark.parametrize(
    "flags,message",
    [
        (  # Refused by the Keras 3 job (`ConfigError`).
            ["--keras=3", "--optimizer=lbfgs"],
            r"`optimizer` must be 'adagrad' or 'sgd' with Keras 3 \(`--keras=3`\): "
            r"AdaGrad and SGD on the ps are the Keras 3 path's optimizers\. "
            r"Received: 'lbfgs'",
        ),
        (  # Refused by `load_spec` (`ConfigError`).
            ["--model=nosuchmodule:spec"],
            r"Cannot import module `nosuchmodule` of model spec 'nosuchmodule:spec' "
            r"\(No module named 'nosuchmodule'\)\. It must be importable from the "
            r"working directory or PYTHONPATH\.",
        ),
        (  # Refused by `main` (`app.UsageError`): no flag list before it.
            ["--n_push=1"],  # Its default value, yet ignored without --downpour.
            r"--n_push: Downpour settings, ignored without --downpour: add "
            r"--downpour\.",
        ),
        (  # Two of them, one at its default value.
            ["--adagrad_accumulator=mean", "--n_fetch=1"],
            r"--n_fetch, --adagrad_accumulator: Downpour settings, ignored "
            r"without --downpour: add --downpour\.",
        ),
    ],
)
def test_an_option_refused_after_parsing_is_one_error_line(flags, message):
    proc = launch._train(flags, uuid.uuid4().hex, timeout=300)
    launch.assert_one_refusal_line(proc, message)


def test_an_unexpected_error_keeps_its_traceback(tmp_path):
    """Only refused settings lose the traceback: a bug (here a spec function
    that raises a plain ValueError) is shown with it."""
    (tmp_path / "buggy_spec.py").write_text(
        "def spec():\n    raise ValueError('a bug in the spec function')\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    proc = launch._train(
        ["--model=buggy_spec:spec"], uuid.uuid4().hex, 300, PYTHONPATH=path
    )
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
    assert re.search(
        r'File ".*buggy_spec\.py", line 2, in spec\n.*\n'
        r"ValueError: a bug in the spec function\n$",
        proc.stderr,
    ), proc.stderr[-3000:]
    assert "error: a bug" not in proc.stderr


# --- Ending a process without Python's teardown (`console.exit_when_done`) ---

_EXIT_CHILD = textwrap.dedent(
    """
    import sys, time
    from tf_distbelief import console

    def work(kind):
        print("working", flush=False)
        if kind == "error":
            raise RuntimeError("the cause, at the end of the message")
        if kind == "kept":
            raise KeyError("kept")

    try:
        console.exit_when_done(work, sys.argv[1], keep=(KeyError,))
    except KeyError as e:
        print(f"raised on: {e}", flush=True)
        sys.exit(3)
    print("not reached", flush=True)
    """
)


@pytest.mark.parametrize(
    "kind, returncode, out",
    [
        ("ok", 0, "working\n"),
        ("error", 1, "working\n"),
        ("kept", 3, "working\nraised on: 'kept'"),
    ],
)
def test_exit_when_done_ends_the_process(kind, returncode, out):
    done = subprocess.run(
        [sys.executable, "-c", _EXIT_CHILD, kind],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == returncode, done.stderr
    assert done.stdout.startswith(out)
    assert "not reached" not in done.stdout
    if kind == "error":
        # The whole traceback, its last line the cause.
        assert done.stderr.startswith("Traceback (most recent call last):")
        assert done.stderr.rstrip().endswith(
            "RuntimeError: the cause, at the end of the message"
        )
    else:
        assert "Traceback" not in done.stderr


_AUTOGRAPH_THEN_END = """
import tensorflow as tf
from tf_distbelief import console

@tf.function
def f(x):
    while x > 0:  # Converted by autograph: its source goes to a temp file.
        x -= 1
    return x

print(int(f(tf.constant(3))), flush=True)
console.end_process(0)
"""


def test_a_process_ended_at_once_leaves_no_autograph_file(tmp_path):
    # `os._exit` skips the interpreter's teardown, where autograph removes
    # the files it wrote; `console.end_process` removes them first.
    script, temp = tmp_path / "script.py", tmp_path / "tmp"
    script.write_text(_AUTOGRAPH_THEN_END)  # Autograph reads its source.
    temp.mkdir()
    proc = subprocess.run(
        [sys.executable, str(script)],
        env=dict(os.environ, TMPDIR=str(temp), PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stdout == "0\n", proc.stderr[-2000:]
    assert os.listdir(temp) == []


def test_a_closed_pipe_ends_the_lines_quietly_and_the_program_goes_on():
    # `tf-distbelief-train ... | head -3`: the reader goes away; the job's
    # later lines go nowhere, with no traceback, and it ends as it would.
    code = (
        "from tf_distbelief import console\n"
        "for i in range(20000):\n"
        "    console.echo(f'line {i} ' + 'x' * 60)\n"
        "print('done', file=__import__('sys').stderr)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().startswith("line 0 ")
    proc.stdout.close()  # As `head -1` exits.
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == "done\n"
