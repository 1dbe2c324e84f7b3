"""The fault policies in tf_keras's `Model.fit`: its optimizer, its callbacks.

The policies themselves import no tf_keras (`nonfinite`, `resume`,
`recovery`, `exactly_once`; Keras 3 training uses them too); this module
applies them where tf_keras `fit` runs a step and calls its callbacks:

* `install_guard`: the per-step non-finite guard (`nonfinite`) on a tf_keras
  optimizer (`Guard`, wrapping its distributed apply);
* `install_exactly_once`: each scheduled step's token (`exactly_once`) in
  tf_keras's train function;
* `build`: every variable and slot created before a restore (below);
* `Checkpointer`: the `model_dir` checkpoints, by step and at epoch ends
  (`resume.write_checkpoint`);
* `VerifyRestored`: the values restored compared with the checkpoint's
  (`recovery.verify_restored`), before the first step.

Why the optimizer is built before a restore. A tf_keras optimizer creates its
slots (AdaGrad's accumulators) at its first step. Restored before that, a
checkpoint is matched lazily, as each slot appears. For a variable that a
partitioner split over the ps tasks, the optimizer keeps the slot's shards in
a list (`_accumulators`: `[emb/part_0, emb/part_1, kernel, ...]`) but saves
the list coalesced, one `ShardedVariable` per slot (`[emb, kernel, ...]`), and
the same `ShardedVariable`s again in its `_variables` list. Matched lazily,
the list's entries are paired by position: shard `emb/part_0` with the saved
`emb` (a shape that does not fit: TensorFlow skips it without a word),
`emb/part_1` with the saved `kernel`, and so on; when the real
`ShardedVariable`s then appear in `_variables`, their saved values are
already taken ("Inconsistent references" in TensorFlow's log) and are not
restored. Every accumulator stays at its initial value, sharded or not, while
the weights restore exactly. With every slot created first, the optimizer
coalesces its shards before the checkpoint is read, each saved value has one
object, and a value that does not fit raises.
"""

from __future__ import annotations

import threading
import weakref

import tensorflow as tf
import tf_keras

from tf_distbelief import paths
from tf_distbelief.adagrad import staleness
from tf_distbelief.faults import (
    exactly_once,
    nonfinite,
    preemption,
    recovery,
    resume,
    settings,
)
from tf_distbelief.tf_internals import coordinator as tf_coordinator
from tf_distbelief.tf_internals import keras_model
from tf_distbelief.tf_internals import optimizers as tf_optimizers

