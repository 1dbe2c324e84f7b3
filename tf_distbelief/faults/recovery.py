"""ps failure recovery: a lost ps task costs the steps since the last checkpoint.

TensorFlow's `ParameterServerStrategy` recovers a lost worker by itself (the
coordinator runs the worker's step on another worker and reconnects the worker
when it serves again) but not a lost ps task: the task's variables are gone,
and every later step raises `UnavailableError`. TensorFlow's advice
(`ClusterCoordinator`'s docstring) is to restart the coordinator so that it
re-creates the variables and loads a checkpoint. `run_with_ps_recovery` does
that inside the chief process:

1. it runs one training attempt (`attempt`: connect a new `DistBeliefStrategy`,
   build and compile the model, `training.fit` from `model_dir`);
2. when the attempt fails because a ps task is lost (`lost_ps_tasks`), it
   prints one line naming the task and its address (and, if the task
   announced it was stopping, `cluster.announce`, the signal), and waits, at most
   `ps_recovery_secs`, until that task accepts connections again (the local
   cluster restarts it, `LocalCluster(restart_lost_tasks=True)`; on Kubernetes
   the TFJob's restart policy does);
3. it runs a new attempt. The new strategy reconnects to the same cluster
   (TensorFlow sends the restarted task a new eager context), `fit` creates
   every variable and slot again on the ps tasks and restores them from the
   latest checkpoint in `model_dir` (exactly: `resume`), and `verify_restored`
   reads them back before the first step and compares them with the checkpoint
   file bit for bit. Training continues to the requested step.

Why in the same process rather than a new chief process per attempt: a new
strategy in the same process reconnects to the restarted task (tried with
stock `fit`, Downpour and 1-2 ps, ps 0 and ps 1 each lost once in a run), keeps
the chief's stdout, pid and exit status, and costs no TensorFlow start-up (4-5
s); the earlier strategy's coordinator is waited for
(`strategy.wait_for_idle_coordinators`) before the new one connects. Every
training method that resumes from `model_dir` recovers this way, since an
attempt is the whole of it.

Recovery needs a checkpoint: with no `model_dir`, no checkpoint yet, or
`ps_recovery_secs=0`, the lost task is named in a `PsLostError` that says how to
enable recovery. A ps lost again before a new checkpoint was written counts
against `MAX_RECOVERIES_WITHOUT_PROGRESS`; a task that keeps failing ends the
job instead of looping.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import tensorflow as tf

from tf_distbelief import errors, paths
from tf_distbelief.cluster import announce
from tf_distbelief.cluster import server as server_lib
from tf_distbelief.faults import checkpoint_contents, resume, settings

# Recoveries in a row that saw no new checkpoint: a ps that fails again before
# the job got anywhere is a fault that recovery will not fix.
MAX_RECOVERIES_WITHOUT_PROGRESS = 3
_POLL_SECS = 0.25
_REPORT_EVERY_SECS = 10.0
_TASK_RE = re.compile(r"/job:ps/replica:\d+/task:(\d+)|/job:ps/task:(\d+)")


class PsLostError(errors.DistBeliefError, RuntimeError):
    """A ps task was lost and the job could not recover from it.

    Attributes:
      tasks: `{"/job:ps/task:i": "host:port"}`, the tasks lost.
    """

    def __init__(self, message: str, tasks: Mapping[str, str]):
        super().__init__(message)
        self.tasks = dict(tasks)


def _original(error: BaseException) -> BaseException:
    """The TensorFlow error under `error`, or `error` itself.

    The coordinator wraps a closure's error (`ClosureInputError`,
    `ClosureAbortedError`) and keeps it as `original_exception`; our own
    errors raised while handling one keep it as `__cause__` or `__context__`.
    """
    seen = set()
    while id(error) not in seen and not isinstance(error, tf.errors.OpError):
        seen.add(id(error))
        inner = (
            getattr(error, "original_exception", None)
            or error.__cause__
            or error.__context__
        )
        if inner is None:
            break
        error = inner
    return error


def lost_ps_tasks(error: BaseException, ps_addresses: Sequence[str]) -> dict:
    """The ps tasks whose loss `error` reports, `{"/job:ps/task:i": address}`.

    An error reports a lost ps when it is a `tf.errors.UnavailableError` or
    `AbortedError` (or TensorFlow's "unknown device" `InvalidArgumentError` of
    a task restarted between two RPCs), possibly wrapped by the coordinator,
    and a ps task is named in its message (by task or by address) or does not
    accept connections now. As TensorFlow's own `_is_ps_failure`, on public
    error types.

    Args:
      error: what a training attempt raised.
      ps_addresses: the ps tasks' `host:port`, by task index.

    Returns:
      The tasks lost, empty when `error` is not a ps loss.
    """
    error = _original(error)
    text = str(error)
    if isinstance(error, tf.errors.InvalidArgumentError):
        if "unknown device" not in text.lower() and "remote_handle" not in text:
            return {}
    elif not isinstance(error, (tf.errors.UnavailableError, tf.errors.AbortedError)):
        return {}
    named = {int(a or b) for a, b in _TASK_RE.findall(text)}
    lost = {}
    for index, address in enumerate(ps_addresses):
        if index in named or address in text or not server_lib.is_listening(address):
            lost[f"/job:ps/task:{index}"] = address
    return lost


def _names(tasks: Mapping[str, str]) -> str:
    return ", ".join(f"{task} at {address}" for task, address in tasks.items())


def wait_for_ps(tasks: Mapping[str, str], timeout_secs: float, print_fn=print) -> float:
    """Waits until every task of `tasks` accepts connections again.

    Args:
      tasks: `{"/job:ps/task:i": "host:port"}`.
      timeout_secs: the longest wait, in seconds.
      print_fn: where a progress line goes every 10 s of waiting.

    Returns:
      The seconds waited.

    Raises:
      TimeoutError: naming the tasks still down at the deadline.
    """
    start = time.monotonic()
    next_report = start + _REPORT_EVERY_SECS
    pending = dict(tasks)
    while True:
        pending = {t: a for t, a in pending.items() if not server_lib.is_listening(a)}
        now = time.monotonic()
        if not pending:
            return now - start
        if now - start > timeout_secs:
            raise TimeoutError(_names(pending))
        if now >= next_report:
            print_fn(
                f"ps recovery: waiting for {_names(pending)} to serve again "
                f"({now - start:.0f} s of {timeout_secs:g} s)"
            )
            next_report = now + _REPORT_EVERY_SECS
        time.sleep(_POLL_SECS)


def verify_restored(root, path: str, print_fn=print) -> None:
    """Compares every value of `root` on the ps tasks with checkpoint `path`.

    Each variable (a `ShardedVariable` whole) is read back from its ps task
    and its bytes compared with the checkpoint file's
    (`tf.train.load_checkpoint`); one line with the count is printed. Shared
    by every trainer that restores from a `model_dir`
    (`tf_keras_fit.VerifyRestored` for tf_keras, `keras3.fit`).

    Args:
      root: what was restored from `path` (a `tf.train.Checkpoint`).
      path: the checkpoint.
      print_fn: where the line goes.

    Raises:
      resume.RestoreError: naming each value that differs.
    """
    keys, _ = checkpoint_contents.variable_keys(root)
    reader = tf.train.load_checkpoint(path)
    differ, num_bytes = [], 0
    for key, variable in keys.items():
        if not reader.has_tensor(key):
            continue  # `resume.restore` already refused a missing value.
        parts = getattr(variable, "variables", None)
        value = (
            np.concatenate([p.numpy() for p in parts])
            if parts is not None
            else variable.numpy()
        )
        saved = reader.get_tensor(key)
        num_bytes += value.nbytes
        if value.shape != saved.shape or value.tobytes() != saved.tobytes():
            differ.append(checkpoint_contents.object_path(key))
    if differ:
        raise resume.RestoreError(
            f"After restoring {path}, {len(differ)} values on the ps tasks "
            f"differ from the checkpoint: {', '.join(differ[:20])}"
        )
    print_fn(
        f"restored {paths.describe_checkpoint(path)}: {len(keys)} values equal the "
        f"checkpoint bit for bit ({num_bytes} bytes)"
    )


def _no_recovery_error(lost, why: str, model_dir) -> PsLostError:
    return PsLostError(
        f"Lost {_names(lost)} during training; {why}. To recover from a lost "
        "ps task, train with --model_dir=DIR and --checkpoint_every_steps=N "
        "(a checkpoint every N steps; a recovery redoes at most N steps)"
        + (
            f"; a rerun with --model_dir={model_dir} resumes from its last checkpoint."
            if model_dir
            else "."
        ),
        lost,
    )


class _QuietPsLoss(logging.Filter):
    """Drops TensorFlow's ERROR records of a closure that failed because a
    ps task was unreachable (`UNAVAILABLE` naming `/job:ps/`).

    The coordinator logs each failed closure, and the cancellation of the
    rest, with the gRPC chain: about 60 lines for one lost ps task, ahead of
    the one `ps task lost:` line that `run_with_ps_recovery` prints for it
    (or the `PsLostError` that ends the job). A worker's loss, which
    TensorFlow handles itself, names no ps task and is kept.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        unavailable = "UNAVAILABLE" in message or "UnavailableError" in message
        return not (unavailable and "/job:ps/" in message)


