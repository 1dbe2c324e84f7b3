"""Exact resume: every variable and optimizer slot back bit for bit, or an error.

`restore` also insists that every value in the checkpoint found its object
and every object its value (`assert_consumed`), so that a missing slot is an
error naming it, never a silent reset. ShardedVariables restore into any
number of ps tasks (the checkpoint holds each variable whole).
"""

from __future__ import annotations

import glob
import os
import shutil
import weakref

import tensorflow as tf
from absl import logging

from tf_distbelief import console, errors
from tf_distbelief.faults import checkpoint_contents, nonfinite, preemption
from tf_distbelief.tf_internals import checkpoint_manager, saved_model


class RestoreError(errors.DistBeliefError, ValueError):
    """A checkpoint does not restore exactly into the model (nothing changed
    on disk)."""


class CheckpointWriteError(errors.DistBeliefError, OSError):
    """A checkpoint could not be written (disk full, a folder not writable, a
    task lost mid-write); nothing of it was kept (`save_whole`). Its
    `__cause__` is the error the write raised."""


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logging.warning("Could not remove %s, part of a failed checkpoint: %s", path, e)


class _TracedWrite:
    """`checkpoint.write` in a `tf.function`, traced once the objects the
    checkpoint holds are the same two writes in a row (eager until then).

    Eager `Checkpoint.write` (and `CheckpointManager.save`) traces a new save
    function at every call; traced here once, a write of the digits Downpour
    job's checkpoint takes milliseconds instead of about 0.25 s
    (`tf_internals.checkpoint_manager`).
    """

    def __init__(self, checkpoint: tf.train.Checkpoint):
        self.checkpoint = checkpoint
        self._objects = None  # What `_write` was traced for.
        self._write = None

    def __call__(self, prefix: str) -> str:
        # A new or replaced object (a slot made late, a Sandblaster list
        # grown into a new variable) changes what the saver must hold. While
        # the objects change from one write to the next (Sandblaster's
        # history filling up), each write is eager: tracing each would cost
        # as much and make TensorFlow warn of retracing. The write is traced
        # once two writes in a row hold the same objects.
        objects = _saved_objects(self.checkpoint)
        if (
            self._objects is None
            or len(objects) != len(self._objects)
            or any(a is not b for a, b in zip(objects, self._objects))
        ):
            self._objects, self._write = objects, None
            return self.checkpoint.write(prefix)
        if self._write is None:
            checkpoint = self.checkpoint
            # Where eager ops run here: the tensors the checkpoint makes (its
            # object graph) go there, so the shards are those of an eager
            # write (one per device).
            device = tf.constant(0).device

            def write(path):
                with tf.device(device):
                    return checkpoint.write(path)

            self._write = tf.function(write)
        return self._write(tf.constant(prefix)).numpy().decode()


def _saved_objects(checkpoint) -> tuple:
    """What a write of `checkpoint` saves: its descendants, and the slots of
    optimizers that keep them outside the object graph (`get_slot_names`, the
    legacy tf_keras optimizers), as TensorFlow's async checkpointing lists
    them."""
    objects = list(tf.train.TrackableView(checkpoint).descendants())
    variables = [t for t in objects if isinstance(t, tf.Variable)]
    for t in list(objects):
        if "get_slot_names" in dir(t):
            for name in t.get_slot_names():
                for v in variables:
                    try:
                        objects.append(t.get_slot(v, name))
                    except (AttributeError, KeyError):
                        continue
    return tuple(objects)


# One traced writer per manager (`save_whole`).
_WRITERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _save(manager: tf.train.CheckpointManager, number: int) -> str:
    """What `manager.save(checkpoint_number=number)` does, with a traced write."""
    writer = _WRITERS.get(manager)
    if writer is None:
        writer = _WRITERS[manager] = _TracedWrite(manager.checkpoint)
    if checkpoint_manager.has_interval(manager):  # It may skip the save.
        return manager.save(checkpoint_number=number)
    # As `CheckpointManager.save`: the counter first, saved with the rest.
    manager.checkpoint.save_counter.assign_add(1)
    prefix = f"{checkpoint_manager.prefix(manager)}-{number}"
    tf.io.gfile.makedirs(manager.directory)  # As the eager save does.
    keep = prefix in manager.checkpoints
    # A save abandoned at the end of a preemption's grace period removes what
    # it wrote and never becomes the latest (`preemption`).
    with preemption.writing(
        lambda: _remove_partial(manager.directory, prefix, keep=keep)
    ):
        path = writer(prefix)
        preemption.commit(lambda: checkpoint_manager.record_written(manager, path))
    return path


