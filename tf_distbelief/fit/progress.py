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
from tf_distbelief.fit import scalars as scalars_lib
from tf_distbelief.fit.scalars import EPOCH_PREFIX, INTERVAL_PREFIX
from tf_distbelief.tf_internals import keras_model

# How often the follower thread reads the finished-step counter (one small
# read from a ps task), and how long closing waits for it.
_POLL_SECS = 0.5
_JOIN_SECS = 10.0


def _format(value) -> str:
    # Counts (a replica's steps, bytes per step) as integers.
    if float(value).is_integer() and abs(value) >= 10:
        return f"{int(value)}"
    return f"{value:.4f}"


class Progress(tf_keras.callbacks.Callback):
    """Prints progress lines and writes TensorBoard scalars (see module docstring).

    tf_keras refuses `verbose=1` under parameter-server training, and its batch
    logs are remote values; this callback prints, flushed:

    * every `log_every_steps` finished steps: `step 300/500: 1843 examples/s,
      elapsed 12s, ETA 8s` (examples finished per second since the last
      line). Steps are scheduled ahead of the workers, so a thread reads
      tf_keras's step counter on the ps every 0.5 s and writes a line each
      time it passes a multiple (the step shown is the counter then);
    * at each epoch end: `epoch 3/5: steps 300/500 loss=0.1234
      accuracy=0.9600 ... 1843 examples/s, elapsed 12s, ETA 8s`.

    ETA assumes the rest of the run goes at this run's average speed.

    Args:
      batch_size: examples per step, for examples/s.
      log_every_steps: steps between progress lines and `interval/` scalars;
        0 per epoch only.
      tensorboard_dir: where to write scalars, or None.
      print_fn: where lines go (`console.echo`: stdout, flushed).
      epochs: the epoch the run ends at (for `epoch k/N` and ETA), or None.
      steps_per_epoch: steps per epoch (for `steps s/T`), or None.
      goodput: the job's `faults.goodput.Goodput`, or None: told the steps
        seen done; its line is printed after each epoch's, and its figures
        written as `goodput/` scalars with the `interval/` and `epoch/` ones.
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
        self._run_start = None
        self._last_interval_step = -1
        self._thread = None
        # Lines and scalars come from the training thread and the follower.
        self._lock = threading.Lock()

    # -- time ------------------------------------------------------------

    def _timing(self, step) -> str:
        elapsed = time.monotonic() - self._run_start
        text = f"elapsed {console.duration(elapsed)}"
        done = step - self._run_start_step
        if self.total_steps and done > 0:
            remaining = max(0, self.total_steps - step)
            text += f", ETA {console.duration(remaining * elapsed / done)}"
        return text

    def _of_total(self, step) -> str:
        return f"{step}/{self.total_steps}" if self.total_steps else f"{step}"

    # -- hooks -----------------------------------------------------------

    def on_train_begin(self, logs=None):
        now = time.monotonic()
        if self._run_start is None:  # `fit` may call `Model.fit` twice.
            self._run_start, self._run_start_step = now, self.steps_done
        # tf_keras sets its step counter to 0 at each `Model.fit`.
        self._fit_base_step = self.steps_done
        self._last_interval_step = max(self._last_interval_step, self.steps_done)
        self._last_time, self._last_finished = now, 0
        self._last_replicas = self._replica_stats()
        if self.log_every_steps and hasattr(self.model, "train_function"):
            # Steps are scheduled ahead of the workers (a whole epoch at
            # once when the closure queue has room): lines at scheduling
            # time would say nothing. A thread follows the finished steps.
            self._stop = threading.Event()
            self._thread = threading.Thread(
                target=self._follow, name="tf_distbelief-progress", daemon=True
            )
            self._thread.start()

    def on_train_end(self, logs=None):
        self.close()

    def close(self) -> None:
        """Stops following the finished steps (`training.fit` calls it, errors too)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(_JOIN_SECS)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.monotonic()
        self._epoch_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self._epoch_steps, steps = batch + 1, batch + 1 - self._epoch_steps
        self.steps_done += steps

    def _follow(self):
        every = self.log_every_steps
        while not self._stop.wait(_POLL_SECS):
            try:
                # A ps variable (the model is built under the strategy's
                # scope): read while the workers run, without stopping them.
                finished = int(keras_model.train_counter(self.model).numpy())
                step = self._fit_base_step + finished
                if self.goodput is not None:
                    self.goodput.step_done(step)
                if step // every > self._last_interval_step // every:
                    self._log_interval(finished, step)
            except AttributeError:
                return  # A model without tf_keras's step counter.
            except tf.errors.OpError as e:
                # A task being replaced: the next look will tell.
                logging.info("Progress: could not read the step counter: %s", e)

    def _replica_stats(self):
        """Downpour's per-replica counters, or None (no Downpour, or a worker
        being replaced: its counters are gone with it; the figures of the next
        interval then count from the run's start)."""
        algorithm = hooks.of(self.model)
        if algorithm is None or algorithm.read_counters is None:
            return None
        try:
            return algorithm.read_counters()
        except (tf.errors.CancelledError, tf.errors.UnavailableError) as e:
            logging.info("Progress: could not read Downpour's counters: %s", e)
            return None

    def _log_interval(self, finished, step):
        now = time.monotonic()
        secs = max(now - self._last_time, 1e-9)
        rate = (finished - self._last_finished) * self.batch_size / secs
        scalars = {"examples_per_sec": rate}
        replicas = self._replica_stats()
        if replicas:
            algorithm = hooks.of(self.model)
            scalars.update(algorithm.interval_figures(replicas, self._last_replicas))
            self._last_replicas = replicas
        self._last_time, self._last_finished = now, finished
        self._last_interval_step = step
        with self._lock:
            self.print_fn(
                f"step {self._of_total(step)}: {rate:.0f} examples/s, "
                + self._timing(step)
            )
        self._writer.write(INTERVAL_PREFIX, scalars, step)
        self._writer.write_goodput(self.goodput, step)

    def on_epoch_end(self, epoch, logs=None):
        secs = time.monotonic() - self._epoch_start
        rate = self._epoch_steps * self.batch_size / max(secs, 1e-9)
        logs = {
            k: float(v.fetch() if hasattr(v, "fetch") else v)
            for k, v in (logs or {}).items()
        }
        logs["examples_per_sec"] = rate
        self.history.append(dict(logs, epoch=epoch + 1, steps=self.steps_done))
        shown = {k: v for k, v in logs.items() if k not in ("loss", "examples_per_sec")}
        metrics = " ".join(
            f"{k}={_format(v)}"
            for k, v in [("loss", logs.get("loss"))] + sorted(shown.items())
            if v is not None
        )
        epochs = f"{epoch + 1}/{self.epochs}" if self.epochs else f"{epoch + 1}"
        with self._lock:
            self.print_fn(
                f"epoch {epochs}: steps {self._of_total(self.steps_done)} {metrics} "
                f"{rate:.0f} examples/s, {self._timing(self.steps_done)}"
            )
        self._writer.write(EPOCH_PREFIX, logs, self.steps_done)
        if self.goodput is not None:
            # The epoch's steps are done: tf_keras waited for them.
            self.goodput.step_done(self.steps_done)
            with self._lock:
                self.print_fn(self.goodput.line())
            self._writer.write_goodput(self.goodput, self.steps_done)
