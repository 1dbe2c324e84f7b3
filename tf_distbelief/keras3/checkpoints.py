"""`model_dir` checkpoints of a Keras 3 job: the tf_keras job's, with `PsWeights`.

`keras3.fit(model_dir=...)` keeps the same layout and rules as tf_keras
`fit.training.fit` (`tf_distbelief.paths`: `model_dir/checkpoints/ckpt-<step>`,
the last `MAX_CHECKPOINTS_TO_KEEP` kept), written and restored by the same
services:

* `faults.resume.write_checkpoint`: every value checked for NaN and inf on its
  ps task, the step and epoch recorded, the checkpoint written whole or not
  at all (`save_whole`);
* `faults.resume.restore`: every value of the checkpoint into its variable,
  compared first (a mismatch is an error naming the variable, nothing
  changed); a sharded variable is saved whole, so it restores into any
  number of ps tasks;
* `faults.recovery.verify_restored`: the values read back from the ps tasks
  equal the checkpoint's bit for bit, checked once per resumed run.

What the checkpoint holds (`faults.checkpoint_contents.Contents`, as for
tf_keras): `model` (the ps variables of `PsWeights`, by position),
`optimizer` (the AdaGrad accumulators, by position; with Downpour the ps
optimizer, `tf_distbelief.adagrad.Adagrad`, with its iteration count),
`downpour` (each replica's state, `downpour.replica_state`), `step` and
`epoch`.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.faults import checkpoint_contents, recovery, resume


class Checkpoints:
    """A Keras 3 training run's checkpoints in `model_dir` (see the module).

    Args:
      model_dir: the job's folder (`paths.checkpoint_dir(model_dir)` holds
        the checkpoints).
      weights: the run's `PsWeights`.
      steps_per_epoch: steps per epoch over all workers, >= 1.
      every_steps: steps between checkpoints besides each epoch end, >= 0.
      algorithm: None, or the `hooks.FitHooks` of the algorithm that trains
        (`keras3.downpour.make_step`'s): its ps optimizer (`state.optimizer`)
        and its checkpointed state are saved too.
      print_fn: where the resume lines go.

    Attributes:
      saved_step: the global step of the last checkpoint written or restored.
      latest: the last checkpoint's path, or None.
    """

    def __init__(
        self,
        model_dir: str,
        weights,
        steps_per_epoch: int,
        every_steps: int = 0,
        algorithm=None,
        print_fn=print,
    ):
        self._steps_per_epoch = steps_per_epoch
        self._every = every_steps
        self._print_fn = print_fn
        optimizer = weights.checkpoint_optimizer
        if algorithm is not None:
            optimizer = algorithm.state.optimizer
        self._contents = checkpoint_contents.Contents(
            weights.checkpoint_model, optimizer, algorithm
        )
        self.step, self.epoch = self._contents.step, self._contents.epoch
        self.manager = self._contents.manager(model_dir)
        optimizer_root = tf.train.Checkpoint(optimizer=optimizer)
        self._variables = [
            *weights.trainable,
            *weights.non_trainable,
            *checkpoint_contents.variable_keys(optimizer_root)[0].values(),
        ]
        self.saved_step = 0

    @property
    def latest(self) -> str | None:
        return self.manager.latest_checkpoint

    def restore(self) -> int:
        """Restores the latest checkpoint exactly, if any; the step to start at.

        Raises:
          resume.RestoreError: it does not restore exactly (nothing changed),
            or a value read back differs from the checkpoint's.
        """
        latest = self.manager.latest_checkpoint
        if not latest:
            return 0
        # The lines in the tf_keras job's order: resumed, then verified.
        self.saved_step = resume.restore_contents(
            self._contents, latest, self._steps_per_epoch, self._print_fn
        )
        recovery.verify_restored(
            tf.train.Checkpoint(**self._contents.roots), latest, self._print_fn
        )
        return self.saved_step

    def next_save(self, done: int) -> int | None:
        """The step of the next mid-epoch checkpoint after `done`, or None."""
        if not self._every:
            return None
        return (done // self._every + 1) * self._every

    def save(self, done: int) -> str:
        """Writes the checkpoint of step `done` (no step may be in flight).

        Raises:
          errors.NonFiniteError: a value holds NaN or inf (nothing written).
          resume.CheckpointWriteError: the write failed (nothing of it kept).
        """
        before = None if self._contents.state is None else self._capture
        path = resume.write_checkpoint(
            self.manager,
            self.step,
            self.epoch,
            done,
            self._steps_per_epoch,
            self._variables,
            before,
        )
        self.saved_step = done
        return path

    def _capture(self) -> None:
        for line in self._contents.state.capture():
            self._print_fn(line)


def read_weights(model, path: str) -> None:
    """Loads the weights of checkpoint `path` into a Keras 3 model (the evaluator).

    Reads `model/trainable/<i>` and `model/non_trainable/<i>` (each whole,
    as `Checkpoints` writes them) into local variables of the model's weights'
    shapes and dtypes, then assigns them to the model's own variables; no
    cluster is needed.

    Args:
      model: the built Keras 3 model the job trains (same weights, same
        order).
      path: a checkpoint prefix (`model_dir/checkpoints/ckpt-<step>`).

    Raises:
      tf.errors.NotFoundError: the checkpoint is gone.
      AssertionError: a weight of `model` is not in the checkpoint (named).
    """
    holder = tf.Module(name="ps_weights")
    holder.trainable = [
        tf.Variable(tf.zeros(v.shape, v.dtype)) for v in model.trainable_variables
    ]
    holder.non_trainable = [
        tf.Variable(tf.zeros(v.shape, v.dtype)) for v in model.non_trainable_variables
    ]
    status = tf.train.Checkpoint(model=holder).read(path)
    status.assert_existing_objects_matched().expect_partial()
    for keras_variable, value in zip(
        [*model.trainable_variables, *model.non_trainable_variables],
        [*holder.trainable, *holder.non_trainable],
    ):
        keras_variable.assign(value)
