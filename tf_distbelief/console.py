"""Console output: lines flushed as written, TensorFlow's start-up noise kept out.

A training job's console is often a pipe (docker, Kubernetes, `| tee`), where
Python buffers `print` until exit; every line here is flushed as written.
TensorFlow 2.21 logs through Abseil, which writes every message logged before
`absl::InitializeLog()` to stderr whatever `TF_CPP_MIN_LOG_LEVEL` says: at
import, the oneDNN and "Could not find cuda drivers" INFO lines (twice, once
per TensorFlow shared library) and, at the first device query on a machine
without a GPU, an ERROR `failed call to cuInit`. `quiet_tensorflow_startup`
drops exactly those lines that the log level would have dropped, and the
cuInit error where no GPU is meant to be used; anything else written in the
meantime (a Python warning, a real error) is written out unchanged, in order.

No TensorFlow import at module level: the launch script uses this module
before TensorFlow loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Mapping, MutableMapping, Sequence

from tf_distbelief import checks

# `quiet_environment`'s settings: errors only.
_QUIET_ENVIRONMENT = {"TF_CPP_MIN_LOG_LEVEL": "2", "GRPC_VERBOSITY": "ERROR"}
# Abseil's prefix: severity, MMDD, time, thread id, file:line]. Before Abseil
# is initialised TensorFlow's lines read `I0000 00:00:<epoch seconds>.<us>`.
_ABSL_LINE = re.compile(rb"^([IWEF])\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] ")
_ABSL_BANNER = b"WARNING: All log messages before absl::InitializeLog() is called"
_SEVERITY = {b"I": 0, b"W": 1, b"E": 2, b"F": 3}
# What `TF_CPP_MIN_LOG_LEVEL` means when unset (TensorFlow's default: all).
_DEFAULT_MIN_LOG_LEVEL = 0
# The local cluster's size when no flag says otherwise (`JobConfig`'s
# defaults): here, so that the launch script's first line, printed before
# TensorFlow loads, can name it.
LOCAL_NUM_WORKERS = 2
LOCAL_NUM_PS = 2
# Kept at each end of a shortened message: the head says what failed, the
# tail (the longer part) says why.
_HEAD_SHARE = 1 / 3


def echo(line: str) -> None:
    """Prints `line` to stdout and flushes it (a pipe shows it at once).

    When the reader of a pipe has gone (`tf-distbelief-train ... | head`),
    the job goes on and its later lines go nowhere (stdout becomes
    `os.devnull`), as Python's documentation advises for `BrokenPipeError`,
    instead of a traceback from every thread that prints.
    """
    try:
        print(line, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def shorten(text: str, max_chars: int = 1200) -> str:
    """Returns `text` on one line, cut in the middle if longer than `max_chars`.

    Error messages end with their cause (TensorFlow's "Graph execution
    error: Detected at node ... <the cause>"): the start and the end are
    kept, the middle is replaced by `[... N characters ...]`.

    Args:
      text: any message; runs of whitespace become one space.
      max_chars: the longest result, >= 40.

    Returns:
      The message, at most `max_chars` characters.

    Raises:
      ValueError: `max_chars` < 40.
    """
    if max_chars < 40:
        raise checks.argument_error("max_chars", ">= 40", max_chars)
    text = " ".join(str(text).split())
    if len(text) <= max_chars:
        return text
    marker_chars = len(f" [... {len(text)} characters ...] ")
    keep = max_chars - marker_chars
    head = int(keep * _HEAD_SHARE)
    tail = keep - head
    cut = len(text) - head - tail
    return f"{text[:head]} [... {cut} characters ...] {text[len(text) - tail :]}"


def duration(secs: float) -> str:
    """`secs` as `42s`, `3m05s` or `2h07m`."""
    secs = max(0, int(round(secs)))
    if secs < 60:
        return f"{secs}s"
    if secs < 3600:
        return f"{secs // 60}m{secs % 60:02d}s"
    return f"{secs // 3600}h{secs % 3600 // 60:02d}m"


def count(n: float) -> str:
    """`n` as a whole number with thousands separators: `1,234`."""
    return f"{int(round(n)):,}"


def size(nbytes: float) -> str:
    """`nbytes` in decimal units: `512 B`, `19.2 kB`, `962 kB`, `1.9 MB`, `3.4 GB`."""
    value = float(nbytes)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(value) < 1000 or unit == "GB":
            break
        value /= 1000
    if unit == "B" or abs(value) >= 100:
        return f"{value:.0f} {unit}"
    return f"{value:.1f} {unit}"


def starting_line(
    argv: Sequence[str],
    environ: Mapping[str, str],
    default_num_workers: int,
    default_num_ps: int,
) -> str:
    """The first console line of `launch/train.py`, before TensorFlow loads.

    Reads only `--num_workers` and `--num_ps` (from the command line or a
    `--flagfile`, with absl's own parser) and `TF_CONFIG`'s task; the full
    flag validation comes later.

    Args:
      argv: the command line.
      environ: the environment (`TF_CONFIG`).
      default_num_workers, default_num_ps: the flags' defaults.

    Returns:
      `loading TensorFlow (local job: 2 workers, 2 ps)` or
      `loading TensorFlow (TF_CONFIG task worker:1)`, or in a JobSet's pod
      (`cluster.jobset_pod`) `loading TensorFlow (JobSet task worker:1)`. It
      claims nothing started: a bad flag still fails after it, before any task starts.
    """
    from absl import flags

    if environ.get("TF_CONFIG"):
        try:
            task = json.loads(environ["TF_CONFIG"]).get("task", {})
            name = f"task {task.get('type')}:{task.get('index', 0)}"
        except (ValueError, AttributeError):
            name = "task (unreadable)"  # Validated, with a named error, once loaded.
        return f"loading TensorFlow (TF_CONFIG {name})"
    # `cluster.jobset_pod`'s ENV_REPLICAS, ENV_REPLICATED_JOB, ENV_JOB_INDEX;
    # validated once loaded.
    if environ.get("TFDB_JOBSET_REPLICAS"):
        task = (
            f"{environ.get('TFDB_JOBSET_REPLICATED_JOB')}:"
            f"{environ.get('TFDB_JOBSET_JOB_INDEX')}"
        )
        return f"loading TensorFlow (JobSet task {task})"
    early = flags.FlagValues()
    flags.DEFINE_integer(
        "num_workers", default_num_workers, "", lower_bound=1, flag_values=early
    )
    flags.DEFINE_integer("num_ps", default_num_ps, "", lower_bound=1, flag_values=early)
    try:
        early(list(argv), known_only=True)
    except (flags.Error, OSError):
        # A bad value fails, named, at the full parse.
        return "loading TensorFlow (local job)"
    return (
        f"loading TensorFlow (local job: {early.num_workers} workers, "
        f"{early.num_ps} ps)"
    )


def min_log_level(environ: Mapping[str, str] | None = None) -> int:
    """TensorFlow's C++ log level, `TF_CPP_MIN_LOG_LEVEL` (0 all .. 3 fatal only)."""
    environ = os.environ if environ is None else environ
    try:
        return int(environ.get("TF_CPP_MIN_LOG_LEVEL", _DEFAULT_MIN_LOG_LEVEL))
    except ValueError:
        return _DEFAULT_MIN_LOG_LEVEL


def gpu_expected(environ: Mapping[str, str] | None = None) -> bool:
    """False when this process is meant to run without a GPU.

    That is: `CUDA_VISIBLE_DEVICES` is empty or `-1`, or the host has no
    NVIDIA device node (`/dev/nvidia0`, ...), as on a CPU machine.
    """
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return False
    try:
        return any(re.fullmatch(r"nvidia\d+", name) for name in os.listdir("/dev"))
    except OSError:
        return True


def is_startup_noise(line: bytes, level: int, gpu: bool) -> bool:
    """True for a TensorFlow start-up line that `level` would have dropped.

    Args:
      line: one line of stderr, as bytes.
      level: `TF_CPP_MIN_LOG_LEVEL`.
      gpu: whether a GPU is meant to be used (`gpu_expected`).
    """
    if level >= 1 and line.startswith(_ABSL_BANNER):
        return True
    match = _ABSL_LINE.match(line)
    if not match:
        return False
    if _SEVERITY[match.group(1)] < level:
        return True
    return level >= 1 and not gpu and b"failed call to cuInit" in line


@contextlib.contextmanager
def quiet_tensorflow_startup(fd: int = 2):
    """Within the block, drops TensorFlow's start-up noise from file `fd`.

    What is written to `fd` (stderr) in the block goes to a temporary file;
    at the end, every line but the noise (`is_startup_noise`) is written to
    `fd`, in order. Use it around the first TensorFlow import and the first
    device query only: nothing written inside shows until the block ends.
    """
    level, gpu = min_log_level(), gpu_expected()
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), fd)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, fd)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured if not is_startup_noise(line, level, gpu)]
            if kept:
                os.write(fd, b"".join(kept))


