"""TensorBoard scalars of a training job, on one global step axis.

Both training paths write through `ScalarWriter`: tf_keras's
`progress.Progress` (the `interval/`, `epoch/` and `goodput/` scalars) and
Keras 3's `keras3.fit` (`epoch/` and `goodput/`). Every point is numbered by
the global step, the steps finished over all workers and all runs, so that a
resumed run continues the curves of the run before it. This module imports no
Keras.
"""

from __future__ import annotations

import threading

import tensorflow as tf

INTERVAL_PREFIX = "interval/"
EPOCH_PREFIX = "epoch/"
GOODPUT_PREFIX = "goodput/"


class ScalarWriter:
    """Writes scalars into one TensorBoard folder, from any thread.

    Args:
      tensorboard_dir: the folder (`paths.tensorboard_dir(model_dir)`), or
        None to write nothing.
    """

    def __init__(self, tensorboard_dir: str | None):
        self._writer = (
            tf.summary.create_file_writer(tensorboard_dir) if tensorboard_dir else None
        )
        self._last_goodput_step = -1
        self._lock = threading.Lock()

    def write(self, prefix: str, scalars: dict, step: int) -> None:
        """Writes `{name: float}` as `prefix + name` at global step `step`."""
        if self._writer is None or not scalars:
            return
        with self._lock, self._writer.as_default(step=step):
            for name, value in scalars.items():
                tf.summary.scalar(prefix + name, value)
            self._writer.flush()

    def write_goodput(self, goodput, step: int) -> None:
        """Writes `goodput.scalars()` as `goodput/...` at `step`.

        Only past the last goodput point: two cadences (an interval's and an
        epoch's) may see the same step.

        Args:
          goodput: the job's `faults.goodput.Goodput`, or None (nothing).
          step: the global step.
        """
        if goodput is None or self._writer is None:
            return
        with self._lock:
            if step <= self._last_goodput_step:
                return
            self._last_goodput_step = step
            with self._writer.as_default(step=step):
                for name, value in goodput.scalars().items():
                    tf.summary.scalar(GOODPUT_PREFIX + name, value)
                self._writer.flush()
