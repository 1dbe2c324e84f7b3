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
whatever its inter-op threads are doing) and gives up on a task that has
stayed `SILENT` for `timeout_secs`: it kills the task if it was told the
task's process id (a local cluster's tasks), so that TensorFlow sees a lost
task and its own recovery applies (the step in flight is run again
elsewhere, exactly once through the step tokens; the cluster's supervisor
restarts the task, which rejoins), prints one line naming the task and the
time it gave up, and calls `on_hung`. A task that is down (connection
refused) is not hung: the supervisor, an orchestrator, or the step watch
handles it.

The probes and the kill run in a process of their own
(`python -m tf_distbelief.cluster.local.hung_tasks`), not in a thread of the chief:
a thread runs only while no other thread of its process holds the Python GIL,
and a call that waits on a task without releasing it (a C++ call of
TensorFlow's that does not, or a long stretch of pure Python) would stop the
watch along with the chief. A watch thread of the chief, in 3 of 4 full test
runs on a loaded 2-core machine, let a ps stopped for 20 s pass as a 20 s
pause, never given up (`tests/faults/test_hung_tasks.py` now holds the GIL on
purpose while a ps is stopped). The watch process reads its orders (the
tasks' process ids) on stdin and ends when stdin closes (the chief stopped it
or died); it writes one JSON line per task it gave up on stdout, which a
thread of the chief turns into the printed line and `on_hung` as soon as the
chief runs Python again (the kill has by then ended any wait on the task).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping

from absl import logging

from tf_distbelief import checks
from tf_distbelief.cluster import health
from tf_distbelief.cluster.local import children, proc_stat

# A live server answers a probe in milliseconds, even mid-step; a stopped
# process never does. 30 s rides out a loaded machine's pauses (a probe was
# seen at 1.2 s) and costs a hung worker's step at most that long.
DEFAULT_HUNG_TASK_TIMEOUT_SECS = 30.0
_PROBE_EVERY_SECS = 1.0
# The watch process's start (Python and gRPC, no TensorFlow) and exit.
_PROCESS_SECS = 10.0


class HungTaskWatch:
    """Gives up on each task silent for `timeout_secs` in a row (own process).

    Args:
      tasks: `{task name: "host:port"}` of the ps and worker tasks to watch.
      timeout_secs: seconds (finite, > 0) a task may stay `SILENT` before it is
        given up; each probe waits at most the smaller of this and
        `health.DEFAULT_PROBE_TIMEOUT_SECS`.
      action: what giving up does, in words, ending the line that names the
        task (a local cluster's: it kills the task and restarts it).
      report: where the line naming a hung task goes (default:
        `absl.logging.warning`).
      on_hung: called with the task's name once it is given up and killed
        (if its process id was set); exceptions are logged, not raised.
      pids: `{task name: process id}` of the tasks that the watch kills when
        it gives them up (`set_pid` changes one); tasks without one are only
        named.

    Attributes:
      given_up: `(task name, seconds silent)` of every task given up, in order
        (appended when the chief's reader thread receives it).

    Raises:
      ValueError: `timeout_secs` is not a finite number of seconds > 0, or a
        task of `pids` is not one of `tasks`.
      OSError: the watch process could not start.
    """

    def __init__(
        self,
        tasks: Mapping[str, str],
        timeout_secs: float,
        action: str,
        report: Callable[[str], None] | None = None,
        on_hung: Callable[[str], None] | None = None,
        pids: Mapping[str, int] | None = None,
    ):
        self.timeout_secs = checks.check_positive_secs(
            "hung_task_timeout_secs", timeout_secs
        )
        unknown = sorted(set(pids or ()) - set(tasks))
        if unknown:
            raise ValueError(
                f"Argument `pids` names tasks that are not watched: {unknown}; "
                f"watched: {sorted(tasks)}"
            )
        self.given_up: list[tuple[str, float]] = []
        self._tasks = dict(tasks)
        self._action = action
        self._report = report or logging.warning
        self._on_hung = on_hung or (lambda task: None)
        self._probe_secs = min(self.timeout_secs, health.DEFAULT_PROBE_TIMEOUT_SECS)
        self._kills = bool(pids)
        self._stopping = False
        self._write_lock = threading.Lock()
        orders = {
            "tasks": self._tasks,
            "timeout_secs": self.timeout_secs,
            "probe_secs": self._probe_secs,
            "pids": {task: _identity(pid) for task, pid in (pids or {}).items()},
        }
        # -P (Python 3.11+): this package from `_env_with_this_package`, not
        # a copy of it in the working folder.
        safe_path = ["-P"] if sys.version_info >= (3, 11) else []
        self._process = children.popen_for_life(
            [sys.executable, *safe_path, "-m", __name__, json.dumps(orders)],
            env=_env_with_this_package(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=children.set_parent_death_signal,
        )
        self._reader = threading.Thread(
            target=self._read, name="HungTaskWatch", daemon=True
        )
        self._reader.start()

    def set_pid(self, task: str, pid: int | None) -> None:
        """Tells the watch the process id of `task` (None: do not kill it).

        Args:
          task: a watched task's name.
          pid: its process, running (not yet reaped), which the watch SIGKILLs
            when it gives the task up (and then forgets); None: none to kill.
            The watch knows the process by its id and start time
            (`/proc/PID/stat`), so that it never kills another process that
            got the same id after this one ended. Delivered to the watch
            process in order with the others, not awaited.

        Raises:
          ValueError: `task` is not watched.
        """
        if task not in self._tasks:
            raise checks.argument_error(
                "task", f"a watched task ({sorted(self._tasks)})", task
            )
        self._send({"pids": {task: None if pid is None else _identity(pid)}})

    def stop(self) -> None:
        """Ends the watch and its process.

        Returns after the watch process's round in progress (at most a probe's
        deadline and a pause), killing it after `_PROCESS_SECS` more.
        """
        self._stopping = True
        # Bounded: a `_send` of this thread's, interrupted by a signal handler
        # that stops the cluster, holds the lock.
        locked = self._write_lock.acquire(timeout=_PROBE_EVERY_SECS)
        try:
            with contextlib.suppress(OSError, ValueError):
                self._process.stdin.close()
        finally:
            if locked:
                self._write_lock.release()
        try:
            self._process.wait(self._probe_secs + _PROBE_EVERY_SECS + _PROCESS_SECS)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        if self._reader is not threading.current_thread():
            self._reader.join(_PROCESS_SECS)

    def _send(self, order: dict) -> None:
        with self._write_lock:
            if self._stopping:
                return
            try:
                self._process.stdin.write(json.dumps(order) + "\n")
                self._process.stdin.flush()
            except (OSError, ValueError):
                logging.warning(
                    "The hung task watch process has ended (code %s); order "
                    "not delivered: %s",
                    self._process.poll(),
                    order,
                )

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                self._given_up(json.loads(line))
            except Exception:  # noqa: BLE001 - read on: the watch goes on.
                logging.exception("Hung task watch: could not handle %r", line)
        code = self._process.wait()
        if not self._stopping:
            logging.error(
                "The hung task watch process ended (code %s); hung tasks are no "
                "longer detected",
                code,
            )

    def _given_up(self, event: dict) -> None:
        task, secs = event["task"], event["silent_secs"]
        self.given_up.append((task, secs))
        action = self._action
        if self._kills and not event["killed"]:
            action = "not killed: its process had ended or was not known"
        self._report(
            f"hung task: {task} at {self._tasks[task]} has accepted "
            f"connections without answering for {secs:.0f} s "
            f"(--hung_task_timeout_secs={self.timeout_secs:g}); given up at "
            f"{event['at']} and treated as lost: {action}"
        )
        try:
            self._on_hung(task)
        except Exception:  # noqa: BLE001 - the watch goes on.
            logging.exception("Could not act on hung task %s", task)


def _identity(pid: int) -> list:
    """`[pid, start time]` of a running process (start time None without /proc)."""
    return [pid, proc_stat.start_ticks(pid)]


def _kill(identity: list | None) -> bool:
    """SIGKILLs the process of `_identity`'s `identity` if it still is that one."""
    if identity is None:
        return False
    pid, start = identity
    if start is not None and proc_stat.start_ticks(pid) != start:
        return False  # Ended; the id may be another process's now.
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _env_with_this_package() -> dict:
    """This process's environment, with this package importable first."""
    # The folder that holds `tf_distbelief/cluster/local/`.
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))
    path = os.environ.get("PYTHONPATH")
    return dict(
        os.environ, PYTHONPATH=root if not path else f"{root}{os.pathsep}{path}"
    )


