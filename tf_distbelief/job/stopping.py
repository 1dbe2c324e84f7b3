"""Stopping a training job on SIGINT (Ctrl-C) or SIGTERM: one line, no restart.

The chief of a launched job (or a local job) ends at once on either signal:
it says so in one line (with a `model_dir`, which checkpoint a rerun resumes
from), ends its local cluster's tasks (which the supervisor then does not
restart: the cluster is stopping), and exits with status 128 + the signal
(130, 143), as a shell reports a job ended by one. A local cluster's tasks
run in a process group of their own, so that a terminal's Ctrl-C reaches the
chief alone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from tf_distbelief import console, paths
from tf_distbelief.cluster.local import local_cluster

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)", signal.SIGTERM: "SIGTERM"}


def install(model_dir: str | None, print_fn: Callable[[str], None]) -> None:
    """Makes SIGINT and SIGTERM stop this process's job at once.

    Call it from the main thread of the process that trains (a launch
    script's chief), not from a library user's process: Python's own
    `KeyboardInterrupt` is theirs.

    Args:
      model_dir: the job's `model_dir`, or None.
      print_fn: where the one line goes.
    """
    stopping = threading.Event()

    def on_signal(signum, frame):
        del frame
        if stopping.is_set():  # A second Ctrl-C while the first ends the job.
            return
        stopping.set()
        print_fn(f"{_NAMES[signum]}: job stopped; {_rerun(model_dir)}")
        sys.stdout.flush()
        sys.stderr.flush()
        # What the coordinator's threads say about the tasks ended next (a
        # lost worker, a refused connection) is this stop, not news.
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, sys.stdout.fileno())
        os.dup2(quiet, sys.stderr.fileno())
        local_cluster.stop_live_clusters(leave_tasks=False)
        console.end_process(128 + signum)

    for signum in STOP_SIGNALS:
        signal.signal(signum, on_signal)


def _rerun(model_dir: str | None) -> str:
    """What a rerun of the same command starts from, in words."""
    if not model_dir:
        return "no model_dir: a rerun starts over"
    latest = paths.latest_checkpoint(model_dir)
    if latest is None:
        return f"no checkpoint in {model_dir} yet: a rerun starts over"
    return f"a rerun resumes from {paths.describe_checkpoint(latest)}"
