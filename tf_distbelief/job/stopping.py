"""Stopping a training job on SIGINT (Ctrl-C) or SIGTERM: one line, no restart.

The chief of a launched job (or a local job) ends on either signal: it says so
in one line (with a `model_dir`, which checkpoint a rerun resumes from), ends
its local cluster's tasks (which the supervisor then does not restart: the
cluster is stopping), and exits with status 128 + the signal (130, 143), as a
shell reports a job ended by one. A local cluster's tasks run in a process
group of their own, so that a terminal's Ctrl-C reaches the chief alone.

SIGINT ends the job at once. SIGTERM (what Kubernetes and Slurm send before
they kill a job), and the scheduler's own signal if one is named
(`--preemption_signal`), first save the step reached when a trainer that
saves at the signal is running and the job has a `model_dir`
(`faults.preemption`): the job ends within the grace period
(`--preemption_grace_secs`; 0 ends it at once), the save whole or abandoned.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from tf_distbelief import console, paths
from tf_distbelief.cluster.local import local_cluster
from tf_distbelief.faults import goodput, preemption, settings

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


@contextlib.contextmanager
def while_loading() -> Iterator[None]:
    """SIGINT and SIGTERM end the process at once, in one line, in the block.

    For the seconds a launch spends importing TensorFlow, before `install`
    (or a task's server) takes the signals over: nothing has started, so
    there is nothing to end or save, and Ctrl-C would otherwise print a
    `KeyboardInterrupt` traceback from inside TensorFlow's import (SIGTERM:
    no line at all). The handlers before the block are put back after it.
    """

    def on_signal(signum, frame):
        del frame
        console.echo(
            f"{_NAMES[signum]}: stopped while loading TensorFlow; nothing had started"
        )
        console.end_process(128 + signum)

    previous = {signum: signal.signal(signum, on_signal) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def install(
    model_dir: str | None,
    print_fn: Callable[[str], None],
    grace_secs: float = settings.DEFAULT_PREEMPTION_GRACE_SECS,
    preemption_signal: str | None = None,
) -> None:
    """Makes SIGINT and SIGTERM (and `preemption_signal`) stop this process's job.

    Call it from the main thread of the process that trains (a launch
    script's chief), not from a library user's process: Python's own
    `KeyboardInterrupt` is theirs.

    Args:
      model_dir: the job's `model_dir`, or None.
      print_fn: where the one line goes.
      grace_secs: seconds from SIGTERM (or `preemption_signal`) to the end of
        the job, for a save of the step reached; 0: no save, the job ends at
        once.
      preemption_signal: None, or one more signal that saves and stops as
        SIGTERM does (one of `faults.settings.PREEMPTION_SIGNALS`).
    """
    stopping = threading.Event()
    ending = threading.Lock()
    saves = {signal.SIGTERM}
    if preemption_signal is not None:
        saves.add(signal.Signals[preemption_signal])
    received = []
    saving = []  # The signal asked for a save (a preemption).

    def end(what: str) -> None:
        # Once, from whichever thread gets here first (the saving one, or
        # the grace period's watchdog); the other waits for the exit.
        if not ending.acquire(blocking=False):
            threading.Event().wait()
        # A preempted job's time, as a job that ends by itself gives it (an
        # orchestrator's accounting reads it); Ctrl-C stays one line.
        accountant = goodput.current() if saving else None
        for line in accountant.end_lines() if accountant is not None else []:
            print_fn(line)
        print_fn(f"{what}; {_rerun(model_dir)}")
        sys.stdout.flush()
        sys.stderr.flush()
        # What the coordinator's threads say about the tasks ended next (a
        # lost worker, a refused connection) is this stop, not news.
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, sys.stdout.fileno())
        os.dup2(quiet, sys.stderr.fileno())
        local_cluster.stop_live_clusters(leave_tasks=False)
        console.end_process(128 + received[0])

    armed = None
    if model_dir and grace_secs > 0:
        armed = preemption.arm(grace_secs, end)

    def on_signal(signum, frame):
        del frame
        if stopping.is_set():  # A second Ctrl-C while the first ends the job.
            return
        stopping.set()
        received.append(signum)
        name = _NAMES.get(signum) or signal.Signals(signum).name
        if armed is not None and signum in saves and preemption.can_save():
            saving.append(name)
            armed.request(name)  # The trainer saves at its next step's end.
            return
        end(f"{name}: job stopped")

    for signum in sorted({*STOP_SIGNALS, *saves}):
        signal.signal(signum, on_signal)


def _rerun(model_dir: str | None) -> str:
    """What a rerun of the same command starts from, in words."""
    if not model_dir:
        return "no model_dir: a rerun starts over"
    latest = paths.latest_checkpoint(model_dir)
    if latest is None:
        return f"no checkpoint in {model_dir} yet: a rerun starts over"
    return f"a rerun resumes from {paths.describe_checkpoint(latest)}"
