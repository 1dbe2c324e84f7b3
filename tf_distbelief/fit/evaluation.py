"""The evaluator task: every checkpoint of a training run, in order, to TensorBoard.

tf_keras's `SidecarEvaluator` evaluates the latest checkpoint each time it
looks, so checkpoints written faster than it evaluates are never evaluated,
and nothing says which. This loop reads the `CheckpointManager`'s list of
checkpoints (written after each checkpoint is complete), evaluates each one it
has not evaluated yet, oldest first, writes `eval/<metric>` scalars at the
checkpoint's global step (the step axis of the training scalars) and prints
which checkpoint it evaluated. A checkpoint deleted before it could be read
(the trainer keeps the last few) is named as skipped; so is an epoch's
checkpoint that was written and deleted between two looks.
"""

from __future__ import annotations

import os
import time

import tensorflow as tf
import tf_keras

from tf_distbelief import checks, console, paths
from tf_distbelief.faults import checkpoint_contents

# Long enough for a trainer that restarts (a new pod, TensorFlow loading,
# restoring), short enough that an evaluator whose trainer is gone ends.
DEFAULT_TIMEOUT_SECS = 3600.0
_POLL_SECS = 0.5
EVAL_PREFIX = "eval/"


def checkpoint_step(path: str) -> int:
    """The global step of checkpoint `path` (its `step`, else its number)."""
    try:
        return int(
            tf.train.load_checkpoint(path).get_tensor(checkpoint_contents.STEP_KEY)
        )
    except (tf.errors.NotFoundError, ValueError):
        number = paths.checkpoint_number(path)
        if number is None:
            raise
        return number


def _listed(checkpoint_dir: str) -> list[str]:
    state = tf.train.get_checkpoint_state(checkpoint_dir)
    if state is None:
        return []
    return [
        p if os.path.isabs(p) else os.path.join(checkpoint_dir, p)
        for p in state.all_model_checkpoint_paths
    ]


def _number(path: str) -> int:
    number = paths.checkpoint_number(path)
    return -1 if number is None else number


def evaluate_checkpoints(
    model: tf_keras.Model,
    data,
    checkpoint_dir: str,
    last_step: int,
    tensorboard_dir: str | None = None,
    steps_per_epoch: int | None = None,
    timeout_secs: float = DEFAULT_TIMEOUT_SECS,
    print_fn=console.echo,
    read_checkpoint=None,
) -> dict[int, dict[str, float]]:
    """Evaluates each checkpoint in `checkpoint_dir` as it appears, until `last_step`.

    Checkpoints are those `training.fit` writes (`ckpt-<step>`, the model
    under `model`); only the model's weights are read, and every weight of
    `model` must be in the checkpoint (`assert_existing_objects_matched`).

    Args:
      model: a compiled tf_keras model with the trained model's layers (not
        under a parameter-server strategy), or a compiled Keras 3 model with
        `read_checkpoint`.
      data: what `model.evaluate` takes (the test set, batched).
      checkpoint_dir: where the trainer's `CheckpointManager` writes.
      last_step: the global step of the run's last checkpoint; the loop ends
        once it has evaluated (or skipped) a checkpoint at or after it.
      tensorboard_dir: where `eval/<metric>` scalars go, or None.
      steps_per_epoch: with it, epoch-end checkpoints (steps that are
        multiples of it) never seen are reported as skipped.
      timeout_secs: the longest wait for a new checkpoint, > 0.
      print_fn: where lines go.
      read_checkpoint: None (a tf_keras model under `model` in the
        checkpoint), or `path -> None` loading checkpoint `path` into
        `model`'s weights (a Keras 3 job's: `keras3.checkpoints.read_weights`),
        raising `tf.errors.NotFoundError` for a checkpoint that is gone.

    Returns:
      `{step: {metric: value}}` for each checkpoint evaluated.

    Raises:
      ValueError: `timeout_secs` not > 0.
      TimeoutError: no new checkpoint for `timeout_secs` before `last_step`.
    """
    if not timeout_secs > 0:
        raise checks.argument_error("timeout_secs", "> 0", timeout_secs)
    writer = tf.summary.create_file_writer(tensorboard_dir) if tensorboard_dir else None
    # Traced now, so that evaluating a checkpoint takes as long as reading it
    # and running the data: fewer are deleted before their turn.
    model.evaluate(data, verbose=0, steps=1)
    print_fn(
        f"evaluator: waiting for checkpoints in {checkpoint_dir} up to step "
        f"{last_step} (at most {timeout_secs:g} s for each)"
    )
    results: dict[int, dict[str, float]] = {}
    skipped: list[str] = []
    done_number, first_step = -1, None
    deadline = time.monotonic() + timeout_secs
    while done_number < last_step:
        new = sorted(
            (p for p in _listed(checkpoint_dir) if _number(p) > done_number),
            key=_number,
        )
        if not new:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"The evaluator waited {timeout_secs:g} s (`timeout_secs`) "
                    f"for a checkpoint after step {max(done_number, 0)} in "
                    f"{checkpoint_dir}; the run ends at step {last_step}. Is "
                    "the chief still training?"
                )
            time.sleep(_POLL_SECS)
            continue
        for path in new:
            done_number = _number(path)
            try:
                step = checkpoint_step(path)
                if read_checkpoint is None:
                    status = tf.train.Checkpoint(model=model).read(path)
                    status.assert_existing_objects_matched().expect_partial()
                else:
                    read_checkpoint(path)
            except tf.errors.NotFoundError:
                skipped.append(path)
                print_fn(
                    f"evaluator: skipped {path}: deleted by the trainer before "
                    "it could be read (it keeps the last few checkpoints)"
                )
                continue
            metrics = model.evaluate(data, verbose=0, return_dict=True)
            results[step] = {k: float(v) for k, v in metrics.items()}
            first_step = step if first_step is None else first_step
            shown = " ".join(f"{k}={v:.4f}" for k, v in sorted(results[step].items()))
            print_fn(f"evaluator: {path} (step {step}): {shown}")
            if writer is not None:
                with writer.as_default(step=step):
                    for name, value in results[step].items():
                        tf.summary.scalar(EVAL_PREFIX + name, value)
                writer.flush()
        deadline = time.monotonic() + timeout_secs
    if steps_per_epoch and first_step is not None:
        seen = set(results) | {_number(p) for p in skipped}
        first_epoch_end = -(-first_step // steps_per_epoch) * steps_per_epoch
        unseen = [
            s
            for s in range(first_epoch_end, last_step + 1, steps_per_epoch)
            if s not in seen
        ]
        if unseen:
            print_fn(
                "evaluator: skipped the epoch-end checkpoints of steps "
                f"{', '.join(map(str, unseen))}: written and deleted between "
                "two looks"
            )
    print_fn(
        f"evaluator: evaluated {len(results)} checkpoints"
        + (f", skipped {len(skipped)}" if skipped else "")
    )
    return results
