"""A checkpoint written outside `tf.train.CheckpointManager.save`, recorded by it.

Used by `faults.resume.save_whole`, the one writer of a `model_dir`
checkpoint. In eager mode `tf.train.Checkpoint.write` (and so
`CheckpointManager.save`) builds a new saver and traces its save function at
every call (TensorFlow warns "N out of the last N calls to
MultiDeviceSaver.save.<locals>.tf_function_save triggered tf.function
retracing"): about 0.25 s of a checkpoint's 0.35 s in a Downpour digits job
on 2 cores, and more under load. `Checkpoint.write` called inside a
`tf.function` builds the saver when the function is traced, once, and then
writes in about 5 ms. Public route checked: `CheckpointManager` records
(state file, `checkpoints`, deletion beyond `max_to_keep`) only what its own
`save` wrote; that bookkeeping, `save`'s inner `_record_and_sweep_state`,
uses its private `_maybe_delete`, `_latest_checkpoint`, `_record_state` and
`_sweep`.
"""

from __future__ import annotations

import os
import time

import tensorflow as tf

from tf_distbelief.tf_internals import _shapes

__all__ = ["check", "has_interval", "prefix", "record_written"]


def prefix(manager: tf.train.CheckpointManager) -> str:
    """The path prefix `manager.save` numbers its checkpoints after
    (`directory/checkpoint_name`)."""
    return manager._prefix


def has_interval(manager: tf.train.CheckpointManager) -> bool:
    """True when `manager` was made with a `checkpoint_interval` (its `save`
    then skips saves; `record_written` does not)."""
    return manager._checkpoint_interval is not None


def record_written(manager: tf.train.CheckpointManager, save_path: str) -> None:
    """Records checkpoint `save_path`, written whole, as `manager.save` would.

    The state file names it as the latest, and checkpoints beyond
    `max_to_keep` are deleted: what `CheckpointManager.save` does once its
    write is done (TensorFlow 2.21's `_record_and_sweep_state`, line for line).
    """
    timestamp = time.time()
    if save_path in manager._maybe_delete:
        del manager._maybe_delete[save_path]
    manager._maybe_delete[save_path] = timestamp
    manager._latest_checkpoint = save_path
    manager._record_state()
    manager._sweep()
    manager._record_state()


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        manager = tf.train.CheckpointManager(
            tf.train.Checkpoint(), folder, max_to_keep=1
        )
        recorded = {
            "_maybe_delete",
            "_latest_checkpoint",
            "_record_state",
            "_sweep",
            "_prefix",
            "_checkpoint_interval",
        }
        _shapes.expect(
            "checkpoint_manager",
            [
                (
                    "CheckpointManager.save records with "
                    + ", ".join(sorted(recorded)),
                    recorded <= _shapes.code_names(tf.train.CheckpointManager.save),
                ),
                (
                    "CheckpointManager._prefix",
                    getattr(manager, "_prefix", None) == os.path.join(folder, "ckpt"),
                ),
                (
                    "CheckpointManager._checkpoint_interval",
                    getattr(manager, "_checkpoint_interval", 0) is None,
                ),
                (
                    "CheckpointManager._maybe_delete",
                    isinstance(getattr(manager, "_maybe_delete", None), dict),
                ),
                (
                    "CheckpointManager._latest_checkpoint",
                    hasattr(manager, "_latest_checkpoint"),
                ),
                (
                    "CheckpointManager._record_state",
                    callable(getattr(manager, "_record_state", None)),
                ),
                (
                    "CheckpointManager._sweep",
                    callable(getattr(manager, "_sweep", None)),
                ),
            ],
        )