_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Guard:
    """The per-step check installed on one tf_keras optimizer (`install_guard`).

    Attributes:
      mode: `raise` or `skip`, one of `settings.NONFINITE_MODES`.
      skipped: a ps variable, `[]` int64: steps skipped since installed.
    """

    def __init__(self, optimizer, mode: str):
        self.mode = mode
        # On a ps task, so that every worker's skips add up in one place.
        self.skipped = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="nonfinite_skipped"
        )
        self._optimizer = optimizer
        tf_optimizers.wrap_distributed_apply(optimizer, self._apply)

    def skipped_steps(self) -> int:
        """Steps skipped so far (reads the ps variable)."""
        return int(self.skipped.numpy())

    def _apply(self, apply, distribution, grads_and_vars, **kwargs):
        grads_and_vars = list(grads_and_vars)
        finite = [
            tf.reduce_all(tf.math.is_finite(_values(g))) for g, _ in grads_and_vars
        ]
        all_finite = tf.reduce_all(tf.stack(finite))
        iterations = self._optimizer.iterations

        def update(grads_and_vars=grads_and_vars):
            return tf.identity(apply(distribution, grads_and_vars, **kwargs))

        def refuse():
            if self.mode == "raise":
                names = tf.constant([v.name for _, v in grads_and_vars])
                failed = tf.debugging.Assert(
                    False,
                    [
                        nonfinite.MARKER,
                        iterations + 1,
                        tf.boolean_mask(names, tf.logical_not(tf.stack(finite))),
                    ],
                    summarize=len(grads_and_vars),
                )
                deps = [failed]
            else:
                deps = [self.skipped.assign_add(1)]
            with tf.control_dependencies(deps):
                return tf.identity(iterations)

        token = exactly_once.current()
        if token is None:
            return tf.cond(all_finite, update, refuse)
        # A retried step whose update was applied already: nothing more.
        tokens = exactly_once.tokens_for(self._optimizer)
        # The update reads the gradients as received on the ps (see `gate`).
        on_ps = [(exactly_once.copy_to(v.device, g), v) for g, v in grads_and_vars]

        def update_marked():
            done = update(on_ps)  # `iterations` advanced on its ps task.
            return done, [done]

        return exactly_once.gate(
            token,
            tokens,
            all_finite,
            update_marked,
            lambda: (refuse(), []),
            lambda: tf.identity(iterations),
        )


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def install_guard(model, mode: str = "raise") -> Guard:
    """Guards every step of `model`'s optimizer against non-finite gradients.

    Call under nothing in particular; the skip counter is created under the
    model's strategy scope (on a ps task). Installing again on the same
    optimizer changes the mode of the guard already there (and makes `fit`
    trace its train function anew).

    Args:
      model: a compiled tf_keras model whose optimizer is a
        `tf_keras.optimizers.Optimizer` (not a legacy one).
      mode: `raise` (stop at the first non-finite step) or `skip`.

    Returns:
      The `Guard`.

    Raises:
      ValueError: `mode` is not one of `settings.NONFINITE_MODES`.
      TypeError: the optimizer is not a `tf_keras.optimizers.Optimizer`.
    """
    settings.check_nonfinite_mode(mode)
    optimizer = model.optimizer
    if not isinstance(optimizer, tf_keras.optimizers.Optimizer):
        raise TypeError(
            "The non-finite guard needs a `tf_keras.optimizers.Optimizer` "
            f"(not a legacy one). Received: {optimizer!r}"
        )
    guard = _GUARDS.get(optimizer)
    if guard is None:
        with model.distribute_strategy.scope():
            guard = Guard(optimizer, mode)
        _GUARDS[optimizer] = guard
    elif guard.mode != mode:
        guard.mode = mode
        model.train_function = None  # The mode is read when it is traced.
    return guard


def install_exactly_once(model) -> None:
    """Makes `model.fit` give each scheduled step a token (`exactly_once`).

    Replaces the model's train function under a `ClusterCoordinator` (stock
    parameter-server training, and Downpour's one-step-at-a-time path) with
    tf_keras's own loop of `steps_per_execution` steps, each traced inside
    `scope` of its token. A model whose `make_train_function` was replaced
    already (Downpour in segments, which takes tokens itself) is left alone.

    Args:
      model: a compiled tf_keras model under a parameter-server strategy.
    """
    if keras_model.overrides(model, "make_train_function"):
        return

    def build():
        counter = keras_model.train_counter(model)
        strategy = model.distribute_strategy

        def one_step(iterator, token):
            def run_step(data):
                # The token's scope in both threads that trace the step (it
                # is thread-local): `strategy.run` traces the step in a
                # replica thread (Downpour's push is gated there), and runs
                # the optimizer's `merge_call` part in this one (the update
                # of stock training is gated there). With the scope in this
                # thread only, no Downpour push was gated: 1501 of 1500 steps
                # under worker kills.
                with exactly_once.scope(token), tf.control_dependencies(read):
                    outputs = model.train_step(data)
                # As tf_keras: the counter moves once the step succeeded.
                with tf.control_dependencies(tf.nest.flatten(outputs)):
                    counter.assign_add(1)
                return outputs

            # Stock training's update is damped by the staleness of its
            # gradient (`adagrad.staleness`): the applied-step count is read
            # before the forward pass reads any parameter. The update runs in
            # this thread; a model whose `train_step` was replaced (Downpour)
            # pushes by its own rules, undamped.
            count = None
            if not keras_model.overrides(model, "train_step"):
                count = staleness.read_before(model.optimizer)
            read = [] if count is None else [count]
            with exactly_once.scope(token), staleness.scope(count):
                outputs = strategy.run(run_step, args=(next(iterator),))
            return keras_model.reduce_per_replica(model, outputs)

        @tf.function(reduce_retracing=True)
        def train_function(iterator, first_token, steps):
            for k in tf.range(steps):
                outputs = one_step(iterator, first_token + k)
            return outputs

        return train_function, exactly_once.tokens_for(model.optimizer, strategy)

    keras_model.override_train_function(model, build)


