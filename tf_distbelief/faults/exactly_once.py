"""Exactly-once step accounting: a retried scheduled step is never applied twice.

TensorFlow's `ClusterCoordinator` runs a scheduled function again on another
worker when the worker running it is lost. If the lost worker had already
sent its update and the ps applied it, the retry would apply the step a
second time.

So each scheduled step carries a token fixed when it is scheduled: the
closure's first token (`StepTokens.take`, a counter on the coordinator) plus
the step's index in the closure, an int64 argument of the scheduled
function (a retry gets the same argument: the coordinator keeps the
closure's arguments). On the ps, next to the optimizer's `iterations`, a
ring of `SLOTS` int64 entries holds the tokens applied, each at `token %
SLOTS`. A step's update runs only if its token is not there, and writes it
there (`gate`).

The check, the update and the write run on the ps, in one
`tf.CriticalSection` of the ring's task: the coordinator retries as soon as
it sees the loss, so a retry can start while the lost step still runs on the
ps; under the lock it waits for that step, then finds its token. The lock is
taken once every tensor the update reads is there (callers copy the step's
inputs to the ps first, `copy_to`), so no transfer from a worker runs under
it. A branch, once begun, must run to its end, update and token write both,
even when its worker is lost meanwhile: every op of the check and its
branches that names no device is placed on the ring's ps, and the branch
runs as one function call there, not lowered into the step's graph
(`tf_internals.control_flow.whole_cond`), where a lost worker's failed
transfers could cut it between the update and the write. The optimizer's
`iterations` then counts applied steps only; a step refused for a NaN or inf
(`nonfinite="skip"`) is marked too, so its retry is not counted again. A
Downpour replica whose retried push is dropped restarts its sums, as after a
push dropped for staleness.

Where it applies (each through `scope`, read when the step is traced):

* tf_keras `training.fit`: `tf_keras_fit.install_exactly_once` gives the
  train function the tokens; the update (and its non-finite guard,
  `tf_keras_fit.Guard`) runs in one `tf.cond`;
* stock Keras 3 training (`keras3.fit`): each step's AdaGrad update is
  gated in its own scheduled function, with a step counter as the ring's
  neighbour;
* Downpour: each push is gated by the token of the step that ends it
  (`downpour.exchange`); with `n_push = 1` every step pushes once, so pushes
  and steps match one for one. With `n_push > 1` a retry on another replica
  pushes at its own cadence: its pushes carry its own gradients, never a
  repeat of the lost worker's.

Limits (the user's view: docs/reliability.md): the ring is not checkpointed
(tokens and ring restart at 0 with a new coordinator); a token is forgotten
once `SLOTS` later tokens are written, far more steps than run between a
worker's loss and its retry. With variables on several ps tasks, the ones on
other tasks than the ring's are updated by the same `tf.cond`, which
TensorFlow then lowers into the step's graph (a functional If cannot take
variables of two tasks, `whole_cond`): a worker lost mid-update can leave
the step half applied and its retry applies it again (a step is not a
transaction across tasks in TensorFlow).
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import tensorflow as tf

from tf_distbelief.tf_internals import control_flow

__all__ = [
    "SLOTS",
    "StepTokens",
    "copy_to",
    "current",
    "gate",
    "scope",
    "tokens_for",
]

# Tokens remembered on the ps. A retry follows its worker's loss within
# seconds: at a few hundred steps/s that is ~1,000 steps; 4096 int64 entries
# (32 KiB) leave room for more.
SLOTS = 4096

_STATE = threading.local()
_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def scope(token):
    """Makes `token` (an int64 scalar tensor) the step token while tracing."""
    previous = getattr(_STATE, "token", None)
    _STATE.token = token
    try:
        yield
    finally:
        _STATE.token = previous


def current():
    """The step token of the step being traced, or None outside `scope`."""
    return getattr(_STATE, "token", None)


class StepTokens:
    """The ring of applied step tokens of one optimizer (see the module).

    Create it with `tokens_for` for a tf_keras optimizer; a Keras 3 step
    (`keras3.fit`) creates its own. Not tracked by any checkpoint.

    Args:
      colocate_with: a ps variable (a tf_keras optimizer's `iterations`, a
        Keras 3 run's step counter) whose ps task gets the ring.
      strategy: the strategy that variable lives on.

    Attributes:
      ring: on the ps, `[SLOTS]` int64, -1 where no token was written.
      section: the `tf.CriticalSection` on the ring's ps task that each
        check, update and write of a token runs in (`gate`).
    """

    def __init__(self, colocate_with, strategy):
        with (
            strategy.scope(),
            strategy.extended.colocate_vars_with(colocate_with),
        ):
            self.ring = tf.Variable(
                tf.fill([SLOTS], tf.constant(-1, tf.int64)),
                trainable=False,
                name="exactly_once_tokens",
            )
        with tf.device(self.ring.device):
            self.section = tf.CriticalSection(name="exactly_once_claims")
        self._next = 0
        self._lock = threading.Lock()

    def take(self, steps: int) -> int:
        """The first of `steps` new tokens for one scheduled function."""
        with self._lock:
            first = self._next
            self._next += int(steps)
        return first

    def _handle(self):
        ring = self.ring
        return ring.get().handle if hasattr(ring, "get") else ring.handle

    def fresh(self, token) -> tf.Tensor:
        """True (a bool scalar on the ring's ps task) if `token` is not applied."""
        with tf.device(self.ring.device):
            slot = tf.math.floormod(token, SLOTS)
            seen = tf.raw_ops.ResourceGather(
                resource=self._handle(), indices=slot, dtype=tf.int64
            )
            return tf.not_equal(seen, token)

    def mark(self, token):
        """The op writing `token` into the ring (on the ring's ps task)."""
        with tf.device(self.ring.device):
            slot = tf.math.floormod(token, SLOTS)
            return tf.raw_ops.ResourceScatterUpdate(
                resource=self._handle(), indices=slot, updates=token
            )


def tokens_for(optimizer, strategy=None) -> StepTokens:
    """The `StepTokens` of `optimizer`, created on first use.

    Args:
      optimizer: a built tf_keras optimizer.
      strategy: its strategy; None reads `optimizer._distribution_strategy`
        through the current one (`tf.distribute.get_strategy`).
    """
    tokens = _TOKENS.get(optimizer)
    if tokens is None:
        strategy = strategy or tf.distribute.get_strategy()
        # `iterations` read under the strategy's scope: a tf_keras optimizer
        # creates it on first read, and it must be a ps variable.
        with tf.init_scope(), strategy.scope():
            tokens = StepTokens(optimizer.iterations, strategy)
        _TOKENS[optimizer] = tokens
    return tokens


def copy_to(device: str, value):
    """`value` (a tensor or `tf.IndexedSlices`) as received on `device`.

    A scheduled step's inputs to its update (gradients, new non-trainable
    values), copied to the ps task of the variable they update before `gate`,
    whose branches then read the copy: the lock waits for the copy, and no
    transfer from the worker runs under it.

    Args:
      device: a variable's device, e.g. `/job:ps/replica:0/task:0/device:CPU:0`.
      value: a tensor or `tf.IndexedSlices` on the worker.

    Returns:
      The same type, its tensors on `device`.
    """
    with tf.device(device):
        if isinstance(value, tf.IndexedSlices):
            return tf.IndexedSlices(
                tf.identity(value.values),
                tf.identity(value.indices),
                value.dense_shape,
            )
        return tf.identity(value)


def gate(token, tokens: StepTokens, ready, apply_fn, refuse_fn, duplicate_fn):
    """`apply_fn()` if `ready` and `token` is fresh, marking it; else the others.

    The check, the branch taken and the token's write run in
    `tokens.section` (a `tf.CriticalSection` on the ring's ps task), whose
    lock is taken once every tensor the branches read has been made, and on
    that task: ops that name no device are placed there, and the branch taken
    runs as one function call (`control_flow.whole_cond`), which ends once
    begun even if the worker is lost. The branches should read the step's
    inputs as copied to the ps (`copy_to`), not the worker's: a transfer
    from the worker would run under the lock, and fail with the worker. They
    should hold no loop op (`tf.while_loop`, a `tf.range` loop): a loop stops
    when the step is cancelled, which would leave the update half applied
    and its token unwritten.

    Args:
      token: the step token, an int64 scalar.
      tokens: the `StepTokens`.
      ready: a bool scalar (e.g. every gradient finite).
      apply_fn: the update: returns `(outputs, after)`, where `after` lists
        tensors on the ps that the token write follows (the update done).
        Only ps tensors: a write that waited for the worker would not run if
        the worker were lost after the update, and the retry would apply it
        again.
      refuse_fn: run for a fresh token when not `ready` (a step refused and
        counted, which a retry must not count again): `(outputs, after)` too.
      duplicate_fn: run for a token already applied: the same `outputs`.

    Returns:
      The outputs of the branch taken (after the token write, if any).
    """

    def marked(fn):
        def branch():
            outputs, after = fn()
            with tf.control_dependencies(after):
                written = tokens.mark(token)
            with tf.control_dependencies([written]):
                return tf.nest.map_structure(tf.identity, outputs)

        return branch

    def check_and_apply():
        fresh = tokens.fresh(token)
        # Kept whole: a branch begun on the ps ends, update and token write
        # both, even when the worker is lost meanwhile.
        return control_flow.whole_cond(
            tf.logical_and(ready, fresh),
            marked(apply_fn),
            lambda: tf.cond(fresh, marked(refuse_fn), duplicate_fn),
        )

    # Every op of the check and its branches that names no device runs on
    # the ring's ps task, not on the worker tracing the step.
    with tf.device(tokens.ring.device):
        return tokens.section.execute(check_and_apply)
