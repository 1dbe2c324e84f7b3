"""Following a training run's finished steps while the workers run.

Under parameter-server training steps are scheduled ahead of the workers (a
whole epoch at once when the closure queue has room), so a line written when
a step is scheduled says nothing. `StepFollower` reads a finished-step counter
on the ps from a thread, every `POLL_SECS`, without stopping the workers, and
calls back each time the count passes a multiple of `every` (the lines are
`fit.lines`'). Both training paths use it: tf_keras's `progress.Progress` and
Keras 3's `keras3.fit`. This module imports no Keras.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import tensorflow as tf
from absl import logging

# How often the thread reads the counter (one small read from a ps task), and
# how long closing waits for it.
POLL_SECS = 0.5
JOIN_SECS = 10.0


class StepFollower:
    """Calls `on_interval` each time `read_finished()` passes a multiple.

    Args:
      read_finished: reads the steps finished so far (a ps counter), e.g.
        `lambda: int(counter.numpy())`; an `OpError` (a task being replaced)
        is logged and the next look tells.
      every: the multiple, in global steps, >= 1.
      base_step: the global step of `read_finished() == 0`.
      batch_size: examples per step (per worker), for examples/s.
      on_interval: `(finished, step, examples_per_sec) -> None`, from the
        thread: the count read, its global step, and the examples finished
        per second since the last call (or since the follower started).
      last_step: the global step of the last call (a multiple already
        passed); None: `base_step`.
      on_read: optional `(global step) -> None` at every read (the goodput's
        steps seen).
    """

    def __init__(
        self,
        read_finished: Callable[[], int],
        every: int,
        base_step: int,
        batch_size: int,
        on_interval: Callable[[int, int, float], None],
        on_read: Callable[[int], None] | None = None,
        last_step: int | None = None,
    ):
        self._read = read_finished
        self._every = every
        self._base = base_step
        self._batch_size = batch_size
        self._last_time, self._last_finished = time.monotonic(), 0
        self._on_interval = on_interval
        self._on_read = on_read
        self.last_step = base_step if last_step is None else last_step
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._follow, name="tf_distbelief-progress", daemon=True
        )
        self._thread.start()

    def _follow(self):
        every = self._every
        while not self._stop.wait(POLL_SECS):
            try:
                finished = self._read()
            except tf.errors.OpError as e:
                logging.info("Progress: could not read the step counter: %s", e)
                continue
            step = self._base + finished
            if self._on_read is not None:
                self._on_read(step)
            if step // every > self.last_step // every:
                now = time.monotonic()
                secs = max(now - self._last_time, 1e-9)
                rate = (finished - self._last_finished) * self._batch_size / secs
                self._last_time, self._last_finished = now, finished
                self.last_step = step
                self._on_interval(finished, step, rate)

    def close(self) -> None:
        """Stops following (waits at most `JOIN_SECS` for the thread)."""
        self._stop.set()
        self._thread.join(JOIN_SECS)