def input_spec(data):
    """The `tf.TypeSpec` structure of one batch of features in `data`, or None.

    `data` is a `tf.data.Dataset` or a tf_keras `DatasetCreator`; the
    creator's function is traced on the coordinator (not run: no record is
    read, and a function that asks for its worker index only registers the
    question).
    """
    if isinstance(data, tf.data.Dataset):
        spec = data.element_spec
    elif isinstance(data, tf_keras.utils.experimental.DatasetCreator):
        specs = []

        @tf.function
        def trace():
            specs.append(data(tf.distribute.InputContext()).element_spec)
            return 0

        trace.get_concrete_function()
        spec = specs[0]
    else:
        return None
    x, _, _ = tf_keras.utils.unpack_x_y_sample_weight(spec)
    return x


def build(model: tf_keras.Model, data=None) -> None:
    """Creates every variable of `model` and every slot of its optimizer.

    An unbuilt model (no input shape) is built by one forward pass on the
    coordinator over a batch of zeros shaped as `data`'s features. Then the
    optimizer builds its slots for `model.trainable_variables`, as its first
    step would, under the model's strategy (each slot on its variable's ps
    shard).

    Raises:
      ValueError: `model` is not built and `data` gives no feature shapes.
    """
    strategy = model.distribute_strategy
    if not model.built:
        spec = input_spec(data)
        if spec is None or not all(
            isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(spec)
        ):
            raise ValueError(
                "Resuming needs the model's variables before the first step: "
                "build the model (an `InputLayer`, `Input`, or "
                f"`model.build(input_shape)`). Received an unbuilt model and "
                f"data without plain feature shapes: {data!r}"
            )
        zeros = tf.nest.map_structure(
            lambda s: tf.zeros([1 if d is None else d for d in s.shape], s.dtype),
            spec,
        )
        with strategy.scope():
            model(zeros, training=False)
    optimizer = model.optimizer
    if optimizer is not None and hasattr(optimizer, "build"):
        with strategy.scope():
            optimizer.build(model.trainable_variables)