def quiet_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Sets TensorFlow's and gRPC's C++ logging to errors only, where unset.

    `TF_CPP_MIN_LOG_LEVEL=2` (TensorFlow's INFO and WARNING lines dropped)
    and `GRPC_VERBOSITY=ERROR`, each unless `environ` already sets it (a
    user's own level wins). Both are read when TensorFlow's library loads,
    and processes started afterwards (a `LocalCluster`'s tasks) inherit them.

    Args:
      environ: the environment to change; None: `os.environ`.
    """
    environ = os.environ if environ is None else environ
    for name, value in _QUIET_ENVIRONMENT.items():
        environ.setdefault(name, value)


def quiet() -> None:
    """Silences TensorFlow's C++ logging in a program that uses the API.

    Call it first thing, before TensorFlow is imported: it sets the C++ log
    levels (`quiet_environment`), then imports TensorFlow without the lines
    it prints at import and at its first device query whatever the level
    says (`import_tensorflow_quietly`). What is left on stderr is Python's
    own warnings and errors, and TensorFlow's C++ errors. Called after
    TensorFlow was imported, it quiets only the processes started after it
    (a `LocalCluster`'s tasks). Python's logging (absl, TensorFlow's Python
    logger) is left as it is.

    `tf-distbelief-train` does the same before it loads TensorFlow.
    """
    quiet_environment()
    import_tensorflow_quietly()


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow and queries its devices inside `quiet_tensorflow_startup`.

    The device query is where CUDA is initialised (the cuInit error of a
    machine without a GPU); it initialises no runtime, so device settings
    (visible devices, memory growth) can still be made after it.
    """
    with quiet_tensorflow_startup():
        import tensorflow as tf

        tf.config.list_physical_devices()


def start_quiet_script(argv: Sequence[str]) -> None:
    """The start of a benchmark's `main(argv)` under `absl.app.run`.

    Refuses positional arguments (`absl.app.UsageError`), imports TensorFlow
    without its start-up noise (`import_tensorflow_quietly`), and keeps
    TensorFlow's Python logger to errors and Abseil's to warnings, so that
    the script's own lines are what its console shows.
    """
    from absl import app, logging

    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {list(argv[1:])}")
    import_tensorflow_quietly()
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")
    logging.set_verbosity(logging.WARNING)


def refusals_in_one_line(main, refused: tuple[type[BaseException], ...]):
    """`main(argv)` that ends the process with one line when it refuses a setting.

    A refused option (`refused`: the launch script's `app.UsageError` and
    `tf_distbelief.errors.ConfigError`) names the setting, the value and the
    fix; absl's full flag list (UsageError) or a traceback would bury that
    line. Any other exception is a bug and keeps its traceback.

    Args:
      main: the launch script's `main(argv)`.
      refused: the exception classes printed as `prog: error: message`.

    Returns:
      A `main(argv)` for `app.run`: on a `refused` error it writes
      `<script>: error: <message>` to stderr and exits with status 1.
    """

    def run_main(argv):
        try:
            return main(argv)
        except refused as e:
            sys.exit(f"{os.path.basename(argv[0])}: error: {e}")

    return run_main


def exit_when_done(
    fn,
    *args,
    keep: tuple[type[BaseException], ...] = (),
    one_line: tuple[type[BaseException], ...] = (),
) -> None:
    """Runs `fn(*args)`, then ends the process at once, skipping Python's teardown.

    A process that used a cluster it has already stopped cannot rely on the
    interpreter's teardown. TensorFlow's eager context then asks each ended
    task to remove every function it traced (an error line per task and
    function), and a `ClusterCoordinator` with functions still queued for
    workers that are gone retries them for ever: its destructor waits for
    that retry, so the process never exits (seen after a Sandblaster
    evaluation gave up with lost workers). Launch scripts and benchmarks end
    through this instead: stdout and stderr are flushed, a failure's whole
    traceback is written to stderr first, then `os._exit`.

    Args:
      fn: the process's work.
      *args: passed to `fn`.
      keep: exception classes raised on as usual, for the caller to report
        (a launch script's refusals, raised before any cluster starts).
      one_line: exception classes written as one line,
        `<program>: error: <message>`, to stderr before the process ends with
        status 1 (a cluster that did not answer: its message names the tasks
        and the fix, which a traceback would bury).

    Raises:
      keep: as raised by `fn`. Any other `Exception` ends the process with
        status 1; `KeyboardInterrupt` and `SystemExit` are raised on.
    """
    import traceback

    try:
        fn(*args)
    except keep:
        raise
    except one_line as e:
        sys.stdout.flush()
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {e}\n")
        end_process(1)
    except Exception:  # noqa: BLE001 - written out whole, then the process ends.
        sys.stdout.flush()
        traceback.print_exc()
        end_process(1)
    end_process(0)


def end_process(status: int) -> None:
    """Flushes stdout and stderr, removes this process's files that only its
    interpreter's teardown or its `with` blocks would (autograph's sources,
    the `model_dir` locks it holds: `paths.release_held_locks`), and ends the
    process at once with `status` (`os._exit`: see `exit_when_done`)."""
    from tf_distbelief import paths
    from tf_distbelief.tf_internals import autograph  # Imports no TensorFlow.

    with contextlib.suppress(OSError, ValueError):  # A closed or broken pipe.
        sys.stdout.flush()
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.flush()
    autograph.remove_generated_files()
    paths.release_held_locks()
    os._exit(status)


def exiting(main, keep: tuple[type[BaseException], ...] = ()):
    """`main(argv)` for `absl.app.run` that ends through `exit_when_done`.

    Benchmarks and scripts that stop their own cluster use it so that a
    failure prints its traceback and ends instead of hanging in TensorFlow's
    teardown.

    Args:
      main: the script's `main(argv)`.
      keep: exception classes raised on as usual (absl's `app.UsageError`,
        which `app.run` reports with the flags' help).

    Returns:
      `run_main(argv)`, which calls `main(argv)` and never returns.
    """

    def run_main(argv):
        exit_when_done(main, argv, keep=keep)

    return run_main
