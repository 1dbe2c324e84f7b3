"""A straggler for Sandblaster tests and benchmarks: one worker made slower.

Dean et al. 2012, section 4.2: backup tasks exist so that one slow machine does
not hold up the end of a batch. To show them at work on a local cluster, where
every worker is as fast as the others, `slow_worker` returns a
`sandblaster.portion.PortionDelayFn` that makes one worker sleep after each
portion it computes. The sleep is `tf.data`'s test-only sleep transformation,
an op the library itself never uses; it sleeps on the worker without taking a
core from the others.

Example:

```python
objective = sandblaster.SandblasterObjective(
    strategy, model, loss, x, y,
    portion_delay_fn=stragglers.slow_worker(1, straggler_slowdown=5.0))
```
"""

from __future__ import annotations

import tensorflow as tf

# Public route checked: `tf.data.experimental` does not export the sleep
# transformation (TensorFlow 2.21).
from tensorflow.python.data.experimental.ops import testing as tf_data_testing

__all__ = ["slow_worker"]


def _sleep(secs: tf.Tensor) -> tf.Tensor:
    """Sleeps `secs` (a float64 scalar) on the device it runs on; returns 0."""
    micros = tf.cast(tf.maximum(secs, 0.0) * 1e6, tf.int64)
    data = tf.data.Dataset.from_tensors(tf.constant(0, tf.int64))
    return data.apply(tf_data_testing.sleep(micros)).reduce(
        tf.constant(0, tf.int64), lambda a, b: a + b
    )


def slow_worker(
    straggler_worker: int,
    straggler_slowdown: float = 1.0,
    straggler_delay_secs: float = 0.0,
):
    """Returns a `PortionDelayFn` that slows worker `straggler_worker` down.

    A portion on that worker then lasts `straggler_slowdown` times its compute
    time (fetch included) plus `straggler_delay_secs`: it sleeps
    `(straggler_slowdown - 1) * compute_secs + straggler_delay_secs` after
    writing its gradient. Portions on the other workers are not delayed.

    Args:
      straggler_worker: the slowed worker's index.
      straggler_slowdown: the slowdown factor, >= 1.
      straggler_delay_secs: extra sleep of each slowed portion, >= 0.

    Returns:
      `(worker, compute_secs) -> tf.Tensor`, for `portion_delay_fn`.

    Raises:
      ValueError: `straggler_slowdown < 1` or `straggler_delay_secs < 0`.
    """
    if not (straggler_slowdown >= 1.0 and straggler_delay_secs >= 0.0):
        raise ValueError(
            "Arguments `straggler_slowdown` >= 1 and `straggler_delay_secs` >= 0 "
            f"required. Received: {straggler_slowdown!r}, {straggler_delay_secs!r}"
        )
    slowdown, delay_secs = float(straggler_slowdown), float(straggler_delay_secs)

    def delay(worker: tf.Tensor, compute_secs: tf.Tensor) -> tf.Tensor:
        return tf.cond(
            tf.equal(worker, int(straggler_worker)),
            lambda: _sleep((slowdown - 1.0) * compute_secs + delay_secs),
            lambda: tf.constant(0, tf.int64),
        )

    return delay
