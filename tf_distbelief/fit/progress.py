"""Progress of `training.fit`: console lines and TensorBoard scalars.

One step axis across runs: every line and scalar is numbered by the global
step, the steps finished over all workers and all runs (`fit` starts it at
the step its checkpoint recorded), so that a resumed run continues the
curves of the run before it instead of drawing over them.

Two cadences, by what reading a figure costs under parameter-server training:

* every `log_every_steps` steps (`interval/...` scalars and a `step` line):
  figures the coordinator reads without stopping the workers: examples per
  second from tf_keras's step counter on the ps, and under Downpour each
  replica's steps, staleness and bytes moved (its per-worker counters);
* at each epoch end (`epoch/...` scalars and an `epoch` line): loss and
  metrics, whose values are remote values on the workers: reading them
  (`fetch`) waits for every step in flight, which tf_keras does at epoch
  ends anyway; doing it more often would idle the workers each time.
"""

from __future__ import annotations

import threading
import time

import tensorflow as tf
import tf_keras
from absl import logging

from tf_distbelief import console, hooks
from tf_distbelief.fit import follower as follower_lib
from tf_distbelief.fit import lines
from tf_distbelief.fit import scalars as scalars_lib
from tf_distbelief.fit.scalars import EPOCH_PREFIX, INTERVAL_PREFIX
from tf_distbelief.tf_internals import keras_model