def save_whole(manager: tf.train.CheckpointManager, number: int) -> str:
    """`manager.save(checkpoint_number=number)`, all or nothing.

    TensorFlow writes a checkpoint's shards into `<prefix>-<number>_temp/`,
    merges them into `<prefix>-<number>.index` and `.data-*` files, and only
    then points the `checkpoint` state file at it (written to a temporary
    file, then renamed). A write that fails on the way (disk full, a folder
    not writable, an exception mid-save) can leave the temporary folder, a
    data file without its index, or a temporary state file; this removes
    them, so the folder holds whole checkpoints only and the state file
    still names the last whole one.

    A failure after the checkpoint was whole and recorded (while deleting the
    checkpoints beyond `max_to_keep`) keeps it, with a warning.

    Args:
      manager: the `tf.train.CheckpointManager` to save with.
      number: the checkpoint's number (`<prefix>-<number>`).

    Returns:
      The checkpoint's path.

    Raises:
      CheckpointWriteError: naming the checkpoint, the cause (its
        `__cause__`) and the last whole checkpoint, which is kept.
    """
    before = list(manager.checkpoints)
    try:
        return _save(manager, number)
    except Exception as error:  # noqa: BLE001  (cleaned up, then raised named)
        # Raised here, so that the cause is its `__context__` too: tf_keras
        # re-raises a callback's error `from None`.
        path = f"{checkpoint_manager.prefix(manager)}-{number}"
        if manager.latest_checkpoint == path and os.path.exists(path + ".index"):
            logging.warning(
                "Checkpoint %s is whole, but removing older ones failed: %s",
                path,
                error,
            )
            return path
        _remove_partial(manager.directory, path, keep=path in before)
        raise CheckpointWriteError(_write_failed(path, error, manager)) from error


def _remove_partial(directory: str, path: str, keep: bool) -> None:
    """Removes what a failed write of checkpoint `path` left in `directory`."""
    folder = glob.escape(directory)
    leftovers = [] if keep else glob.glob(glob.escape(path) + "[._]*")
    leftovers += glob.glob(os.path.join(folder, "*_temp"))
    leftovers += glob.glob(os.path.join(folder, "checkpoint.tmp*"))
    for leftover in leftovers:
        _remove(leftover)


def _write_failed(path: str, error: BaseException, manager) -> str:
    last = manager.latest_checkpoint
    fix = "Fix the cause (a full disk, a folder not writable), then rerun"
    return (
        f"Writing checkpoint {path} failed: {type(error).__name__}: "
        f"{console.shorten(str(error), 600)}. Nothing of it is kept"
        + (
            f"; the last whole checkpoint, {last}, is. {fix} with the same "
            "model_dir to resume from it."
            if last
            else f"; there is no earlier checkpoint. {fix}."
        )
    )


def mismatches(root, path: str) -> list[str]:
    """What keeps checkpoint `path` from restoring exactly into `root`.

    Args:
      root: what the checkpoint restores into (a `tf.train.Checkpoint`).
      path: the checkpoint.

    Returns:
      One line per variable with no value in the checkpoint or a value of
      another shape or dtype, per value with no variable, and per holder of
      variables (an optimizer's list of slots) on one side only: another
      optimizer's slots can sit at the same keys with the same shapes (SGD's
      momentums where AdaGrad's accumulators are expected). Empty when the
      checkpoint restores exactly.
    """
    reader = tf.train.load_checkpoint(path)
    shapes = reader.get_variable_to_shape_map()
    dtypes = reader.get_variable_to_dtype_map()
    expected, holders = checkpoint_contents.variable_keys(root)
    problems = []
    for key, variable in expected.items():
        name = (
            f"`{nonfinite.variable_name(variable)}` "
            f"({checkpoint_contents.object_path(key)})"
        )
        if key not in shapes:
            problems.append(f"{name}: no value in the checkpoint")
        elif tuple(shapes[key]) != tuple(variable.shape):
            problems.append(
                f"{name}: shape {tuple(shapes[key])} in the checkpoint, "
                f"{tuple(variable.shape)} here"
            )
        elif dtypes[key] != variable.dtype:
            problems.append(
                f"{name}: dtype {dtypes[key].name} in the checkpoint, "
                f"{variable.dtype.name} here"
            )
    values = {k for k in shapes if checkpoint_contents.is_value_key(k)}
    own = set(checkpoint_contents.OWN_KEYS)
    for key in sorted(values - set(expected) - own):
        problems.append(
            f"{checkpoint_contents.object_path(key)}: a value with no variable here"
        )
    nodes = saved_model.saved_object_graph(path)
    saved_paths, _ = checkpoint_contents.walk(0, lambda i: nodes[i][0], key=int)
    saved_holders = {
        saved_paths[i]
        for i in range(len(nodes))
        if i in saved_paths and any(nodes[c][1] for c in nodes[i][0].values())
    }
    for holder in sorted(set(holders) - saved_holders):
        problems.append(
            f"{holder} (holding {', '.join(f'`{n}`' for n in holders[holder][:3])}"
            f"{', ...' if len(holders[holder]) > 3 else ''}): not in the checkpoint"
        )
    for holder in sorted(saved_holders - set(holders) - {""}):
        problems.append(f"{holder}: in the checkpoint, holds no variable here")
    return problems


