"""In-memory training data cut into one shard per worker (section 4.1).

The model replicas of Dean et al. 2012 each read their own subset of the
training data. TensorFlow's parameter-server strategy calls a dataset function
with input pipeline 0 of 1 on every worker, so sharding by the
`tf.distribute.InputContext` cannot tell the workers apart; `arrays_dataset_fn`
shards by the worker index instead (the coordinator's, as
`tf.distribute.coordinator.experimental_get_current_worker_index` reads it).
The coordinator traces the dataset function once and sends its graph to every
task, so the arrays are not constants of that graph: each worker's shard is
fed to its own call (`tf_internals.worker_inputs`), and what a worker receives
for its data is its shard, about `1 / W` of the arrays. Both training paths
read NumPy arrays through it: tf_keras's `fit.training.dataset_creator` and
Keras 3's `keras3.fit(x, y)`. This module imports no Keras.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf

from tf_distbelief.tf_internals import worker_inputs


def arrays_dataset_fn(
    x: np.ndarray,
    y: np.ndarray,
    batch_size: int,
    seed: int | None,
    num_replicas: Callable[[], int],
) -> Callable:
    """The per-worker dataset function of `(x, y)`: worker `i` of `W` its shard.

    Worker `i` of `W` reads records `i, i + W, i + 2W, ...`, shuffled within
    its shard (reshuffled at each pass), repeated, in batches of `batch_size`
    (the last partial batch of a pass dropped). One pass of every worker over
    its shard reads each record exactly once. Worker `i` is sent those
    records only, when its dataset is created (again if it rejoins). Outside
    a function (the coordinator asking for the element spec) there is no
    worker: every record.

    Args:
      x: `[n, ...]` features.
      y: `[n, ...]` labels.
      batch_size: examples per batch, >= 1.
      seed: shuffle seed, or None for a new order every run.
      num_replicas: called when a worker builds its pipeline, gives `W` (1:
        every worker reads all the data).

    Returns:
      `dataset_fn(input_context=None) -> tf.data.Dataset` of `(x, y)` batches
      of `[batch_size, ...]`, for `ClusterCoordinator.create_per_worker_dataset`
      or a `DatasetCreator` (the input context is not used: pipeline 0 of 1 on
      every worker).
    """

    def dataset_fn(input_context=None):
        del input_context  # Pipeline 0 of 1 on every worker (see the module).
        shards = num_replicas()
        if shards > 1 and tf.inside_function():
            # Fed at each worker's call: worker `i` is sent its records only.
            ds = tf.data.Dataset.from_tensor_slices(
                tuple(
                    worker_inputs.per_worker_input(
                        lambda i, a=a: _shard(a, i, shards), _spec(a)
                    )
                    for a in (x, y)
                )
            )
            size = -(-len(x) // shards)
        else:
            ds = tf.data.Dataset.from_tensor_slices((x, y))
            size = len(x)
        ds = ds.shuffle(size, seed=seed, reshuffle_each_iteration=True)
        return ds.repeat().batch(batch_size, drop_remainder=True).prefetch(2)

    return dataset_fn


def _shard(array, index: int, shards: int):
    """Records `index, index + shards, ...` of `array`.

    Raises:
      ValueError: `index` is not in `[0, shards)` (more workers than shards).
    """
    if not 0 <= index < shards:
        raise ValueError(
            f"Worker {index} has no shard: the data is cut into {shards} shards "
            f"(`num_replicas`), for workers 0 to {shards - 1}. Pass `num_replicas` "
            "= the number of workers, or None."
        )
    return array[index::shards]


def _spec(array) -> tf.TensorSpec:
    """`[None, ...]` of `array`, in the dtype `from_tensor_slices` gives it."""
    with tf.init_scope():  # Eager: no constant in the traced graph.
        dtype = tf.convert_to_tensor(array[:1]).dtype
    return tf.TensorSpec([None, *np.shape(array)[1:]], dtype)