class Checkpointer(tf_keras.callbacks.Callback):
    """Writes a checkpoint every `every_steps` steps and at each epoch end.

    Each checkpoint records the global step (`step`: steps finished over all
    workers, all runs) and the epochs finished (`epoch`), and is numbered by
    the step (`ckpt-<step>`). Steps are scheduled asynchronously under
    parameter-server training: before a mid-epoch save this waits for the
    steps in flight (`ClusterCoordinator.join`), so the values saved are
    exactly those after `step` steps; the save comes at the first execution
    boundary at or after each multiple of `every_steps` (every step with
    `steps_per_execution=1`). A preemption's signal (`preemption`) saves
    the step reached at the next batch or epoch end and ends the job. Before
    writing, every variable is checked on its ps task; one NaN or inf and the
    checkpoint is refused (`errors.NonFiniteError`), the earlier ones kept.

    Args:
      manager: the `tf.train.CheckpointManager` to save with.
      step: the `int64` variable the checkpoint holds as the global step; its
        value is where this run starts.
      epoch: the `int64` variable it holds as the epochs finished.
      steps_per_epoch: steps per epoch, >= 1.
      every_steps: steps between checkpoints; 0 saves at epoch ends only.
      before_save: None, or a callable run after the checks, before each
        write (e.g. `downpour.replica_state.ReplicaState.capture`).
      goodput: None, or the job's `goodput.Goodput`: each save's time (the
        wait, the checks, the write) counts as `checkpointing`.
    """

    def __init__(
        self,
        manager,
        step,
        epoch,
        steps_per_epoch,
        every_steps=0,
        before_save=None,
        goodput=None,
    ):
        super().__init__()
        self.goodput = goodput
        self.before_save = before_save
        # Batch hooks under parameter-server training are allowed only for
        # callbacks that take remote logs; this one never reads them.
        self._supports_tf_logs = True
        self.manager = manager
        self.step = step
        self.epoch = epoch
        self.steps_per_epoch = steps_per_epoch
        self.every_steps = every_steps
        self.done = int(step.numpy())
        self.saved_step = self.done
        self._epoch_start = self.done
        # The global step after each execution scheduled since the last wait
        # for all of them (the first: before them), for a preemption's save.
        self._scheduled = [self.done]
        self._cancelled = 0
        self._cancel_lock = threading.Lock()

    def on_epoch_begin(self, epoch, logs=None):
        # A resumed run's first epoch starts where the checkpoint stopped.
        self._epoch_start = max(epoch * self.steps_per_epoch, self.done)
        self._scheduled = [self._epoch_start]  # `fit` waited at the epoch end.

    def on_train_batch_end(self, batch, logs=None):
        self.done = self._epoch_start + batch + 1
        self._scheduled.append(self.done)
        if preemption.requested():
            preemption.save_and_stop(self.save_at_signal)
        every = self.every_steps
        if every and self.done // every > self.saved_step // every:
            self.save()

    def on_epoch_end(self, epoch, logs=None):
        if preemption.requested():
            preemption.save_and_stop(self.save_at_signal)
        if self.done != self.saved_step:
            self.save()

    def cancel_queued(self) -> None:
        """Cancels the executions scheduled that no worker has started
        (`preemption.saving`'s `cancel`; from any thread)."""
        strategy = self.model.distribute_strategy
        if not isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            return
        # The coordinator `fit` made (one per strategy).
        coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
            strategy
        )
        with self._cancel_lock:
            self._cancelled += tf_coordinator.cancel_queued(coordinator)

    def save_at_signal(self) -> tuple[int, bool]:
        """The checkpoint of the step reached, for a preemption's save.

        The executions not started are cancelled, those in flight finish
        (`ClusterCoordinator.join`), and the checkpoint records the steps
        of the executions that ran: the last ones scheduled are the ones
        cancelled (the coordinator's queue is first in, first out).

        Returns:
          `(step, written)`: the step reached, and False when the latest
          checkpoint holds it already.
        """
        self.cancel_queued()
        self._join()
        with self._cancel_lock:
            ran = max(1, len(self._scheduled) - self._cancelled)
            self.done = self._scheduled[ran - 1]
            self._cancelled = 0
        self._scheduled = [self.done]
        if self.done == self.saved_step:
            return self.done, False
        self.save()
        return self.done, True

    def save(self) -> str:
        """Waits for the steps in flight, checks every value, writes; the path.

        Raises:
          errors.NonFiniteError: a value holds NaN or inf (nothing written).
          CheckpointWriteError: the write failed (nothing of it kept).
        """
        if self.goodput is None:
            return self._save()
        # The steps already scheduled run on the workers while the chief
        # waits for them: training time, not the checkpoint's (tf_keras
        # schedules far ahead: about 1.2 s of steps per checkpoint in the
        # punisher's digits job, against 0.05 s for the checks and write).
        self._join()
        with self.goodput.timing("checkpointing"):
            path = self._save()
        self.goodput.step_done(self.done)
        return path

    def _join(self) -> None:
        """Waits for every step in flight (none without a coordinator)."""
        strategy = self.model.distribute_strategy
        if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
            # The coordinator `fit` made (one per strategy).
            tf.distribute.experimental.coordinator.ClusterCoordinator(strategy).join()

    def _save(self) -> str:
        self._join()  # Nothing to wait for when `save` has waited.
        path = resume.write_checkpoint(
            self.manager,
            self.step,
            self.epoch,
            self.done,
            self.steps_per_epoch,
            [*self.model.weights, *self.model.optimizer.variables],
            self.before_save,
        )
        self.saved_step = self.done
        self._scheduled = [self.done]  # Every step scheduled has run.
        return path


class VerifyRestored(tf_keras.callbacks.Callback):
    """Before the first step, compares every restored value with the checkpoint.

    `training.fit` has restored the latest checkpoint of `model_dir` when
    training begins; this callback reads every variable and optimizer slot
    back from the ps tasks (a `ShardedVariable` whole) and compares its bytes
    with the checkpoint file's (`tf.train.load_checkpoint`). It prints one line
    with the count, or raises naming each variable that differs. Nothing is
    checked when no checkpoint was restored. The cost is one read of every
    value, as a checkpoint's write, once per resumed run.

    Args:
      model_dir: the job's `model_dir`.
      print_fn: where the line goes.

    Raises:
      resume.RestoreError: at train begin, naming each value that differs.
    """

    def __init__(self, model_dir: str | None, print_fn=print):
        super().__init__()
        self._model_dir = model_dir
        self._print_fn = print_fn
        self.checked: str | None = None

    def on_train_begin(self, logs=None):
        path = paths.latest_checkpoint(self._model_dir)
        if self.checked or not path:
            return  # `fit` may call `Model.fit` twice in one run.
        self.checked = path
        recovery.verify_restored(
            tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer),
            path,
            self._print_fn,
        )