def restore(checkpoint: tf.train.Checkpoint, path: str) -> None:
    """Restores `checkpoint` from `path`, every value into its object, or raises.

    Call `build` first: then no value is matched lazily. The checkpoint's
    keys, shapes and dtypes are compared with the objects' first, so that a
    checkpoint that cannot restore exactly changes nothing.

    Raises:
      RestoreError: naming each variable with no value in the checkpoint (a
        slot missing) or a value of another shape or dtype, each value with
        no variable, and each holder of variables on one side only (another
        optimizer's slots).
    """
    problems = mismatches(checkpoint, path)
    if problems:
        raise RestoreError(
            f"The checkpoint {path} does not restore exactly into this model "
            f"({len(problems)} mismatches): "
            + "; ".join(problems[:20])
            + ". Build the model as the job that wrote it did: the same layers "
            "and sizes, the same optimizer and, for a model split over devices, "
            "the same number of partitions (`devices_per_replica`), which sets "
            "the shape of each partition's weights."
        )
    try:
        checkpoint.restore(path).assert_consumed()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
        # TensorFlow's message ends with the cause: cut its middle only.
        detail = console.shorten(str(e), 1200)
        raise RestoreError(
            f"The checkpoint {path} does not restore exactly into this model: {detail}"
        ) from None


def write_checkpoint(
    manager, step, epoch, done, steps_per_epoch, variables, before_save=None
) -> str:
    """Checks every value, records the step, writes a whole checkpoint; its path.

    The one writer of a `model_dir` checkpoint, whatever trains (tf_keras
    `fit` through `Checkpointer`, `keras3.fit`). Call it when no step is in
    flight (after `ClusterCoordinator.join`): the values saved are then
    exactly those after `done` steps.

    Args:
      manager: the `tf.train.CheckpointManager` to save with.
      step: the `int64` variable the checkpoint holds as the global step.
      epoch: the `int64` variable it holds as the epochs finished.
      done: steps finished over all workers and runs; the checkpoint's number.
      steps_per_epoch: steps per epoch, >= 1.
      variables: every variable the checkpoint holds values of (weights and
        optimizer slots, `ShardedVariable`s whole), checked on their ps tasks.
      before_save: None, or a callable run after the checks, before the write
        (e.g. `downpour.replica_state.ReplicaState.capture`).

    Returns:
      The checkpoint's path (`ckpt-<done>`).

    Raises:
      errors.NonFiniteError: a value holds NaN or inf (nothing written, the
        earlier checkpoints kept).
      CheckpointWriteError: the write failed (nothing of it kept).
    """
    bad = nonfinite.nonfinite_variables(variables)
    if bad:
        latest = manager.latest_checkpoint
        raise errors.NonFiniteError(
            f"Refusing to write a checkpoint at step {done}: "
            f"{', '.join(bad)} hold NaN or inf. Nothing was written"
            + (f"; the last checkpoint, {latest}, is kept" if latest else "")
            + ". It came another way than a gradient (a Downpour push, an "
            "update that overflowed, or a value set directly).",
            done,
            bad,
        )
    if before_save is not None:
        before_save()
    step.assign(done)
    epoch.assign(done // steps_per_epoch)
    path = save_whole(manager, done)
    logging.info("Saved checkpoint %s at step %d", path, done)
    return path


def restore_contents(contents, path: str, steps_per_epoch: int, print_fn) -> int:
    """Restores checkpoint `path` exactly into `contents`; the step to start at.

    The algorithm's state (if any) goes back to the workers, each of its
    lines printed; a checkpoint without a recorded step starts at its
    epoch's first step. Then the `resumed_line` is printed.

    Args:
      contents: the run's `checkpoint_contents.Contents`.
      path: the checkpoint.
      steps_per_epoch: steps per epoch over all workers, >= 1.
      print_fn: where the lines go.

    Returns:
      The global step the checkpoint recorded.

    Raises:
      RestoreError: it does not restore exactly (see `restore`).
    """
    keys = {name for name, _ in tf.train.list_variables(path)}
    checkpoint, restored = contents.restoring(keys)
    restore(checkpoint, path)
    if contents.state is not None:  # Each replica's state to its worker.
        for line in contents.state.write_back(restored):
            print_fn(line)
    if checkpoint_contents.STEP_KEY not in keys:
        contents.step.assign(contents.epoch * steps_per_epoch)
    step = int(contents.step.numpy())
    print_fn(resumed_line(path, step, steps_per_epoch))
    return step


def resumed_line(path: str, step: int, steps_per_epoch: int) -> str:
    """The line a run resumed from checkpoint `path` at global `step` prints."""
    done, into = divmod(step, steps_per_epoch)
    return f"Resumed from {path} at step {step} (epoch {done}" + (
        f", {into} steps into epoch {done + 1})" if into else ")"
    )
