"""Where a job keeps its files: the one owner of the model_dir and export_dir layout.

A job's `model_dir` holds:

* `checkpoints/ckpt-<step>`: the checkpoints `fit.training.fit` writes,
  numbered by global step (the model, its optimizer, the step, and an
  algorithm's own state such as Downpour's replicas);
* `sandblaster/ckpt-<iteration>`: Sandblaster L-BFGS's checkpoints, numbered
  by L-BFGS iteration;
* `tensorboard/` (and `tensorboard/eval/`, the evaluator's): TensorBoard
  scalars.

An `export_dir` holds `saved_model/` (a SavedModel) and `model.keras`.

Every module that writes, finds or names these files asks this one; nothing
else spells a folder name or parses a checkpoint number. No TensorFlow at
import: finding the latest checkpoint imports it when called.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "CHECKPOINT_PREFIX",
    "KERAS_FILE",
    "MAX_CHECKPOINTS_TO_KEEP",
    "SAVED_MODEL_SUBDIR",
    "checkpoint_dir",
    "checkpoint_number",
    "describe_checkpoint",
    "eval_tensorboard_dir",
    "latest_checkpoint",
    "sandblaster_dir",
    "tensorboard_dir",
]

# Folders of a model_dir, each written by one kind of writer.
_CHECKPOINTS = "checkpoints"
_SANDBLASTER = "sandblaster"
_TENSORBOARD = "tensorboard"
_EVAL = "eval"
# `tf.train.CheckpointManager`'s default prefix: `ckpt-<number>`.
CHECKPOINT_PREFIX = "ckpt"
# Checkpoints a `CheckpointManager` keeps; it only ever deletes its own
# `ckpt-N` files, never anything else in `model_dir`.
MAX_CHECKPOINTS_TO_KEEP = 3
# An export_dir's contents.
SAVED_MODEL_SUBDIR = "saved_model"
KERAS_FILE = "model.keras"

_NUMBER_RE = re.compile(r"-(\d+)$")


def checkpoint_dir(model_dir: str) -> str:
    """`model_dir/checkpoints`: `fit.training.fit`'s checkpoints, `ckpt-<step>`."""
    return os.path.join(model_dir, _CHECKPOINTS)


def sandblaster_dir(model_dir: str) -> str:
    """`model_dir/sandblaster`: Sandblaster's checkpoints, `ckpt-<iteration>`."""
    return os.path.join(model_dir, _SANDBLASTER)


def tensorboard_dir(model_dir: str) -> str:
    """`model_dir/tensorboard`: the training job's TensorBoard scalars."""
    return os.path.join(model_dir, _TENSORBOARD)


def eval_tensorboard_dir(model_dir: str) -> str:
    """`model_dir/tensorboard/eval`: the evaluator's TensorBoard scalars."""
    return os.path.join(model_dir, _TENSORBOARD, _EVAL)


def checkpoint_number(path: str) -> int | None:
    """The number of checkpoint `path` (`.../ckpt-40` -> 40), or None.

    Args:
      path: a checkpoint prefix, as `tf.train.CheckpointManager` names them.

    Returns:
      The step (`checkpoints/`) or L-BFGS iteration (`sandblaster/`) in its
      name, or None for a path not named `<prefix>-<number>`.
    """
    match = _NUMBER_RE.search(path)
    return int(match.group(1)) if match else None


def describe_checkpoint(path: str) -> str:
    """`ckpt-40 (step 40)` for `.../checkpoints/ckpt-40`, for progress lines.

    Sandblaster's checkpoints (`model_dir/sandblaster/ckpt-3`) are numbered by
    L-BFGS iteration: `ckpt-3 (iteration 3)`.
    """
    name = os.path.basename(path)
    number = checkpoint_number(name)
    if number is None:
        return name
    folder = os.path.basename(os.path.dirname(path))
    unit = "iteration" if folder == _SANDBLASTER else "step"
    return f"{name} ({unit} {number})"


def latest_checkpoint(model_dir: str | None) -> str | None:
    """The newest checkpoint of a job's `model_dir`, or None.

    Looks in `checkpoint_dir(model_dir)` first; then, for a path that is
    itself a checkpoint folder or holds other `tf.train.CheckpointManager`
    folders (Sandblaster's), the newest checkpoint among `model_dir` and its
    direct subfolders.

    Args:
      model_dir: the job's `model_dir`, a checkpoint folder, or None.

    Returns:
      A checkpoint prefix (`.../ckpt-40`), or None when there is none.
    """
    import tensorflow as tf  # Only here: the layout itself needs none.

    if not model_dir:
        return None
    found = tf.train.latest_checkpoint(checkpoint_dir(model_dir))
    if found:
        return found
    folders = [model_dir]
    if os.path.isdir(model_dir):
        folders += [
            os.path.join(model_dir, name)
            for name in sorted(os.listdir(model_dir))
            if os.path.isfile(os.path.join(model_dir, name, "checkpoint"))
        ]
    found = [p for p in map(tf.train.latest_checkpoint, folders) if p]
    return max(found, key=lambda p: os.path.getmtime(p + ".index"), default=None)
