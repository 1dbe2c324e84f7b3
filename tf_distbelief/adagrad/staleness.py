"""Staleness-aware AdaGrad steps for asynchronous parameter-server training.

Under stock asynchronous training (`DistBeliefStrategy` with tf_keras `fit`,
no Downpour), every model replica reads the parameters from the ps shards,
computes a gradient on its batch and sends it back, while the other replicas'
updates land on the shards. A gradient's staleness `tau` is the number of
updates applied between its step's read of the parameters and its own update:
about `num_workers - 1` in steady state, and much more for a replica that was
held up. A stale gradient points where the parameters were, so a step of full
size overshoots; with 8 and 16 replicas the digits job's loss jumped tenfold
mid-training and its test accuracy scattered.

Zhang, Gupta, Lian and Liu ("Staleness-aware Async-SGD for Distributed Deep
Learning", IJCAI 2016) divide the step of a gradient by its staleness. Here
the step is `gamma / max(1, tau)^power` (`Adagrad(staleness_power=...)`):
`power = 1` is their rule, `0` turns it off. The default `0.75` leaves an
update of staleness 0 or 1 unchanged, so one or two replicas train exactly as
before, and gives a typical update of 8 replicas (`tau` about 7) 0.23 of the
step, of 16 replicas 0.13: between the power 0.5, under which a burst of
stale updates still overshoots, and 1, under which the damped steps leave
the model short of training in the same number of steps (the digits job with
8 and 16 workers, benchmarks/README "More model replicas").

`tau` is measured, not assumed: the step reads the optimizer's `iterations`
(a ps variable counting applied steps) before its forward pass (`read_before`),
and each variable's update reads it again on the ps and takes the difference
(`damped_learning_rate`). The read is a scalar; no other traffic is added.
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

__all__ = ["damped_learning_rate", "damping", "read_before", "scope"]

_STATE = threading.local()


def read_before(optimizer):
    """The optimizer's applied-step count, read now, or None if it is not damped.

    Call it in the step function before the forward pass, and build the
    forward pass under `tf.control_dependencies([read])`, so that the count is
    read before any parameter is.

    Args:
      optimizer: the step's optimizer; damped when it has a
        `staleness_power` above 0 (`tf_distbelief.adagrad.Adagrad`).

    Returns:
      An int64 scalar tensor, or None.
    """
    if not getattr(optimizer, "staleness_power", 0) > 0:
        return None
    return optimizer.iterations.read_value()


@contextlib.contextmanager
def scope(read):
    """Makes `read` (from `read_before`, or None) the step's count while tracing.

    The scope is thread-local, as `tf.distribute` traces a step's forward pass
    and its update in different threads: enter it in both.
    """
    previous = getattr(_STATE, "read", None)
    _STATE.read = read
    try:
        yield
    finally:
        _STATE.read = previous


def damping(count, read, power: float):
    """`1 / max(1, tau)^power` (float64), `tau` = `count` now less `read`.

    Args:
      count: the applied-step counter (an int64 variable on a ps task).
      read: its value read before the step's forward pass (int64 scalar).
      power: the exponent, a float > 0.

    Returns:
      A float64 scalar tensor in (0, 1].
    """
    tau = tf.cast(count.read_value() - read, tf.float64)
    stale = tf.maximum(tf.constant(1.0, tf.float64), tau)
    return 1.0 / stale ** tf.constant(float(power), tf.float64)


def damped_learning_rate(learning_rate, iterations, power: float):
    """`learning_rate * damping(...)` in a step's `scope`, else `learning_rate`.

    Args:
      learning_rate: gamma, a scalar tensor (float32 or float64).
      iterations: the optimizer's `iterations` variable (int64, on a ps task).
      power: the exponent, a float >= 0 (0: `learning_rate` unchanged).

    Returns:
      A scalar tensor of `learning_rate`'s dtype.
    """
    read = getattr(_STATE, "read", None)
    if read is None or power == 0:
        return learning_rate
    return learning_rate * tf.cast(
        damping(iterations, read, power), learning_rate.dtype
    )
