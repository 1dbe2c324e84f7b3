"""Checkpoints of a Sandblaster L-BFGS run: resume exactly after a chief loss.

Sandblaster L-BFGS (Dean et al. 2012, section 4.2) keeps its iterate, the
gradient there and the `(s, y)` history as vectors on the ps tasks
(`ps_vectors`); the coordinator holds python numbers only. `LbfgsCheckpointer`
writes all of it, an `lbfgs_state.LbfgsState`, with `tf.train.Checkpoint` and
`tf.train.CheckpointManager` after every `every_iters`-th iteration, and
restores the latest: a rerun with the same directory goes on from there and
computes the iterates an uninterrupted run computes.

Each vector is saved through its shard variables, wrapped in a
`ShardedVariable` (TensorFlow's partitioned variable), so every ps task writes
its own slices (no vector passes through the coordinator) and the checkpoint
holds each vector whole: a run with another number of ps tasks restores it
into its own shards. Checkpoint keys:

| key | value |
| --- | --- |
| `x`, `grad` | the iterate and the gradient there, `[n]` float64 |
| `s_history/i`, `y_history/i` | pair `i` of the history, oldest first, `[n]` float64 |
| `rho_history` | `1 / s_i·y_i`, `[num_pairs]` float64 |
| `gamma`, `loss`, `grad_norm` | `[]` float64 |
| `num_iters`, `num_evals`, `num_skipped_pairs` | `[]` int64 |
| `loss_history`, `step_history` | `[num_iters + 1]`, `[num_iters]` float64 |
| `gram` | vector-free runs: `LbfgsState.gram`, `[2p+1, 2p+1]` float64 |
| `history` | the run's memory `m`, `[]` int64 |
| `model` | one line per model weight, `"name shape dtype"`, `[num_weights]` string |

Writes are atomic (the manager points at a checkpoint only once it is whole,
and a failed write leaves no part of it: `resume.save_whole`);
a state holding NaN or inf is never written; the manager deletes only its own
`ckpt-N` files.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence

import numpy as np
import tensorflow as tf

from tf_distbelief import checks, errors, paths
from tf_distbelief.faults import checkpoint_contents, nonfinite, resume
from tf_distbelief.sandblaster import lbfgs_state, ps_vectors
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["LbfgsCheckpointer", "describe_model"]

_FLOATS = ("gamma", "loss", "grad_norm")
_INTS = ("num_iters", "num_evals", "num_skipped_pairs")
_FLOAT_LISTS = ("rho_history", "loss_history", "step_history")


class _QuietSaverRetracing(logging.Filter):
    """Drops TensorFlow's warning that its checkpoint writer was traced again.

    The state's lists grow (`loss_history` by one entry an iteration, the
    history up to `m` pairs), so TensorFlow's saver function is traced anew at
    every write and warns after the fifth; that is expected here, and only
    that warning is dropped.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("MultiDeviceSaver" in message and "retracing" in message)


_QUIET = _QuietSaverRetracing()


def describe_model(variables) -> list[str]:
    """One line per weight, `"name shape dtype"`: what a checkpoint was made for.

    Args:
      variables: the model's trainable weights in flat-vector order
        (`flat_params.FlatLayout.variables`).

    Returns:
      `["dense/kernel:0 (64, 10) float32", ...]`, one string per weight.
    """
    return [f"{v.name} {tuple(v.shape)} {v.dtype.name}" for v in variables]


def _shape_and_dtype(line: str) -> str:
    # Keras numbers layer names by creation order in a process (`dense_1`), so
    # a rebuilt model may be named otherwise: only shapes and dtypes must match.
    return line.split(" ", 1)[1]


