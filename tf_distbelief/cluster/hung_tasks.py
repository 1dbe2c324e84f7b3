"""A hung task is a lost task: one that accepts connections but stops answering.

TensorFlow notices a ps or worker that exits (its connections close, the step
in flight fails, the coordinator runs it again on another worker). It never
notices one that stops answering and keeps its connections open (SIGSTOP, a
swap storm): the step in flight on it, the coordinator's cancellation and
`join` all wait on it without a bound. (A task whose process still runs but
whose ops are stuck, such as behind a stuck GPU driver, still answers the
probe: the step watch's `--step_stall_timeout_secs` ends such a job.)

`HungTaskWatch` probes every task (`health.probe`, a gRPC call with a
deadline, answered by a running server's gRPC completion-queue threads,
whatever its inter-op threads are doing) and
gives up on a task that has stayed `SILENT` for `timeout_secs`: it prints one
line naming the task and the time it gave up, and calls `on_hung`. A local
cluster's `on_hung` kills the task, so that TensorFlow sees a lost task and its
own recovery applies (the step in flight is run again elsewhere, exactly once
through the step tokens; the cluster's supervisor restarts the task, which
rejoins). A task that is down (connection refused) is not hung: the
supervisor, an orchestrator, or the step watch handles it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping

from absl import logging

from tf_distbelief import checks
from tf_distbelief.cluster import health

# A live server answers a probe in milliseconds, even mid-step; a stopped
# process never does. 30 s rides out a loaded machine's pauses (a probe was
# seen at 1.2 s) and costs a hung worker's step at most that long.
DEFAULT_HUNG_TASK_TIMEOUT_SECS = 30.0
_PROBE_EVERY_SECS = 1.0


class HungTaskWatch:
    """Calls `on_hung(task)` for each task silent for `timeout_secs` in a row.

    Args:
      tasks: returns `{task name: "host:port"}` of the tasks to watch, called
        before each round of probes (a cluster's tasks can change).
      timeout_secs: seconds (finite, > 0) a task may stay `SILENT` before it is
        given up; each probe waits at most the smaller of this and
        `health.DEFAULT_PROBE_TIMEOUT_SECS`.
      on_hung: called with the task's name once it is given up (a local
        cluster kills it); exceptions are logged, not raised.
      action: what giving up does, in words, ending the line that names the
        task (a local cluster's: it kills the task and restarts it).
      report: where the line naming a hung task goes (default:
        `absl.logging.warning`).

    Attributes:
      given_up: `(task name, seconds silent)` of every task given up, in order.

    Raises:
      ValueError: `timeout_secs` is not a finite number of seconds > 0.
    """

    def __init__(
        self,
        tasks: Callable[[], Mapping[str, str]],
        timeout_secs: float,
        on_hung: Callable[[str], None],
        action: str,
        report: Callable[[str], None] | None = None,
    ):
        self.timeout_secs = checks.check_positive_secs(
            "hung_task_timeout_secs", timeout_secs
        )
        self.given_up: list[tuple[str, float]] = []
        self._tasks = tasks
        self._on_hung = on_hung
        self._action = action
        self._report = report or logging.warning
        self._probe_secs = min(self.timeout_secs, health.DEFAULT_PROBE_TIMEOUT_SECS)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="HungTaskWatch", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """Ends the watch; returns within one probe's deadline."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._probe_secs + _PROBE_EVERY_SECS + 1.0)

    def _run(self) -> None:
        try:
            self._watch()
        except Exception:  # noqa: BLE001 - said, not lost with the thread.
            logging.exception("HungTaskWatch stopped; hung tasks are not detected")

    def _watch(self) -> None:
        silent_since: dict[str, float] = {}
        while not self._stop.wait(_PROBE_EVERY_SECS):
            tasks = dict(self._tasks())
            states = health.probe_all(tasks, self._probe_secs)
            if self._stop.is_set():
                return
            now = time.monotonic()
            for task, state in states.items():
                if state is not health.TaskState.SILENT:
                    silent_since.pop(task, None)
                    continue
                # Counted from the start of the first silent probe.
                since = silent_since.setdefault(task, now - self._probe_secs)
                if now - since < self.timeout_secs:
                    continue
                del silent_since[task]
                self.given_up.append((task, now - since))
                self._report(
                    f"hung task: {task} at {tasks[task]} has accepted connections "
                    f"without answering for {now - since:.0f} s "
                    f"(--hung_task_timeout_secs={self.timeout_secs:g}); given up at "
                    f"{time.strftime('%H:%M:%S')} and treated as lost: {self._action}"
                )
                try:
                    self._on_hung(task)
                except Exception:  # noqa: BLE001 - the watch goes on.
                    logging.exception("Could not act on hung task %s", task)
