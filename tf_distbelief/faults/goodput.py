"""Goodput: where a job's wall time went, and the share of it that trained.

A `Goodput` accounts the wall time from the process's start (or from a
`fit` called directly) in parts that sum to it:

* `train`: training steps done for the first time;
* `redone`: steps done again after a fault: a run restored at step R after
  steps up to S had finished does steps R..S again (the step counter went
  back); their share of the time of the training that redid them;
* `checkpointing`: writing checkpoints (checking the values, the write; the
  wait for the steps already scheduled before it is training, which the
  workers do meanwhile);
* `recovery`: from the last step seen finishing before a failure (a lost ps
  task) to the first step after it: detecting it, waiting for the task to
  serve again, rebuilding and restoring;
* `start-up`: from the process's start to its first step (TensorFlow's
  import, the local cluster, connecting, building, restoring);
* `other`: the rest (evaluating, exporting, what happens after training).

Each part is fed by what knows it: `training.fit` says when training runs
(`begin_training`, `end_training`), its progress callback and the
`Checkpointer` say which steps are done (`step_done`), the `Checkpointer`
times each write (`add("checkpointing", secs)`), and the job runner makes the
accountant at the process's start (`process_start_secs`). `line()` is the
job's closing line, `scalars()` its TensorBoard figures (`goodput/*`);
`losses_line()` follows it when tasks announced their loss
(`announced_loss`, from `cluster.announce`).

No TensorFlow: pure bookkeeping, safe from any thread.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable

from tf_distbelief import checks
from tf_distbelief.cluster.local import proc_stat

__all__ = ["PARTS", "Goodput", "active", "current", "process_start_secs"]

# The parts of the wall time besides `train`, in the order `line` shows them.
PARTS = ("checkpointing", "recovery", "start-up", "redone", "other")

_CURRENT: list[Goodput] = []


def process_start_secs(clock: Callable[[], float] = time.monotonic) -> float:
    """When this process started, on `clock`'s scale (`time.monotonic`).

    Read from `/proc/self/stat` (Linux); elsewhere, now.
    """
    now = clock()
    try:
        started_ticks = int(proc_stat.fields()[proc_stat.START_FIELD])
        with open("/proc/uptime") as f:
            uptime_secs = float(f.read().split()[0])
        started_secs = started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return now
    return now - max(0.0, uptime_secs - started_secs)


def current() -> Goodput | None:
    """The accountant of the job running in this process (`active`), or None."""
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def active(goodput: Goodput):
    """Makes `goodput` the `current()` accountant while in the block."""
    _CURRENT.append(goodput)
    try:
        yield goodput
    finally:
        _CURRENT.remove(goodput)


class Goodput:
    """The wall time of one job, by part (see the module docstring).

    Args:
      origin_secs: when the job started, on `clock`'s scale (default: now).
      clock: seconds, monotonic (default: `time.monotonic`).

    Attributes:
      origin_secs: when the job started, on `clock`'s scale.
      trained: whether training has begun (`begin_training`).
    """

    def __init__(
        self,
        origin_secs: float | None = None,
        clock: Callable[[], float] | None = None,
    ):
        self._clock = clock or time.monotonic
        self.origin_secs = self._clock() if origin_secs is None else origin_secs
        self._secs = dict.fromkeys(("train", *PARTS), 0.0)
        self._lock = threading.Lock()
        # Training running now: its start time and step, seconds of other
        # parts inside it, and the most steps seen done in it.
        self._segment: dict | None = None
        # Between trainings: what the time counts as, since when.
        self._gap_part, self._gap_start = "start-up", self.origin_secs
        self._gap_other_secs = 0.0
        self._high_step = 0  # The most steps ever seen done.
        self._last_done_secs: float | None = None
        self.trained = False
        # `(seconds since the origin, what)` of each announced loss.
        self._announced: list[tuple[float, str]] = []

    def begin_training(self, step: int) -> None:
        """Training starts (or starts again) with `step` steps done."""
        with self._lock:
            now = self._clock()
            self._close_gap(now)
            self._segment = {
                "start": now,
                "step": step,
                "high": self._high_step,
                "inner": 0.0,
                "seen": step,
            }
            self._last_done_secs = now
            self.trained = True

    def step_done(self, step: int) -> None:
        """`step` steps are done (over all runs), as seen now."""
        with self._lock:
            self._last_done_secs = self._clock()
            self._high_step = max(self._high_step, step)
            if self._segment is not None:
                self._segment["seen"] = max(self._segment["seen"], step)

    def end_training(self, step: int | None = None, failed: bool = False) -> None:
        """Training stops: finished with `step` steps, or `failed`.

        After a failure, the time since the last step seen done, and until
        training begins again, is recovery.
        """
        with self._lock:
            segment, self._segment = self._segment, None
            if segment is None:
                return
            now = self._clock()
            end = now
            if failed:
                end = max(segment["start"], self._last_done_secs or now)
                self._secs["recovery"] += now - end
                self._gap_part = "recovery"
            else:
                self._gap_part = "other"
                if step is not None:
                    self._high_step = max(self._high_step, step)
                    segment["seen"] = max(segment["seen"], step)
            self._gap_start, self._gap_other_secs = now, 0.0
            self._split(segment, end, self._secs)

    def add(self, part: str, secs: float) -> None:
        """Counts `secs` seconds as `part` (one of `PARTS`), out of the time
        they were spent in (training or between trainings)."""
        if part not in PARTS:
            raise checks.argument_error("part", f"one of {PARTS}", part)
        with self._lock:
            self._secs[part] += secs
            if self._segment is not None:
                self._segment["inner"] += secs
            else:
                self._gap_other_secs += secs

    def announced_loss(self, what: str) -> None:
        """A task announced it is stopping (`cluster.announce`): `what` says
        which and why (`worker 1 at HOST:PORT announced it is stopping
        (SIGTERM)`). Its cost is counted in the parts as any loss's (the
        recovery, the steps redone); `losses_line` lists it."""
        with self._lock:
            self._announced.append((self._clock() - self.origin_secs, what))

    def losses_line(self) -> str | None:
        """`announced losses: 1 (worker 1 ... (SIGTERM) at 52.3 s)`, or None
        when no task announced its loss."""
        with self._lock:
            announced = list(self._announced)
        if not announced:
            return None
        each = "; ".join(f"{what} at {secs:.1f} s" for secs, what in announced)
        return f"announced losses: {len(announced)} ({each})"

    @contextlib.contextmanager
    def timing(self, part: str):
        """Counts the time in the block as `part`."""
        start = self._clock()
        try:
            yield
        finally:
            self.add(part, self._clock() - start)

    # -- figures -----------------------------------------------------------

    def totals(self) -> dict[str, float]:
        """Seconds by part as of now, and `wall` (their sum) and `percent`."""
        with self._lock:
            now = self._clock()
            secs = dict(self._secs)
            if self._segment is not None:
                self._split(self._segment, now, secs)
            else:
                secs[self._gap_part] += max(
                    0.0, now - self._gap_start - self._gap_other_secs
                )
        wall = max(now - self.origin_secs, 1e-9)
        secs["other"] += max(0.0, wall - sum(secs.values()))
        secs["wall"] = wall
        secs["percent"] = 100.0 * secs["train"] / wall
        return secs

    def line(self) -> str:
        """`goodput: 93.1% (train 410.2 s of 440.6 s; checkpointing 8.1 s, ...)`."""
        t = self.totals()
        parts = ", ".join(f"{p} {t[p]:.1f} s" for p in PARTS)
        return (
            f"goodput: {t['percent']:.1f}% (train {t['train']:.1f} s of "
            f"{t['wall']:.1f} s; {parts})"
        )

    def end_lines(self) -> list[str]:
        """The lines that end a job's output: `line()` and `losses_line()`
        (when a task announced its loss); none before training began."""
        if not self.trained:
            return []
        losses = self.losses_line()
        return [self.line()] + ([losses] if losses is not None else [])

    def scalars(self) -> dict[str, float]:
        """`{"percent": ..., "train_secs": ..., "start_up_secs": ...}` for
        TensorBoard (under `goodput/`)."""
        t = self.totals()
        figures = {"percent": t["percent"], "wall_secs": t["wall"]}
        for part in ("train", *PARTS):
            figures[part.replace("-", "_") + "_secs"] = t[part]
        return figures

    # -- inside ------------------------------------------------------------

    def _close_gap(self, now: float) -> None:
        self._secs[self._gap_part] += max(
            0.0, now - self._gap_start - self._gap_other_secs
        )
        self._gap_start, self._gap_other_secs = now, 0.0

    @staticmethod
    def _split(segment: dict, end: float, secs: dict) -> None:
        """Adds the steps' time of `segment` until `end` to train and redone."""
        busy = max(0.0, end - segment["start"] - segment["inner"])
        steps = segment["seen"] - segment["step"]
        redone = max(0, min(segment["high"], segment["seen"]) - segment["step"])
        share = redone / steps if steps > 0 else 0.0
        secs["redone"] += busy * share
        secs["train"] += busy * (1.0 - share)
