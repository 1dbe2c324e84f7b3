"""In-memory training data cut into one shard per worker (section 4.1).

The model replicas of Dean et al. 2012 each read their own subset of the
training data. TensorFlow's parameter-server strategy calls a dataset function
with input pipeline 0 of 1 on every worker, so sharding by the
`tf.distribute.InputContext` cannot tell the workers apart; `arrays_dataset_fn`
shards by the worker index instead
(`tf.distribute.coordinator.experimental_get_current_worker_index`, which the
coordinator gives each worker's copy of the function). Both training paths
read NumPy arrays through it: tf_keras's `fit.training.dataset_creator` and
Keras 3's `keras3.fit(x, y)`. This module imports no Keras.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tensorflow as tf


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
    its shard reads each record exactly once. Outside a function (the
    coordinator asking for the element spec) there is no worker: every
    record.

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
        ds = tf.data.Dataset.from_tensor_slices((x, y))
        shards = num_replicas()
        if shards > 1 and tf.inside_function():
            index = tf.distribute.coordinator.experimental_get_current_worker_index()
            ds = ds.shard(shards, index)
            size = -(-len(x) // shards)
        else:
            size = len(x)
        ds = ds.shuffle(size, seed=seed, reshuffle_each_iteration=True)
        return ds.repeat().batch(batch_size, drop_remainder=True).prefetch(2)

    return dataset_fn
