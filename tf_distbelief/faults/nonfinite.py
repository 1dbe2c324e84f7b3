"""A guard that keeps NaN and inf off the parameter servers and out of checkpoints.

One non-finite gradient applied to a ps variable makes every later step of
every replica non-finite (each reads the same ps values), and a checkpoint
written after it keeps the damage. The guard works at two points:

* **Each step** (stock parameter-server training under tf_keras `fit`): the
  optimizer's update of all its variables for a step runs inside one
  `tf.cond` on the worker that computed the gradients: with every gradient
  finite it applies them as the optimizer always does; otherwise it applies
  none of them, and either stops the job (`mode="raise"`: a `errors.NonFiniteError`
  naming the step and the variables) or counts the step as skipped
  (`mode="skip"`).
* **Each checkpoint** (`nonfinite_variables`): every variable a checkpoint
  would hold is checked on its own ps task before writing; one non-finite
  value and the checkpoint is refused.

Cost per step: one `is_finite` and one `reduce_all` per gradient (a pass over
the gradient's values on the worker, beside the backward pass that made them;
for an embedding only its looked-up rows), a `stack`/`reduce_all` over one
boolean per variable, and the `tf.cond`; no extra RPC while gradients are
finite (the step number is read only when a check fails). Downpour's pushes
have their own check, push by push (`tf_distbelief.downpour.push_guard`).

What it does not cover: an update that overflows although its gradient was
finite (say `learning_rate=1e30`) reaches the ps, and the next step's
gradients are then non-finite and stop (or are skipped).
"""

from __future__ import annotations

import re
import weakref

import tensorflow as tf

from tf_distbelief import checks, errors
from tf_distbelief.faults import exactly_once
from tf_distbelief.tf_internals import optimizers as tf_optimizers
from tf_distbelief.tf_internals import variables as tf_variables

MODES = ("raise", "skip")
# Marks the assertion a failed check raises on the worker, so that the error
# the coordinator re-raises can be told apart from any other.
_MARKER = "tf_distbelief non-finite gradient at step"
# The same for a Downpour push (`downpour.push_guard`).
PUSH_MARKER = "tf_distbelief non-finite push at step"
_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def check_mode(mode: str) -> str:
    """Returns `mode` if it is one of `MODES`.

    Raises:
      ValueError: naming the argument, the allowed values and the value.
    """
    if mode not in MODES:
        raise checks.argument_error("nonfinite", f"one of {', '.join(MODES)}", mode)
    return mode


class Guard:
    """The per-step check installed on one tf_keras optimizer (see `install`).

    Attributes:
      mode: `raise` or `skip`, one of `MODES`.
      skipped: a ps variable, `[]` int64: steps skipped since `install`.
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
                        _MARKER,
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


def install(model, mode: str = "raise") -> Guard:
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
      ValueError: `mode` is not one of `MODES`.
      TypeError: the optimizer is not a `tf_keras.optimizers.Optimizer`.
    """
    import tf_keras

    check_mode(mode)
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


def error_from(error: Exception) -> errors.NonFiniteError | None:
    """The `errors.NonFiniteError` a failed check raised as `error`, or None.

    A failed check stops the scheduled function with TensorFlow's
    `InvalidArgumentError`; the coordinator re-raises it from `fit`.
    """
    message = str(getattr(error, "message", error))
    if not isinstance(error, tf.errors.InvalidArgumentError):
        return None
    push = re.search(
        re.escape(PUSH_MARKER) + r"\] \[(\d+)\] \[(.*?)\] \[worker\] \[(\d+)\]",
        message,
    )
    if push:
        step, worker = int(push.group(1)), int(push.group(3))
        names = re.findall(r'"([^"]*)"', push.group(2)) or push.group(2).split()
        return errors.NonFiniteError(
            f"Non-finite push (NaN or inf) from worker {worker} at its step "
            f"{step} for {', '.join(names)}: the push was not applied and "
            "training stopped (`nonfinite=raise`); no ps variable holds it. "
            "Lower the learning rate, or pass `nonfinite=skip` "
            "(--nonfinite=skip) to drop such pushes.",
            step,
            names,
        )
    found = re.search(re.escape(_MARKER) + r"\] \[(\d+)\] \[(.*?)\]", message)
    if not found:
        return None
    step = int(found.group(1))
    names = re.findall(r'"([^"]*)"', found.group(2)) or found.group(2).split()
    return errors.NonFiniteError(
        f"Non-finite gradient (NaN or inf) at step {step} for "
        f"{', '.join(names)}: the step was not applied and training stopped "
        "(`nonfinite=raise`); no ps variable holds it. Lower the learning "
        "rate, or pass `nonfinite=skip` (--nonfinite=skip) to skip such steps.",
        step,
        names,
    )


def variable_name(variable) -> str:
    """`variable.name`; for a `ShardedVariable` (whose own name is the class
    name) the name its shards share, `embedding/embeddings:0`."""
    if isinstance(variable, tf_variables.ShardedVariable):
        return re.sub(r"/part_0(?=:\d+$)", "", variable.variables[0].name)
    return variable.name


def nonfinite_variables(variables) -> list[str]:
    """Names of the floating-point variables that hold a NaN or inf.

    Each check runs on the variable's own device (its ps task, shard by
    shard, dispatched together), so that only one boolean per shard travels
    to the coordinator.

    Args:
      variables: variables, `ShardedVariable`s included.

    Returns:
      The names, in the order given; empty when all are finite.
    """
    names, flags = [], []
    for variable in variables:
        if not variable.dtype.is_floating:
            continue
        if isinstance(variable, tf_variables.ShardedVariable):
            parts = variable.variables
        else:
            parts = [variable]
        checks = []
        for part in parts:
            with tf.device(part.device):
                checks.append(tf.reduce_all(tf.math.is_finite(part)))
        names.append(variable_name(variable))
        flags.append(checks)
    return [name for name, checks in zip(names, flags) if not all(map(bool, checks))]