_QUIET_PS_LOSS = _QuietPsLoss()


def run_with_ps_recovery(
    attempt: Callable[[], dict],
    ps_addresses: Sequence[str],
    model_dir: str | None,
    ps_recovery_secs: float = settings.DEFAULT_PS_RECOVERY_SECS,
    print_fn=print,
) -> dict:
    """Runs `attempt` until it returns, recovering each lost ps task.

    See the module docstring.

    Args:
      attempt: one training attempt from `model_dir`, called with no
        argument; it returns the training result. It must build everything
        that lives on the cluster (strategy, model, optimizer) anew each call
        and verify what it restored (`verify_restored`; tf_keras `fit`:
        `tf_keras_fit.VerifyRestored`).
      ps_addresses: the ps tasks' `host:port`, by task index.
      model_dir: where `attempt` writes and resumes from checkpoints, or None.
      ps_recovery_secs: the longest wait for a lost task to serve again, in
        seconds, >= 0; 0 turns recovery off.
      print_fn: where the recovery lines go.

    Returns:
      What the last `attempt` returned, with `ps_recoveries` (int) added.

    Raises:
      PsLostError: naming the lost task, when there is no checkpoint to
        restore from, recovery is off, the task did not serve again within
        `ps_recovery_secs`, or it was lost `MAX_RECOVERIES_WITHOUT_PROGRESS`
        times in a row with no new checkpoint in between.
      Anything else `attempt` raises.
    """
    tf_logger = tf.get_logger()
    tf_logger.addFilter(_QUIET_PS_LOSS)
    try:
        return _attempts(attempt, ps_addresses, model_dir, ps_recovery_secs, print_fn)
    finally:
        tf_logger.removeFilter(_QUIET_PS_LOSS)


