"""The epochs of a `keras3.fit` run: schedule, wait, checkpoint, evaluate, log.

`train` resumes from `model_dir`'s latest checkpoint (`keras3.checkpoints`),
then runs each epoch (`_Epochs`): its steps scheduled through the
`ClusterCoordinator` up to each mid-epoch checkpoint, waited for (a
non-finite gradient raised named), the ps values copied into the model, the
validation figures, the epoch's scalars and line, and the Keras 3 callbacks.
"""

from __future__ import annotations

import re
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from tf_distbelief import errors, paths
from tf_distbelief.faults import nonfinite as nonfinite_lib
from tf_distbelief.faults import preemption
from tf_distbelief.fit import follower as follower_lib
from tf_distbelief.fit import lines, scalars
from tf_distbelief.keras3 import checkpoints
from tf_distbelief.keras3 import step as step_lib
from tf_distbelief.keras3.training_args import FitArgs
from tf_distbelief.keras3.training_setup import Run
from tf_distbelief.tf_internals import coordinator as tf_coordinator


def train(run: Run, args: FitArgs, callbacks, goodput) -> keras.callbacks.History:
    """Trains `run` to `args.total_steps` steps; the `History` `keras3.fit` returns.

    Args:
      run: the run's objects (`training_setup.setup`).
      args: the checked arguments.
      callbacks: Keras 3 callbacks, or None.
      goodput: the job's `faults.goodput.Goodput`, or None.
    """
    model, weights = run.model, run.weights
    nonfinite_lib.quiet_reported_failures()  # Raised named by `_join`.
    saver = None
    initial_step = args.initial_epoch * args.steps_per_epoch
    if args.model_dir:
        saver = checkpoints.Checkpoints(
            args.model_dir,
            weights,
            args.steps_per_epoch,
            args.checkpoint_every_steps,
            algorithm=run.algorithm,
            print_fn=args.print_fn,
        )
        # A checkpoint's step wins over `initial_epoch` (never 0: none is
        # written before a step).
        initial_step = saver.restore() or initial_step
    # With a model_dir, `epoch/`, `interval/` and `goodput/` scalars.
    writer = scalars.ScalarWriter(
        paths.tensorboard_dir(args.model_dir) if args.model_dir else None
    )
    history = keras.callbacks.History()
    callback_list = keras.callbacks.CallbackList(
        [*(callbacks or ()), history],
        model=model,
        epochs=args.epochs,
        steps=args.steps_per_epoch,
        verbose=args.verbose,
    )
    model.stop_training = False
    epochs = _Epochs(run, args, saver, goodput, writer, initial_step)
    if initial_step >= args.total_steps:
        args.print_fn(
            f"Already trained {initial_step // args.steps_per_epoch} epochs "
            f"(>= --epochs={args.epochs})."
        )
        weights.write_to_model(model)
    elif saver is None:
        epochs.train(callback_list)
    else:
        # A preemption's signal saves the step reached (`faults.preemption`).
        with preemption.saving(
            epochs.save_at_signal,
            epochs.cancel_queued,
            # A wait for an execution the signal cancelled.
            (tf.errors.CancelledError,),
        ):
            epochs.train(callback_list)
    history.ps_weights = weights
    history.downpour = None if run.algorithm is None else run.algorithm.state
    history.initial_step = initial_step
    history.steps = epochs.done
    history.checkpoint_path = saver.latest if saver is not None else None
    history.nonfinite_skipped = run.skipped_since_start()
    history.applied_steps = (
        None if run.algorithm is not None else int(run.applied.numpy())
    )
    return history


