"""A guard that keeps NaN and inf off the parameter servers and out of checkpoints.

One non-finite gradient applied to a ps variable makes every later step of
every replica non-finite (each reads the same ps values), and a checkpoint
written after it keeps the damage. The guard works at two points:

* **Each step** (stock parameter-server training): the update of all the
  optimizer's variables for a step runs inside one `tf.cond` on the worker
  that computed the gradients: with every gradient finite it applies them;
  otherwise it applies none of them, and either stops the job
  (`mode="raise"`: an `errors.NonFiniteError` naming the step and the
  variables) or counts the step as skipped (`mode="skip"`). The `tf.cond`
  sits where each Keras applies a step: `faults.tf_keras_fit.Guard` on a
  tf_keras optimizer, `keras3.step` in a Keras 3 step; this module holds
  what both share (the failure's marker, `error_from`).
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

import logging
import re

import tensorflow as tf

from tf_distbelief import console, errors
from tf_distbelief.tf_internals import variables as tf_variables

# Marks the assertion a failed check raises on the worker, so that the error
# the coordinator re-raises can be told apart from any other.
MARKER = "tf_distbelief non-finite gradient at step"
# The same for a Downpour push (`downpour.push_guard`).
PUSH_MARKER = "tf_distbelief non-finite push at step"


class _QuietReportedFailures(logging.Filter):
    """Drops the `ClusterCoordinator`'s ERROR records of a failed non-finite
    check, and of the cancellations that follow it.

    The coordinator logs a closure's error before `fit` raises it: for a
    failed check that is TensorFlow's whole graph stack and gRPC chain, about
    1,300 lines per worker, ahead of the one `NonFiniteError` line that the
    job raises for it (`error_from`). A record is dropped when it carries one
    of this package's non-finite markers (`MARKER`, `PUSH_MARKER`, the Keras 3
    step's) or is a cancellation that TensorFlow itself says it does not
    report ("This derived error is ignored").
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "This derived error is ignored and not reported to users" in message:
            return False
        return not ("tf_distbelief" in message and "non-finite" in message)


_QUIET = _QuietReportedFailures()


def quiet_reported_failures() -> None:
    """Keeps the coordinator's log of a failed check off the console (see
    `_QuietReportedFailures`); TensorFlow's other log records pass. Idempotent."""
    tf.get_logger().addFilter(_QUIET)


def skipped_line(skipped: int, total: int, unit: str = "steps") -> str | None:
    """The job's closing warning when `nonfinite="skip"` skipped updates.

    A job whose every step was skipped still ends with exit status 0 (the
    user asked to skip); this line, printed after training, says how much of
    it did nothing.

    Args:
      skipped: steps (Downpour: pushes) of this run whose update was skipped
        for a NaN or inf.
      total: steps (pushes) this run took.
      unit: `"steps"` or `"pushes"`.

    Returns:
      `warning: 98 of 100 steps skipped ...`, or None when none was skipped.
    """
    if skipped <= 0:
        return None
    return (
        f"warning: {console.count(skipped)} of {console.count(total)} {unit} "
        "skipped for a NaN or inf gradient (--nonfinite=skip): their updates "
        "were not applied"
    )


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
    found = re.search(re.escape(MARKER) + r"\] \[(\d+)\] \[(.*?)\]", message)
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