class LbfgsCheckpointer:
    """Writes an L-BFGS run's state every `every_iters` iterations; restores it.

    Example, around `lbfgs.minimize` on `ps_vectors.PsVectorOps`:

    ```python
    checkpointer = checkpoint.LbfgsCheckpointer(
        ops, paths.sandblaster_dir(model_dir), history=10,
        model=checkpoint.describe_model(layout.variables))
    state = checkpointer.restore(like=grad)          # None: no checkpoint yet
    result = lbfgs.minimize(fun_and_grad, None if state else x0, ops, m=10,
                            initial_state=state, callback=checkpointer.save)
    checkpointer.save(result.state, force=True)      # the final state
    ```

    Args:
      ops: the `ps_vectors.PsVectorOps` that owns the run's vectors.
      directory: where the checkpoints go (made if missing).
      history: the run's memory `m` (`SandblasterConfig.history`); a checkpoint
        of another memory is refused.
      model: `describe_model` of the model the vector holds; a checkpoint of
        another model (shapes or dtypes) is refused.
      every_iters: iterations between checkpoints, >= 1.
      max_to_keep: checkpoints kept, >= 1.

    Attributes:
      saved_iters: the iteration of the last checkpoint written or restored,
        None before either.

    Raises:
      TypeError, ValueError: a bad argument.
    """

    def __init__(
        self,
        ops: ps_vectors.PsVectorOps,
        directory: str,
        history: int,
        model: Sequence[str],
        every_iters: int = 1,
        max_to_keep: int = paths.MAX_CHECKPOINTS_TO_KEEP,
    ):
        if not isinstance(ops, ps_vectors.PsVectorOps):
            raise checks.argument_error(
                "ops", "a `ps_vectors.PsVectorOps`", ops, shown=type(ops).__name__
            )
        if not isinstance(directory, str) or not directory:
            raise checks.argument_error("directory", "a non-empty path", directory)
        checks.check_int("history", history, 1)
        checks.check_int("every_iters", every_iters, 1)
        checks.check_int("max_to_keep", max_to_keep, 1)
        self.ops = ops
        self.directory = directory
        self.history = int(history)
        self.model = list(model)
        self.every_iters = int(every_iters)
        self.saved_iters: int | None = None
        self._root = tf.train.Checkpoint()
        self._manager = tf.train.CheckpointManager(
            self._root, directory, max_to_keep=max_to_keep
        )
        # One ShardedVariable per vector, made once: TensorFlow allows a
        # variable in one ShardedVariable only.
        self._sharded: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the newest checkpoint in `directory`, or None."""
        return self._manager.latest_checkpoint

    def _as_sharded(self, vector: ps_vectors.PsVector):
        sharded = self._sharded.get(vector)
        if sharded is None:
            sharded = tf_variables.ShardedVariable(list(vector.shards), name="lbfgs")
            self._sharded[vector] = sharded
        return sharded

    # ------------------------------------------------------------------ save

    def save(self, state: lbfgs_state.LbfgsState, force: bool = False) -> str | None:
        """Writes `state` if its iteration is a multiple of `every_iters`.

        The `callback` of `lbfgs.minimize`. Nothing is written twice for one
        iteration.

        Args:
          state: the run's state after an iteration.
          force: write whatever the iteration (the final state of a run).

        Returns:
          The checkpoint's path, or None if nothing was written.

        Raises:
          errors.NonFiniteError: naming the iteration and each vector or
            number of `state` that holds NaN or inf; nothing is written and
            the earlier checkpoints are kept.
          resume.CheckpointWriteError: the write failed; nothing of it is
            kept and the earlier checkpoints are.
        """
        k = state.num_iters
        if k == self.saved_iters or not (force or k % self.every_iters == 0):
            return None
        vectors = _vectors(state)
        bad = [
            name
            for name, v in vectors.items()
            if nonfinite.nonfinite_variables(v.shards)
        ]
        scalars = state.scalars()
        bad += [
            name
            for name, value in scalars.items()
            if not np.all(np.isfinite(np.asarray(value, np.float64)))
        ]
        if state.gram is not None and not np.all(np.isfinite(state.gram)):
            bad.append("gram")
        if bad:
            latest = self.latest_checkpoint
            raise errors.NonFiniteError(
                f"Refusing to write an L-BFGS checkpoint at iteration {k}: "
                f"{', '.join(bad)} hold NaN or inf. Nothing was written"
                + (f"; the last checkpoint, {latest}, is kept." if latest else "."),
                k,
                bad,
            )
        root = self._root
        root.x = self._as_sharded(state.x)
        root.grad = self._as_sharded(state.grad)
        root.s_history = [self._as_sharded(v) for v in state.s_history]
        root.y_history = [self._as_sharded(v) for v in state.y_history]
        for name in _FLOATS + _FLOAT_LISTS:
            setattr(root, name, tf.Variable(np.asarray(scalars[name], np.float64)))
        for name in _INTS:
            setattr(root, name, tf.Variable(np.int64(scalars[name])))
        if state.gram is not None:
            # Saved, not rebuilt on restore: the resumed run reads the very
            # bits an uninterrupted one would.
            root.gram = tf.Variable(np.asarray(state.gram, np.float64))
        elif hasattr(root, "gram"):
            del root.gram
        root.history = tf.Variable(np.int64(self.history))
        root.model = tf.Variable(self.model, dtype=tf.string)
        tf_logger = tf.get_logger()
        tf_logger.addFilter(_QUIET)
        try:
            path = resume.save_whole(self._manager, k)
        finally:
            tf_logger.removeFilter(_QUIET)
        self.saved_iters = k
        return path

    # --------------------------------------------------------------- restore

    def restore(
        self, like: ps_vectors.PsVector, path: str | None = None
    ) -> lbfgs_state.LbfgsState | None:
        """The state in checkpoint `path` (default: the latest), or None if none.

        The vectors are made like `like` (same shards on the same ps tasks)
        and filled on the ps tasks from the checkpoint, whatever the number of
        ps tasks that wrote it.

        Args:
          like: a vector of the run, laid out as the restored ones must be.
          path: a checkpoint; None means `latest_checkpoint`.

        Returns:
          The `lbfgs_state.LbfgsState` to pass to `lbfgs.minimize` as
          `initial_state`, or None when `path` is None and there is no
          checkpoint.

        Raises:
          resume.RestoreError: the checkpoint was written for another model
            (naming the weight whose shape or dtype differs), another memory
            `history`, or does not restore exactly (naming each variable:
            missing, another shape or dtype, a value with no variable). Nothing
            of the run is changed.
        """
        path = path or self.latest_checkpoint
        if path is None:
            return None
        reader = tf.train.load_checkpoint(path)
        shapes = reader.get_variable_to_shape_map()
        self._check_made_for_this_run(path, reader, shapes)
        num_pairs = _num_pairs(shapes)
        objects = {
            "x": self.ops.zeros_like(like),
            "grad": self.ops.zeros_like(like),
            "s_history": [self.ops.zeros_like(like) for _ in range(num_pairs)],
            "y_history": [self.ops.zeros_like(like) for _ in range(num_pairs)],
        }
        numbers = {}
        for name in _FLOATS + _FLOAT_LISTS:
            key = checkpoint_contents.value_key(name)
            shape = shapes.get(key, [])
            numbers[name] = tf.Variable(tf.zeros(shape, tf.float64))
        for name in _INTS:
            numbers[name] = tf.Variable(np.int64(0))
        if checkpoint_contents.value_key("gram") in shapes:
            numbers["gram"] = tf.Variable(
                tf.zeros(shapes[checkpoint_contents.value_key("gram")], tf.float64)
            )
        numbers["history"] = tf.Variable(np.int64(0))
        numbers["model"] = tf.Variable([""] * len(self.model), dtype=tf.string)
        sharded = {
            name: (
                [self._as_sharded(v) for v in value]
                if isinstance(value, list)
                else self._as_sharded(value)
            )
            for name, value in objects.items()
        }
        resume.restore(tf.train.Checkpoint(**sharded, **numbers), path)
        values = {name: v.numpy() for name, v in numbers.items()}
        state = lbfgs_state.LbfgsState(
            x=objects["x"],
            grad=objects["grad"],
            s_history=objects["s_history"],
            y_history=objects["y_history"],
            **{name: float(values[name]) for name in _FLOATS},
            **{name: [float(v) for v in values[name]] for name in _FLOAT_LISTS},
            **{name: int(values[name]) for name in _INTS},
            gram=values.get("gram"),
        )
        lbfgs_state.check_state(state, self.history)
        self.saved_iters = state.num_iters
        return state

    def _check_made_for_this_run(self, path, reader, shapes) -> None:
        problems = []
        if checkpoint_contents.value_key("history") in shapes:
            saved = int(reader.get_tensor(checkpoint_contents.value_key("history")))
            if saved != self.history:
                problems.append(
                    f"`history`: {saved} (s, y) pairs in the checkpoint, "
                    f"{self.history} here (the L-BFGS memory must match: "
                    f"--lbfgs_history={saved}, or another --model_dir)"
                )
        if checkpoint_contents.value_key("model") in shapes:
            saved = [
                b.decode()
                for b in reader.get_tensor(checkpoint_contents.value_key("model"))
            ]
            if len(saved) != len(self.model):
                problems.append(
                    f"`model`: {len(saved)} weights in the checkpoint, "
                    f"{len(self.model)} here"
                )
            for i, (there, here) in enumerate(zip(saved, self.model)):
                if _shape_and_dtype(there) != _shape_and_dtype(here):
                    problems.append(
                        f"weight {i}: `{there}` in the checkpoint, `{here}` here"
                    )
        if problems:
            raise resume.RestoreError(
                f"The L-BFGS checkpoint {path} was written for another run "
                f"({len(problems)} mismatches): " + "; ".join(problems[:20])
            )


def _vectors(state: lbfgs_state.LbfgsState) -> dict:
    vectors = {"x": state.x, "grad": state.grad}
    for i, (s, y) in enumerate(zip(state.s_history, state.y_history)):
        vectors[f"s_history/{i}"] = s
        vectors[f"y_history/{i}"] = y
    return vectors


def _num_pairs(shapes: dict) -> int:
    """Pairs in a checkpoint: its `rho_history` length (0 if it has none)."""
    shape = shapes.get(checkpoint_contents.value_key("rho_history"))
    return int(shape[0]) if shape else 0
