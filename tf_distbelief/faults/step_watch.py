"""A bounded wait for scheduled steps: with no worker to run them, fail naming them.

TensorFlow's `ClusterCoordinator` keeps the functions of a lost worker queued
until a worker serves again, and reconnects a restarted worker by itself
(`ClusterCoordinator` docstring, "fault tolerance"). With every worker gone for
good, `fit` (stock and Downpour) and `evaluate` therefore waited for ever in
`schedule` or `join`, silently: a hang.

`StepWatch`, started by each `DistBeliefStrategy`, watches the strategy's
coordinator twice a second. While functions wait (queued or running) and none
finishes, it prints a line every 30 s naming the workers that do not accept
connections; after `timeout_secs` without one finished it fails the
coordinator's queue with a `StepStallError`, which the waiting `schedule` or
`join` raises on the chief (the queued functions are cancelled). A worker that
comes back in time (a local cluster restarts it, a TFJob's restart policy
does) resets the clock with its first finished step, so recovery is
unchanged. Callers that bound their own waits, like
`sandblaster.SandblasterObjective` (`stall_timeout_secs`), suspend the watch.

A worker that hangs, accepting connections but never answering (SIGSTOP, a
swap storm), is `cluster.local.hung_tasks`'s: a local cluster kills it once it has
been silent `hung_task_timeout_secs` (the coordinator then runs its step
elsewhere), and with `TF_CONFIG` the chief names it and the pod's liveness
probe restarts it. The watch's lines name hung workers apart from those not
accepting connections. Failing the queue does not end a step in flight on a
hung worker: TensorFlow's cancellation waits for it.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping

from absl import logging

from tf_distbelief import checks, errors
from tf_distbelief.cluster import health
from tf_distbelief.tf_internals import coordinator as tf_coordinator

_POLL_SECS = 0.5
_REPORT_EVERY_SECS = 30.0


class StepStallError(errors.DistBeliefError, TimeoutError):
    """No function scheduled on the workers finished within the step stall timeout."""


def check_timeout(timeout_secs) -> float:
    """Returns `timeout_secs` as a float.

    Raises:
      ValueError: it is not a finite number of seconds > 0.
    """
    return checks.check_positive_secs("step_stall_timeout_secs", timeout_secs)


class StepWatch:
    """Fails a strategy's waiting steps when none finishes for `timeout_secs`.

    Args:
      strategy: the `tf.distribute.experimental.ParameterServerStrategy` whose
        `ClusterCoordinator` (made by `fit`, or by `ClusterCoordinator(strategy)`)
        is watched; held by a weak reference: the watch's thread ends with it.
      timeout_secs: the longest time, in seconds (finite, > 0), that scheduled
        functions wait with none finishing.
      workers: `{task name: "host:port"}` of the workers, named in messages.
      report: where the progress line goes every 30 s of a stall (default:
        `absl.logging.warning`).

    Attributes:
      timeout_secs: as given.
      stalls: how many times the watch failed the waiting steps.

    Raises:
      ValueError: `timeout_secs` is not a finite number of seconds > 0.
    """

    def __init__(
        self,
        strategy,
        timeout_secs: float,
        workers: Mapping[str, str],
        report: Callable[[str], None] | None = None,
    ):
        self.timeout_secs = check_timeout(timeout_secs)
        self.stalls = 0
        self._strategy = weakref.ref(strategy)
        self._workers = dict(workers)
        self._report = report or logging.warning
        self._suspended = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="StepWatch", daemon=True).start()

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Inside, the watch neither reports nor fails (the caller bounds its waits)."""
        with self._lock:
            self._suspended += 1
        try:
            yield
        finally:
            with self._lock:
                self._suspended -= 1

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # noqa: BLE001 - said, not lost with the thread.
            logging.exception("StepWatch stopped; steps now wait without a bound")

    def _watch(self) -> None:
        progress, last_finished, since, next_report = None, -1, None, 0.0
        while True:
            time.sleep(_POLL_SECS)
            strategy = self._strategy()
            if strategy is None:
                return
            if progress is None:
                progress = tf_coordinator.CoordinatorProgress.of(strategy)
            strategy = None
            if progress is None:
                continue
            now = time.monotonic()
            finished, waiting = progress.finished, progress.waiting()
            if finished != last_finished or not waiting or self._suspended:
                # Measured from the first look at the wait: at least as long
                # as it was.
                last_finished, since = finished, None
                continue
            if since is None:
                since, next_report = now, now + _REPORT_EVERY_SECS
            stalled = now - since
            if stalled >= self.timeout_secs:
                error = StepStallError(self._message(stalled, waiting))
                if progress.fail(error, finished):  # Not if a step just finished.
                    self.stalls += 1
                since = None
            elif now >= next_report:
                self._report(
                    f"waiting for a worker to run the scheduled steps: none "
                    f"finished for {stalled:.0f} s of {self.timeout_secs:g} s "
                    f"({waiting} waiting); {self._unreachable()}"
                )
                next_report = now + _REPORT_EVERY_SECS

    def _unreachable(self) -> str:
        """Which workers do not answer (`health.probe`), and why, in words."""
        states = health.probe_all(self._workers)
        refused = [
            f"{task} at {address}"
            for task, address in self._workers.items()
            if states[task] is health.TaskState.REFUSED
        ]
        silent = [
            f"{task} at {address}"
            for task, address in self._workers.items()
            if states[task] is health.TaskState.SILENT
        ]
        parts = []
        if refused:
            parts.append("not accepting connections: " + ", ".join(refused))
        if silent:
            parts.append(
                "hung (accepting connections, not answering): " + ", ".join(silent)
            )
        return "; ".join(parts) or "every worker answers (a step runs long)"

    def _message(self, stalled: float, waiting: int) -> str:
        return (
            f"No step scheduled on the workers finished in {stalled:.0f} s while "
            f"{waiting} waited (the limit: `step_stall_timeout_secs`, launch flag "
            f"--step_stall_timeout_secs={self.timeout_secs:g}); "
            f"{self._unreachable()}. Start the workers again (a local cluster "
            "restarts lost tasks; on Kubernetes the TFJob's restart policy does) "
            "and rerun with the same --model_dir to resume from its last "
            "checkpoint, or raise --step_stall_timeout_secs if one step takes "
            "longer."
        )