class _Watch:
    """The watch process's state: probes, gives up, kills (see the module)."""

    def __init__(self, orders: dict, stdout):
        self._tasks = orders["tasks"]
        self._pids = dict(orders["pids"])  # Task: `_identity`, or None.
        self._timeout_secs = orders["timeout_secs"]
        self._probe_secs = orders["probe_secs"]
        self._stdout = stdout
        self._lock = threading.Lock()
        self._ended = threading.Event()
        self._renewed: set[str] = set()  # A new process since the last round.
        self._silent_since: dict[str, float] = {}

    def run(self, stdin) -> None:
        """Rounds of probes until `stdin` (the chief's orders) closes."""
        threading.Thread(target=self._read_orders, args=(stdin,), daemon=True).start()
        while not self._ended.wait(_PROBE_EVERY_SECS):
            try:
                self._round()
            except BrokenPipeError:
                return  # The chief is gone.
            except Exception as e:  # noqa: BLE001 - said; the next round may do.
                print(f"hung task watch: a round failed: {e!r}", file=sys.stderr)

    def _read_orders(self, stdin) -> None:  # The chief's `set_pid`s.
        try:
            for line in stdin:
                order = json.loads(line)["pids"]
                with self._lock:
                    self._pids.update(order)
                    self._renewed.update(order)
        finally:
            self._ended.set()

    def _round(self) -> None:
        with self._lock:
            for task in self._renewed:
                self._silent_since.pop(task, None)  # The old process's silence.
            self._renewed.clear()
        states = health.probe_all(self._tasks, self._probe_secs)
        now = time.monotonic()
        for task, state in states.items():
            if state is not health.TaskState.SILENT:
                self._silent_since.pop(task, None)
                continue
            # Counted from the start of the first silent probe.
            since = self._silent_since.setdefault(task, now - self._probe_secs)
            if now - since < self._timeout_secs:
                continue
            del self._silent_since[task]
            with self._lock:
                identity = self._pids.pop(task, None)
            event = {
                "task": task,
                "silent_secs": now - since,
                "at": time.strftime("%H:%M:%S"),
                "killed": _kill(identity),
            }
            self._stdout.write(json.dumps(event) + "\n")
            self._stdout.flush()


def main(argv: list[str]) -> int:
    """`python -m tf_distbelief.cluster.local.hung_tasks ORDERS_JSON`, the
    process of a `HungTaskWatch`."""
    if len(argv) != 2:
        print(
            "usage: python -m tf_distbelief.cluster.local.hung_tasks ORDERS_JSON "
            "(started by HungTaskWatch)",
            file=sys.stderr,
        )
        return 2
    # Ctrl-C reaches the whole process group: the chief ends the watch.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(BrokenPipeError):
        _Watch(json.loads(argv[1]), sys.stdout).run(sys.stdin)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
