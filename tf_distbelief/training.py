"""Training with tf_keras `Model.fit` on a DistBelief cluster.

The pieces a launch script needs, kept out of the script (STYLE.md, habit 7):
a per-worker dataset (`DatasetCreator`), a progress callback (tf_keras refuses
`verbose=1` under parameter-server training), checkpoints that let a rerun resume,
TensorBoard scalars, and test accuracy computed on the coordinator.
"""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import tensorflow as tf
import tf_keras
from absl import logging

CHECKPOINT_SUBDIR = "checkpoints"
TENSORBOARD_SUBDIR = "tensorboard"
# Checkpoints kept by the CheckpointManager; it only ever deletes its own
# `ckpt-N` files, never anything else in `model_dir`.
MAX_CHECKPOINTS_TO_KEEP = 3


def dataset_creator(
    x: np.ndarray, y: np.ndarray, batch_size: int, seed: int = 0
) -> tf_keras.utils.experimental.DatasetCreator:
    """Returns a `DatasetCreator` giving each worker a shuffled, repeated copy.

    Each worker (model replica) builds its own input pipeline, shuffled with its
    own order, as the replicas of Dean et al. 2012 (section 4.1) each read their
    own stream of the training data.

    Args:
      x: `[n, ...]` features.
      y: `[n, ...]` labels.
      batch_size: examples per step per worker, >= 1.
      seed: shuffle seed; ops-level seeds still differ per worker.

    Returns:
      A `tf_keras.utils.experimental.DatasetCreator` for `Model.fit`.

    Raises:
      ValueError: `batch_size` < 1 or `x` and `y` differ in length.
    """
    if batch_size < 1:
        raise ValueError(f"Argument `batch_size` must be >= 1. Received: {batch_size}")
    if len(x) != len(y):
        raise ValueError(
            f"`x` and `y` must have the same length. Received: {len(x)} and {len(y)}"
        )

    def dataset_fn(input_context):
        del input_context  # One input pipeline per worker under PSS.
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        ds = ds.shuffle(
            len(x), seed=None if seed is None else seed, reshuffle_each_iteration=True
        )
        return ds.repeat().batch(batch_size, drop_remainder=True).prefetch(2)

    return tf_keras.utils.experimental.DatasetCreator(dataset_fn)


class Progress(tf_keras.callbacks.Callback):
    """Prints and logs progress: steps done, loss, examples/s.

    tf_keras refuses `verbose=1` under parameter-server training, and its batch
    logs are remote values; this callback prints every `log_every_steps` steps
    (steps scheduled and seconds, no synchronisation) and at each epoch end
    (steps done, loss, metrics and examples/s), and writes the epoch scalars to
    TensorBoard.

    Args:
      batch_size: examples per step, for examples/s.
      log_every_steps: steps between progress lines; 0 prints epoch lines only.
      tensorboard_dir: where to write scalars, or None.
      print_fn: where lines go (`print` by default).
    """

    def __init__(
        self, batch_size, log_every_steps=0, tensorboard_dir=None, print_fn=print
    ):
        super().__init__()
        # Batch hooks are allowed under parameter-server training only for
        # callbacks that accept remote logs; this one never reads batch logs.
        self._supports_tf_logs = True
        self.batch_size = batch_size
        self.log_every_steps = log_every_steps
        self.print_fn = print_fn
        self._writer = (
            tf.summary.create_file_writer(tensorboard_dir) if tensorboard_dir else None
        )
        self.steps_done = 0
        self.history: list[dict] = []

    def on_train_begin(self, logs=None):
        self._start = time.monotonic()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_start = time.monotonic()
        self._epoch_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        steps = batch + 1 - self._epoch_steps
        self._epoch_steps = batch + 1
        self.steps_done += steps
        if self.log_every_steps and self.steps_done % self.log_every_steps < steps:
            # Steps are scheduled asynchronously: this counts steps handed to
            # workers; the epoch line below reports finished work.
            self.print_fn(
                f"step {self.steps_done} scheduled, "
                f"{time.monotonic() - self._start:.1f} s"
            )

    def on_epoch_end(self, epoch, logs=None):
        secs = time.monotonic() - self._epoch_start
        rate = self._epoch_steps * self.batch_size / max(secs, 1e-9)
        logs = {
            k: float(v.fetch() if hasattr(v, "fetch") else v)
            for k, v in (logs or {}).items()
        }
        logs["examples_per_sec"] = rate
        self.history.append(dict(logs, epoch=epoch + 1, steps=self.steps_done))
        metrics = " ".join(f"{k}={v:.4f}" for k, v in sorted(logs.items()))
        self.print_fn(f"epoch {epoch + 1}: steps {self.steps_done} {metrics}")
        if self._writer is not None:
            with self._writer.as_default(step=self.steps_done):
                for name, value in logs.items():
                    tf.summary.scalar(name, value)
            self._writer.flush()