def _attempts(attempt, ps_addresses, model_dir, ps_recovery_secs, print_fn) -> dict:
    """`run_with_ps_recovery`'s loop (its arguments), TensorFlow's records of
    the losses it reports kept off the console."""
    recoveries = stalled = 0
    last_restored = None
    while True:
        try:
            result = attempt()
        except Exception as error:  # noqa: BLE001  (re-raised unless a ps loss)
            lost = lost_ps_tasks(error, ps_addresses)
            if not lost:
                raise
            cause = f"{type(_original(error)).__name__}"
            said = [announce.announced(task) for task in lost]
            cause += "".join(
                f"; {a.short_name()} announced it was stopping ({a.signal})"
                for a in said
                if a is not None
            )
            print_fn(f"ps task lost: {_names(lost)} ({cause})")
            checkpoint = paths.latest_checkpoint(model_dir)
            if not model_dir:
                raise _no_recovery_error(lost, "no --model_dir", None) from None
            if not checkpoint:
                raise _no_recovery_error(
                    lost,
                    f"{model_dir} holds no checkpoint yet to restore its "
                    "variables from",
                    model_dir,
                ) from None
            if not ps_recovery_secs > 0:
                raise _no_recovery_error(
                    lost, "recovery is off (--ps_recovery_secs=0)", model_dir
                ) from None
            stalled = stalled + 1 if checkpoint == last_restored else 1
            if stalled > MAX_RECOVERIES_WITHOUT_PROGRESS:
                raise PsLostError(
                    f"Lost {_names(lost)} again: {stalled} ps losses in a row "
                    f"with no checkpoint after {paths.describe_checkpoint(checkpoint)}"
                    f" (at most {MAX_RECOVERIES_WITHOUT_PROGRESS}). Find why the "
                    "task fails (its log), then rerun with --model_dir="
                    f"{model_dir} to resume from {os.path.basename(checkpoint)}.",
                    lost,
                ) from None
            print_fn(
                f"ps recovery: waiting up to {ps_recovery_secs:g} s "
                "(--ps_recovery_secs) for the task to serve again"
            )
            try:
                waited = wait_for_ps(lost, ps_recovery_secs, print_fn)
            except TimeoutError as timeout:
                raise PsLostError(
                    f"Lost {timeout} during training and it did not serve "
                    f"again within --ps_recovery_secs={ps_recovery_secs:g} s. "
                    "Restart it (on Kubernetes the TFJob's restart policy "
                    f"does), then rerun with --model_dir={model_dir} to "
                    f"resume from {paths.describe_checkpoint(checkpoint)}; or "
                    "raise --ps_recovery_secs.",
                    lost,
                ) from None
            recoveries += 1
            last_restored = checkpoint
            print_fn(
                f"ps recovery {recoveries}: serving again after {waited:.1f} s; "
                f"restoring every ps variable and slot from "
                f"{paths.describe_checkpoint(checkpoint)}"
            )
            continue
        if isinstance(result, dict):
            result["ps_recoveries"] = recoveries
        return result