class Progress(tf_keras.callbacks.Callback):
    """Prints progress lines and writes TensorBoard scalars (see module docstring).

    tf_keras refuses `verbose=1` under parameter-server training, and its batch
    logs are remote values; this callback prints, flushed:

    * every `log_every_steps` finished steps: `step 300/500: 1,843
      examples/s, elapsed 12s, ETA 8s` (examples finished per second since
      the last line). Steps are scheduled ahead of the workers, so a thread
      reads tf_keras's step counter on the ps every 0.5 s and writes a line
      each time it passes a multiple (the step shown is the counter then);
    * at each epoch end: `epoch 3/5: steps 300/500 loss=0.1234
      accuracy=0.9600 1,843 examples/s, elapsed 12s, ETA 8s; goodput 61.2%`,
      an algorithm's figures in its words before the goodput
      (`hooks.FitHooks.figure_words`).

    The lines are `fit.lines.RunClock`'s, as Keras 3's. ETA assumes the rest
    of the run goes at this run's average speed.

    Args:
      batch_size: examples per step, for examples/s.
      log_every_steps: steps between progress lines and `interval/` scalars;
        0 per epoch only.
      tensorboard_dir: where to write scalars, or None.
      print_fn: where lines go (`console.echo`: stdout, flushed).
      epochs: the epoch the run ends at (for `epoch k/N` and ETA), or None.
      steps_per_epoch: steps per epoch (for `steps s/T`), or None.
      goodput: the job's `faults.goodput.Goodput`, or None: told the steps
        seen done; its percent ends each epoch's line (its whole line ends
        the job, printed by whoever made it), and its figures are written as
        `goodput/` scalars with the `interval/` and `epoch/` ones.
    """

    def __init__(
        self,
        batch_size,
        log_every_steps=0,
        tensorboard_dir=None,
        print_fn=console.echo,
        epochs=None,
        steps_per_epoch=None,
        goodput=None,
    ):
        super().__init__()
        self.goodput = goodput
        # Batch hooks are allowed under parameter-server training only for
        # callbacks that accept remote logs; this one never reads batch logs.
        self._supports_tf_logs = True
        self.batch_size = batch_size
        self.log_every_steps = log_every_steps
        self.print_fn = print_fn
        self.epochs = epochs
        self.total_steps = (
            epochs * steps_per_epoch if epochs and steps_per_epoch else None
        )
        self._writer = scalars_lib.ScalarWriter(tensorboard_dir)
        # Steps scheduled, over all runs; `fit` sets it to the resumed step.
        self.steps_done = 0
        self.history: list[dict] = []
        self._clock = None
        self._last_interval_step = -1
        self._follower = None
        # Lines and scalars come from the training thread and the follower.
        self._lock = threading.Lock()

    # -- hooks -----------------------------------------------------------

    def on_train_begin(self, logs=None):
        if self._clock is None:  # `fit` may call `Model.fit` twice.
            self._clock = lines.RunClock(self.steps_done, self.total_steps)
        # tf_keras sets its step counter to 0 at each `Model.fit`.
        self._fit_base_step = self.steps_done
        self._last_interval_step = max(self._last_interval_step, self.steps_done)
        self._last_replicas = self._replica_stats()
        try:
            counter = keras_model.train_counter(self.model)
        except AttributeError:  # A model without tf_keras's step counter.
            counter = None
        if self.log_every_steps and counter is not None:
            # A thread follows the finished steps (`follower`): tf_keras's
            # step counter, a ps variable (the model is built under the
            # strategy's scope), read without stopping the workers.
            self._follower = follower_lib.StepFollower(
                lambda: int(counter.numpy()),
                self.log_every_steps,
                self._fit_base_step,
                self.batch_size,
                self._log_interval,
                on_read=None if self.goodput is None else self.goodput.step_done,
                last_step=self._last_interval_step,
            )

    def on_train_end(self, logs=None):
        self.close()

    def close(self) -> None:
        """Stops following the finished steps (`training.fit` calls it, errors too)."""
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.close()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.monotonic()
        self._epoch_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps, steps = batch + 1, batch + 1 - self._epoch_steps
        self.steps_done += steps

    def _replica_stats(self):
        """Downpour's per-replica counters, or None (no Downpour, or a worker
        being replaced: its counters are gone with it; the figures of the next
        interval then count from the run's start)."""
        algorithm = hooks.of(self.model)
        if algorithm is None or algorithm.read_counters is None:
            return None
        try:
            return algorithm.read_counters()
        except (
            tf.errors.CancelledError,
            tf.errors.UnavailableError,
            tf.errors.AbortedError,  # A restarted worker, not reconnected yet.
        ) as e:
            logging.info("Progress: could not read Downpour's counters: %s", e)
            return None

    def _log_interval(self, finished, step, rate):
        del finished  # The follower's rate counts from it.
        scalars = {"examples_per_sec": rate}
        replicas = self._replica_stats()
        if replicas:
            algorithm = hooks.of(self.model)
            scalars.update(algorithm.interval_figures(replicas, self._last_replicas))
            self._last_replicas = replicas
        self._last_interval_step = step
        with self._lock:
            self.print_fn(self._clock.interval_line(step, rate))
        self._writer.write(INTERVAL_PREFIX, scalars, step)
        self._writer.write_goodput(self.goodput, step)

    def on_epoch_end(self, epoch, logs=None):
        secs = time.monotonic() - self._epoch_start
        rate = self._epoch_steps * self.batch_size / max(secs, 1e-9)
        logs = {k: _value(v) for k, v in (logs or {}).items()}
        self.history.append(
            dict(logs, examples_per_sec=rate, epoch=epoch + 1, steps=self.steps_done)
        )
        words, shown = "", logs
        algorithm = hooks.of(self.model)
        if algorithm is not None and algorithm.figure_words is not None:
            words, shown = algorithm.figure_words(logs)
        percent = None
        if self.goodput is not None:
            # The epoch's steps are done: tf_keras waited for them.
            self.goodput.step_done(self.steps_done)
            percent = self.goodput.totals()["percent"]
        with self._lock:
            self.print_fn(
                self._clock.epoch_line(
                    epoch + 1, self.epochs, self.steps_done, shown, rate, words, percent
                )
            )
        self._writer.write(
            EPOCH_PREFIX, dict(logs, examples_per_sec=rate), self.steps_done
        )
        if self.goodput is not None:
            self._writer.write_goodput(self.goodput, self.steps_done)


def _value(value):
    """An epoch log's value: a count (an int) as it is, else a float; a
    remote value is fetched."""
    value = value.fetch() if hasattr(value, "fetch") else value
    return value if isinstance(value, int) else float(value)