class _SaveEachEpoch(tf_keras.callbacks.Callback):
    def __init__(self, manager, epoch_var):
        super().__init__()
        self._manager = manager
        self._epoch_var = epoch_var

    def on_epoch_end(self, epoch, logs=None):
        self._epoch_var.assign(epoch + 1)
        path = self._manager.save(checkpoint_number=epoch + 1)
        logging.info("Saved checkpoint %s", path)


@dataclasses.dataclass
class FitResult:
    """What `fit` returns.

    Attributes:
      initial_epoch: epochs already done when this run started (from a checkpoint).
      epochs: epochs done at the end.
      history: per-epoch logs from `Progress` (loss, metrics, examples_per_sec).
      checkpoint_path: the last checkpoint written, or None without `model_dir`.
    """

    initial_epoch: int
    epochs: int
    history: list
    checkpoint_path: str | None


def fit(
    model: tf_keras.Model,
    data,
    epochs: int,
    steps_per_epoch: int,
    batch_size: int,
    model_dir: str | None = None,
    log_every_steps: int = 0,
    callbacks=(),
    print_fn=print,
) -> FitResult:
    """Runs `model.fit` with progress, checkpoints and resume.

    With `model_dir`, the model and optimizer are restored from the latest
    checkpoint in `model_dir/checkpoints` (a rerun resumes at the epoch the last
    run stopped), a checkpoint is written after every epoch, and TensorBoard
    scalars go to `model_dir/tensorboard`. Checkpoints hold the ps values (the
    coordinator reads them from the ps tasks).

    Args:
      model: a compiled tf_keras model built under a `DistBeliefStrategy` scope.
      data: what `model.fit` accepts (a `DatasetCreator` from `dataset_creator`).
      epochs: the epoch to end at (as `Model.fit`'s `epochs`), >= 1.
      steps_per_epoch: steps per epoch over all workers, >= 1.
      batch_size: examples per step, for the examples/s figure.
      model_dir: checkpoints and logs, or None.
      log_every_steps: progress lines every so many steps (0: per epoch only).
      callbacks: more tf_keras callbacks.
      print_fn: where progress lines go.

    Returns:
      A `FitResult`.

    Raises:
      ValueError: `epochs` or `steps_per_epoch` < 1, or a checkpoint in
        `model_dir` does not match the model (nothing is deleted).
    """
    for name, value in (("epochs", epochs), ("steps_per_epoch", steps_per_epoch)):
        if value < 1:
            raise ValueError(f"Argument `{name}` must be >= 1. Received: {value}")
    progress = Progress(
        batch_size,
        log_every_steps,
        os.path.join(model_dir, TENSORBOARD_SUBDIR) if model_dir else None,
        print_fn,
    )
    # The caller's callbacks first, so that logs they add are printed.
    all_callbacks = [*callbacks, progress]
    initial_epoch = 0
    manager = None
    if model_dir:
        epoch_var = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        checkpoint = tf.train.Checkpoint(
            model=model, optimizer=model.optimizer, epoch=epoch_var
        )
        manager = tf.train.CheckpointManager(
            checkpoint,
            os.path.join(model_dir, CHECKPOINT_SUBDIR),
            max_to_keep=MAX_CHECKPOINTS_TO_KEEP,
        )
        if manager.latest_checkpoint:
            try:
                checkpoint.restore(
                    manager.latest_checkpoint
                ).assert_existing_objects_matched()
            except (AssertionError, ValueError, tf.errors.OpError) as e:
                raise ValueError(
                    f"The checkpoint {manager.latest_checkpoint} in `model_dir` "
                    f"{model_dir!r} does not match this model "
                    f"({' '.join(str(e).split())[:300]}). Use another "
                    "`model_dir`; nothing was deleted."
                ) from None
            initial_epoch = int(epoch_var.numpy())
            print_fn(
                f"Resumed from {manager.latest_checkpoint} at epoch {initial_epoch}"
            )
        all_callbacks.append(_SaveEachEpoch(manager, epoch_var))
    if initial_epoch >= epochs:
        print_fn(f"Already trained {initial_epoch} epochs (>= --epochs={epochs}).")
    else:
        model.fit(
            data,
            epochs=epochs,
            initial_epoch=initial_epoch,
            steps_per_epoch=steps_per_epoch,
            callbacks=all_callbacks,
            verbose=0,
        )
    return FitResult(
        initial_epoch=initial_epoch,
        epochs=max(epochs, initial_epoch),
        history=progress.history,
        checkpoint_path=manager.latest_checkpoint if manager else None,
    )


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
