"""`PartitionedDense`: a tf_keras dense layer whose output units are split over
devices (Dean et al. 2012, section 3; the computation: `dense_partitions`).

```python
import tensorflow as tf
import tf_keras
from tf_distbelief.model_parallel import devices as model_parallel
from tf_distbelief.model_parallel import dense as partitioned_dense

model_parallel.configure_logical_cpus(4)  # Before TensorFlow initialises.
reference = tf_keras.layers.Dense(10)
layer = partitioned_dense.PartitionedDense(10, num_partitions=4)  # 3, 3, 2, 2.
x = tf.random.normal([8, 440])
reference(x), layer(x)
layer.set_unpartitioned_weights(reference.get_weights())
layer.cross_partition_bytes(batch_size=8)  # 3 * 8 * 440 * 4 bytes.
```

The Keras 3 layer is `tf_distbelief.keras3.layers.PartitionedDense`.
"""

from __future__ import annotations

import tf_keras

from tf_distbelief.model_parallel import dense_partitions

__all__ = ["PartitionedDense"]


class PartitionedDense(dense_partitions.DensePartitions, tf_keras.layers.Layer):
    """`tf_keras.layers.Dense` with its units split over devices.

    See `dense_partitions.DensePartitions` for the arguments and the
    computation: partition `k`'s kernel `[input_units, its_units]` and bias
    `[its_units]` are created under its device and its matrix product runs
    there. Results equal `tf_keras.layers.Dense` with the same weights
    (`set_unpartitioned_weights` takes `Dense.get_weights()`). Activations are
    tf_keras's. Under a `DistBeliefStrategy` the blocks are ps variables
    (sharded by the strategy's partitioner like any other).
    """

    _keras = tf_keras
    # Each partition reads its variables where it runs (a `ShardedVariable`
    # joined there), differentiated through `tf.custom_gradient`'s `variables`.
    _weights_as_arguments = False
