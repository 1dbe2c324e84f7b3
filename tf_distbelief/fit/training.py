"""Training with tf_keras `Model.fit` on a DistBelief cluster.

The pieces a launch script needs, kept out of the script:
a per-worker dataset (`DatasetCreator`, one shard per replica), a progress
callback (tf_keras refuses `verbose=1` under parameter-server training),
checkpoints that let a rerun resume exactly (`resume`), a guard that keeps NaN
and inf off the ps (`nonfinite`), TensorBoard scalars, and test accuracy
computed on the coordinator.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief import checks, console, hooks, paths
from tf_distbelief.faults import (
    checkpoint_contents,
    preemption,
    resume,
    settings,
    tf_keras_fit,
)
from tf_distbelief.faults import goodput as goodput_lib
from tf_distbelief.faults import nonfinite as nonfinite_lib
from tf_distbelief.fit import shards, validation
from tf_distbelief.fit.progress import Progress


def dataset_creator(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    seed: int | None = 0,
    num_replicas: int | None = None,
) -> tf_keras.utils.experimental.DatasetCreator:
    """Returns a `DatasetCreator` giving each worker its own shard of the data.

    The replicas of Dean et al. 2012 (section 4.1) each read their own subset
    of the training data. TensorFlow's parameter-server strategy calls the
    dataset function with input pipeline 0 of 1 on every worker, so sharding
    by the `tf.distribute.InputContext` cannot tell the workers apart; this
    function shards by the worker index instead
    (`tf.distribute.coordinator.experimental_get_current_worker_index`, which
    the coordinator gives each worker's copy of the function): worker `i` of
    `W` reads records `i, i + W, i + 2W, ...`, shuffled within its shard, and
    repeats its shard. One pass of every worker over its shard reads each
    record exactly once; the workers' steps are scheduled dynamically, so
    within one `fit` epoch a faster worker may start its next pass while a
    slower one has not finished its first.

    A worker that is lost loses its iterator, the batches it had prefetched
    and the step in flight (the coordinator runs that step again on another
    worker, with that worker's data). Until it is back its shard is not read;
    restarted, it rebuilds its iterator and starts its shard again from the
    beginning, in a new order: in that pass the records it had read before the
    loss are read twice and the shard's other records once.

    Args:
      x: `[n, ...]` features.
      y: `[n, ...]` labels.
      batch_size: examples per step per worker, >= 1.
      seed: shuffle seed (None: a new order every run); each shard is
        reshuffled at each pass.
      num_replicas: shards (workers) to cut the data into; None reads the
        number of workers of the `DistBeliefStrategy` whose `fit` calls the
        function (1 under any other strategy). 1 gives every worker all the
        data.

    Returns:
      A `tf_keras.utils.experimental.DatasetCreator` for `Model.fit`.

    Raises:
      ValueError: `batch_size` or `num_replicas` < 1, or `x` and `y` differ in
        length.
    """
    if batch_size < 1:
        raise checks.argument_error("batch_size", ">= 1", batch_size)
    if num_replicas is not None and num_replicas < 1:
        raise checks.argument_error("num_replicas", ">= 1 or None", num_replicas)
    if len(x) != len(y):
        raise ValueError(
            f"`x` and `y` must have the same length. Received: {len(x)} and {len(y)}"
        )

    return tf_keras.utils.experimental.DatasetCreator(
        shards.arrays_dataset_fn(
            x,
            y,
            batch_size,
            seed,
            lambda: num_replicas or _num_workers(tf.distribute.get_strategy()),
        )
    )


def _num_workers(strategy) -> int:
    # `DistBeliefStrategy.num_workers`; TensorFlow's own strategy keeps its
    # `cluster_resolver` None inside `fit`, so others count as one replica.
    return max(1, getattr(strategy, "num_workers", 1))


class _CountSkipped(tf_keras.callbacks.Callback):
    """Adds the steps skipped for non-finite gradients to each epoch's logs."""

    def __init__(self, guard, print_fn):
        super().__init__()
        self._guard = guard
        self._print_fn = print_fn
        self._reported = 0

    def on_epoch_end(self, epoch, logs=None):
        if self._guard.mode != "skip":
            return  # A non-finite step stops the run instead.
        skipped = self._guard.skipped_steps()
        if logs is not None:
            logs["nonfinite_skipped"] = skipped
        if skipped > self._reported:
            self._reported = skipped
            unit = getattr(self._guard, "unit", "steps")  # Downpour: pushes.
            self._print_fn(
                f"nonfinite: {skipped} {unit} skipped so far (a NaN or inf "
                "gradient; --nonfinite=skip)"
            )


class _Finish(tf_keras.callbacks.Callback):
    """Runs the algorithm's end of training (`hooks.FitHooks.finish`) at the
    end of the job's last epoch, or of the epoch a callback stopped training
    in, once every step has run and before that step's checkpoint (put it
    before the `Checkpointer`); prints its lines."""

    def __init__(self, finish, epochs: int, print_fn):
        super().__init__()
        self._finish = finish
        self._epochs = epochs
        self._print_fn = print_fn
        self._done = False

    def on_epoch_end(self, epoch, logs=None):
        if self._done or (epoch + 1 < self._epochs and not self.model.stop_training):
            return
        self._done = True
        strategy = self.model.distribute_strategy
        if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            # The coordinator `fit` made (one per strategy): no step in flight.
            tf.distribute.experimental.coordinator.ClusterCoordinator(strategy).join()
        for line in self._finish():
            self._print_fn(line)


@dataclasses.dataclass
class FitResult:
    """What `fit` returns.

    Attributes:
      initial_epoch: epochs already done when this run started (from a checkpoint).
      epochs: epochs done at the end.
      history: per-epoch logs from `Progress` (loss, metrics, examples_per_sec).
      checkpoint_path: the last checkpoint written, or None without `model_dir`.
      initial_step: steps already done when this run started.
      steps: steps done at the end (`epochs * steps_per_epoch` once finished).
      nonfinite_skipped: steps whose update was skipped for a NaN or inf
        gradient in this run (`nonfinite="skip"`); Downpour: pushes.
    """

    initial_epoch: int
    epochs: int
    history: list
    checkpoint_path: str | None
    initial_step: int = 0
    steps: int = 0
    nonfinite_skipped: int = 0


def _check_count(name, value, why=""):
    checks.check_int(name, value, 1, f"an int >= 1{why}", f"an int >= 1{why}")


def fit(
    model: tf_keras.Model,
    data,
    epochs: int,
    steps_per_epoch: int,
    batch_size: int,
    model_dir: str | None = None,
    log_every_steps: int = 0,
    callbacks=(),
    print_fn=console.echo,
    checkpoint_every_steps: int = 0,
    nonfinite: str = "raise",
    validation_data=None,
    validation_freq=1,
    validation_steps: int | None = None,
    goodput: goodput_lib.Goodput | None = None,
) -> FitResult:
    """Runs `model.fit` with progress, checkpoints, exact resume and a NaN guard.

    With `model_dir`, the model's variables and every optimizer slot are
    created first and restored from the latest checkpoint in
    `model_dir/checkpoints` bit for bit, into any number of ps tasks, or an
    error says what does not match (`resume`). The run resumes at the step the
    checkpoint recorded, mid-epoch if need be, and trains to `epochs *
    steps_per_epoch` steps in all. A checkpoint is written after every epoch
    and every `checkpoint_every_steps` steps, so a failure loses at most that
    many steps; TensorBoard scalars go to `model_dir/tensorboard`, numbered
    by the global step, so that a resumed run continues the curves. Checkpoints
    hold the ps values (the coordinator reads them from the ps tasks) and are
    never written with a NaN or inf in them.

    A step whose gradients hold a NaN or inf is never applied (an algorithm
    with its own updates, such as Downpour's pushes, guards them through its
    `hooks.FitHooks`): with
    `nonfinite="raise"` the run stops with `NonFiniteError` naming the step
    and the variables, with `"skip"` the step is skipped and counted.

    Args:
      model: a compiled tf_keras model built under a `DistBeliefStrategy` scope.
      data: what `model.fit` accepts (a `DatasetCreator` from `dataset_creator`).
      epochs: the epoch to end at (as `Model.fit`'s `epochs`), >= 1.
      steps_per_epoch: steps per epoch over all workers, >= 1.
      batch_size: examples per step, for the examples/s figure.
      model_dir: checkpoints and logs, or None.
      log_every_steps: progress lines and `interval/` TensorBoard scalars
        every so many steps (0: per epoch only; see `progress`).
      callbacks: more tf_keras callbacks.
      print_fn: where progress lines go (stdout, flushed).
      checkpoint_every_steps: steps between checkpoints besides each epoch
        end, >= 0 (0: epoch ends only); needs `model_dir`.
      nonfinite: `raise` or `skip` (`tf_distbelief.faults.settings.NONFINITE_MODES`).
      validation_data: as `Model.fit`'s, evaluated exactly on the
        coordinator (`validation.ExactValidation`, first among the
        callbacks); `val_*` figures reach every callback. None: no validation.
      validation_freq: as `Model.fit`'s: every so many epochs, or the epochs.
      validation_steps: as `Model.fit`'s: batches per validation, or None.
      goodput: the job's `goodput.Goodput`, fed with when training runs,
        the steps done and the checkpoints' time; None: the job's
        (`goodput.current()`), or else one of this run's own, whose line
        `fit` prints at the end.

    Returns:
      A `FitResult`.

    Raises:
      ValueError: `epochs` or `steps_per_epoch` not an int >= 1, a bad
        `checkpoint_every_steps` or `nonfinite`.
      paths.ModelDirInUseError: another process trains into `model_dir`
        (`paths.ModelDirLock`, held for the run; re-entrant in one process).
      resume.RestoreError: the latest checkpoint in `model_dir` does not
        restore exactly into the model (nothing is deleted).
      errors.NonFiniteError: a step's gradients held a NaN or inf
        (`nonfinite="raise"`), or a checkpoint would have.
    """
    _check_count("epochs", epochs)
    _check_count(
        "steps_per_epoch",
        steps_per_epoch,
        " under parameter-server training (each worker reads its own repeated "
        "dataset, whose length tf_keras cannot infer: an epoch is this many "
        "steps over all workers)",
    )
    checks.check_checkpoint_cadence(model_dir, checkpoint_every_steps)
    settings.check_nonfinite_mode(nonfinite)
    with paths.model_dir_lock(model_dir, print_fn):
        own_goodput = goodput is None and goodput_lib.current() is None
        if goodput is None:
            goodput = goodput_lib.current() or goodput_lib.Goodput()
        progress = Progress(
            batch_size,
            log_every_steps,
            paths.tensorboard_dir(model_dir) if model_dir else None,
            print_fn,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch,
            goodput=goodput,
        )
        # The caller's callbacks first, so that logs they add are printed.
        all_callbacks = list(callbacks)
        if validation_data is not None:
            all_callbacks.insert(
                0,
                validation.ExactValidation(
                    validation_data, validation_freq, validation_steps
                ),
            )
        # An algorithm that applies its updates outside the optimizer's apply
        # (Downpour's pushes) brings its own guard, state and figures.
        algorithm = hooks.of(model)
        if algorithm is None:
            guard = tf_keras_fit.install_guard(model, nonfinite)
        else:
            guard = algorithm.install_guard(model, nonfinite)
        tf_keras_fit.install_exactly_once(
            model
        )  # No step applied twice after a worker loss.
        skipped_before = guard.skipped_steps()
        all_callbacks.append(_CountSkipped(guard, print_fn))
        all_callbacks.append(progress)
        if algorithm is not None and algorithm.finish is not None:
            all_callbacks.append(_Finish(algorithm.finish, epochs, print_fn))
        initial_step, manager, checkpointer = 0, None, None
        if model_dir:
            contents = checkpoint_contents.Contents(model, model.optimizer, algorithm)
            manager = contents.manager(model_dir)
            tf_keras_fit.build(model, data)
            if manager.latest_checkpoint:
                initial_step = resume.restore_contents(
                    contents, manager.latest_checkpoint, steps_per_epoch, print_fn
                )
            checkpointer = tf_keras_fit.Checkpointer(
                manager,
                contents.step,
                contents.epoch,
                steps_per_epoch,
                checkpoint_every_steps,
                before_save=None if contents.state is None else contents.state.capture,
                goodput=goodput,
            )
            all_callbacks.append(checkpointer)
        progress.steps_done = initial_step
        # A preemption's signal saves the step reached (`preemption`).
        with (
            contextlib.nullcontext()
            if checkpointer is None
            else preemption.saving(
                checkpointer.save_at_signal,
                checkpointer.cancel_queued,
                # `fit`'s wait for the epoch's last execution, cancelled.
                (tf.errors.CancelledError,),
            )
        ):
            _train(
                model, data, epochs, steps_per_epoch, all_callbacks, progress, goodput
            )
        if own_goodput:
            print_fn(goodput.line())
        return FitResult(
            initial_epoch=initial_step // steps_per_epoch,
            epochs=max(epochs, initial_step // steps_per_epoch),
            history=progress.history,
            checkpoint_path=manager.latest_checkpoint if manager else None,
            initial_step=initial_step,
            steps=max(initial_step, progress.steps_done),
            nonfinite_skipped=guard.skipped_steps() - skipped_before,
        )


def _train(model, data, epochs, steps_per_epoch, callbacks, progress, goodput):
    """`model.fit` from `progress.steps_done` to `epochs * steps_per_epoch` steps.

    A run resumed mid-epoch first trains the rest of that epoch.
    """
    initial_step = progress.steps_done
    initial_epoch, into = divmod(initial_step, steps_per_epoch)
    if initial_step >= epochs * steps_per_epoch:
        progress.print_fn(
            f"Already trained {initial_epoch} epochs (>= --epochs={epochs})."
        )
        return
    goodput.begin_training(initial_step)
    nonfinite_lib.quiet_reported_failures()  # Raised named below.
    failed = True
    try:
        if into:
            # The rest of the epoch the checkpoint stopped in.
            model.fit(
                data,
                epochs=initial_epoch + 1,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch - into,
                callbacks=callbacks,
                verbose=0,
            )
            initial_epoch += 1
        if initial_epoch < epochs:
            model.fit(
                data,
                epochs=epochs,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                callbacks=callbacks,
                verbose=0,
            )
        failed = False
    except tf.errors.InvalidArgumentError as e:
        error = nonfinite_lib.error_from(e)
        if error is None:
            raise
        raise error from None
    finally:
        progress.close()
        goodput.end_training(max(initial_step, progress.steps_done), failed)


def accuracy(
    model: tf_keras.Model, x: np.ndarray, y: np.ndarray, batch_size: int = 512
) -> float:
    """Returns the share of `x` whose argmax logit equals `y`, on the coordinator.

    The forward pass runs on the coordinator with the current ps values, so the
    figure is exact (no worker scheduling, every example counted once).

    Args:
      model: a tf_keras classifier mapping `[n, ...]` to `[n, num_classes]`.
      x: `[n, ...]` features.
      y: `[n]` integer labels.
      batch_size: examples per forward pass.

    Returns:
      Accuracy in [0, 1], a Python float.
    """
    predictions = np.concatenate(
        [
            np.argmax(model(x[i : i + batch_size], training=False).numpy(), axis=-1)
            for i in range(0, len(x), batch_size)
        ]
    )
    return float(np.mean(predictions == np.asarray(y).reshape(-1)))