class _Epochs:
    """The epochs from global step `done` on (see the module).

    Attributes:
      done: the global steps done; the epoch's end once it is waited for.
    """

    def __init__(self, run: Run, args: FitArgs, saver, goodput, writer, done: int):
        self.run, self.args = run, args
        self.saver, self.goodput, self.writer = saver, goodput, writer
        self.done = done
        # The epoch and step lines' elapsed time and ETA (`fit.lines`).
        self.clock = lines.RunClock(done, args.total_steps)
        # The executions scheduled since the last wait for all of them:
        # `(first step, executions, steps each, epoch end)`; and how many of
        # them a preemption's signal cancelled.
        self._scheduled = (done, 0, 1, done)
        self._cancelled = 0
        self._cancel_lock = threading.Lock()

    def train(self, callback_list) -> None:
        """Runs the epochs to `args.epochs` (or `model.stop_training`)."""
        run, args = self.run, self.args
        callback_list.on_train_begin()
        if self.goodput is not None:
            self.goodput.begin_training(self.done)
        follower = self._follow_steps()
        logs = {}
        failed = True
        try:
            for epoch in range(self.done // args.steps_per_epoch, args.epochs):
                callback_list.on_epoch_begin(epoch)
                logs = self._epoch(epoch)
                callback_list.on_epoch_end(epoch, logs)
                if run.model.stop_training:
                    break
            failed = False
        except errors.NonFiniteError:
            # The ps hold the steps before it, as a model after Keras's own
            # `fit` failed holds its weights at the failure.
            run.weights.write_to_model(run.model)
            raise
        finally:
            if follower is not None:
                follower.close()
            if self.goodput is not None:
                self.goodput.end_training(self.done, failed)
        callback_list.on_train_end(logs)

    def _finish(self) -> list[str]:
        """The algorithm's end of training (`hooks.FitHooks.finish`), after
        the job's last step and before its checkpoint; its lines, printed
        after the epoch's line."""
        algorithm = self.run.algorithm
        if algorithm is None or algorithm.finish is None:
            return []
        self.run.coordinator.join()
        return algorithm.finish()

    def _epoch(self, epoch: int) -> dict:
        """Trains epoch `epoch` from `done`; its logs."""
        run, args = self.run, self.args
        start, epoch_start_step = time.monotonic(), self.done
        results = self._run_epoch(epoch)
        logs = _logs(run.coordinator.fetch(results), run.metrics, run.metric_inits)
        if args.nonfinite == "skip":  # Else a non-finite step stops the run.
            logs["nonfinite_skipped"] = run.skipped_since_start()
        finished = self._finish() if epoch + 1 == args.epochs else []
        if self.saver is not None:
            self._save()
        run.weights.write_to_model(run.model)
        if args.validation_data is not None:
            logs.update(_validation_logs(run, args.validation_data, args.batch_size))
        rate = (self.done - epoch_start_step) * args.batch_size
        rate /= max(time.monotonic() - start, 1e-9)
        self.writer.write(
            scalars.EPOCH_PREFIX, dict(logs, examples_per_sec=rate), self.done
        )
        percent = None
        if self.goodput is not None:
            self.goodput.step_done(self.done)  # The epoch's steps are done.
            percent = self.goodput.totals()["percent"]
        self.writer.write_goodput(self.goodput, self.done)
        if args.verbose:
            args.print_fn(
                self.clock.epoch_line(
                    epoch + 1, args.epochs, self.done, logs, rate, "", percent
                )
            )
        for line in finished:
            args.print_fn(line)
        return logs

    def _run_epoch(self, epoch: int) -> list:
        """Schedules the rest of epoch `epoch` from `done`, waits for it.

        With a saver, the scheduling stops at each mid-epoch checkpoint: the
        steps before it finish (`join`), the checkpoint is written, and the
        next steps are scheduled.

        Returns:
          The scheduled functions' `RemoteValue`s.
        """
        run, per_execution = self.run, self.args.steps_per_execution
        end = (epoch + 1) * self.args.steps_per_epoch
        results = []
        while self.done < end:
            stop = end
            upcoming = None if self.saver is None else self.saver.next_save(self.done)
            if upcoming is not None and upcoming < end:
                stop = upcoming
            executions = -(-(stop - self.done) // per_execution)
            self._scheduled = (self.done, executions, per_execution, end)
            results += [
                run.coordinator.schedule(run.step, args=run.step_args())
                for _ in range(executions)
            ]
            self.done = min(self.done + executions * per_execution, end)
            _join(run.coordinator, epoch)
            if preemption.requested():
                preemption.save_and_stop(self.save_at_signal)
            if self.done < end:
                self._save()
        return results

    def cancel_queued(self) -> None:
        """Cancels the executions scheduled that no worker has started
        (`preemption.saving`'s `cancel`; from any thread)."""
        with self._cancel_lock:
            self._cancelled += tf_coordinator.cancel_queued(self.run.coordinator)

    def save_at_signal(self) -> tuple[int, bool]:
        """The checkpoint of the step reached, for a preemption's save.

        The executions not started are cancelled, those in flight finish,
        and the checkpoint records the steps of those that ran (the queue is
        first in, first out: the last scheduled are the ones cancelled).

        Returns:
          `(step, written)`: the step reached, and False when the latest
          checkpoint holds it already.
        """
        self.cancel_queued()
        self.run.coordinator.join()
        first, executions, per_execution, end = self._scheduled
        with self._cancel_lock:
            ran = max(0, executions - self._cancelled)
            self._cancelled = 0
        self.done = min(first + ran * per_execution, end)
        if self.done == self.saver.saved_step:
            return self.done, False
        self._save()
        return self.done, True

    def _save(self) -> None:
        if self.goodput is None:
            self.saver.save(self.done)
            return
        with self.goodput.timing("checkpointing"):
            self.saver.save(self.done)
        self.goodput.step_done(self.done)

    def _follow_steps(self):
        """`step 300/500: ... examples/s, elapsed, ETA` lines and `interval/`
        scalars every `log_every_steps` finished steps (`fit.follower`: the
        ps counter `applied`, read from a thread without stopping the
        workers); None for `log_every_steps` 0."""
        args, counter, goodput = self.args, self.run.applied, self.goodput
        if not args.log_every_steps:
            return None
        clock = self.clock
        first = int(counter.numpy())

        def on_interval(finished, step, rate):
            del finished
            args.print_fn(clock.interval_line(step, rate))
            self.writer.write(scalars.INTERVAL_PREFIX, {"examples_per_sec": rate}, step)
            self.writer.write_goodput(goodput, step)

        return follower_lib.StepFollower(
            lambda: int(counter.numpy()) - first,
            args.log_every_steps,
            self.done,
            args.batch_size,
            on_interval,
            on_read=None if goodput is None else goodput.step_done,
        )


def _logs(fetched, metrics, metric_inits) -> dict:
    """The epoch's logs from its functions' `(loss sum, losses, deltas)`."""
    logs = {"loss": float(sum(f[0] for f in fetched) / sum(f[1] for f in fetched))}
    for k, (metric, init) in enumerate(zip(metrics, metric_inits)):
        state = [
            i + sum(np.asarray(f[2][k][j]) for f in fetched) for j, i in enumerate(init)
        ]
        logs[metric.name] = float(metric.stateless_result(state))
    return logs


def _validation_logs(run: Run, validation_data, batch_size) -> dict:
    x_val, y_val = validation_data
    y_pred = run.model.predict(x_val, batch_size=max(batch_size, 256), verbose=0)
    logs = {"val_loss": float(run.loss_fn(y_val, y_pred))}
    for metric in run.metrics:
        metric.reset_state()
        metric.update_state(y_val, y_pred)
        logs[f"val_{metric.name}"] = float(metric.result())
        metric.reset_state()
    return logs


def _join(coordinator, epoch) -> None:
    """`coordinator.join()`, a step's non-finite gradient raised named."""
    try:
        coordinator.join()
    except tf.errors.InvalidArgumentError as error:
        if step_lib.NONFINITE_TAG in str(error):
            found = re.search(re.escape(step_lib.NONFINITE_TAG) + r"(\S+)", str(error))
            raise errors.NonFiniteError(
                f"Epoch {epoch + 1}: a step's gradient of weight "
                f"`{found.group(1)}` held NaN or inf; no ps variable took that "
                "step. Check the data and lower the learning rate, or pass "
                "`nonfinite='skip'` (--nonfinite=skip) to skip such steps.",
                step=None,
                variables=[found.group(1)],
            ) from error
        named = nonfinite_lib.error_from(error)  # A Downpour push.
        if named is None:
            raise
        raise named from error
