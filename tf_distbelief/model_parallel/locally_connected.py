"""`PartitionedLocallyConnected2D`: a tf_keras locally connected layer split
spatially over devices (the computation: `local_partitions`).

Dean et al. 2012, section 3: locally connected networks split best, because a
spatial block of units reads only a thin border ("halo") of the layer below from
its neighbours. `PartitionedLocallyConnected2D` cuts its output map into blocks, one
per device; each block's weights live on its device and only the halo crosses.

It computes exactly what `tf_keras.layers.LocallyConnected2D` computes, and takes
and gives weights in the same layout, so weights can be copied between them:

```python
import tensorflow as tf
import tf_keras
from tf_distbelief.model_parallel import devices as model_parallel
from tf_distbelief.model_parallel import locally_connected

model_parallel.configure_logical_cpus(4)  # Before TensorFlow initialises.
reference = tf_keras.layers.LocallyConnected2D(8, 3)
layer = locally_connected.PartitionedLocallyConnected2D(
    8, 3, num_partitions=4
)  # 7 output rows: blocks of 2, 2, 2 and 1.
x = tf.random.normal([2, 9, 9, 3])
reference(x), layer(x)
layer.set_unpartitioned_weights(reference.get_weights())
# 3 blocks read 2 halo rows: 3 * 2 rows * 9 cols * 3 channels * 2 examples * 4 B.
layer.cross_partition_bytes(batch_size=2)  # 1296
```

Stacked layers keep the activations partitioned, as in the paper, when the lower
one gives its output as blocks (`output_blocks=True`) and the upper one, with the
same grid and devices, takes them: only the halo between the layers crosses.

```python
lower = locally_connected.PartitionedLocallyConnected2D(
    8, 3, num_partitions=4, output_blocks=True
)
upper = locally_connected.PartitionedLocallyConnected2D(
    8, 3, num_partitions=4
)
blocks = lower(x)  # 4 tensors [2, rows, 7, 8] of 2, 2, 2 and 1 rows.
y = upper(blocks)  # [2, 5, 5, 8], as two stacked `LocallyConnected2D`.
# The upper blocks read rows 0-3, 2-4, 3-5, 4-6 and hold 0-1, 2-3, 4-5, 6: rows
# 2-3, 4, 3 and 4-5 cross, 6 rows * 7 cols * 8 channels * 2 examples * 4 B.
upper.cross_partition_bytes(batch_size=2)  # 2688
```

The Keras 3 layer is `tf_distbelief.keras3.layers.PartitionedLocallyConnected2D`.
"""

from __future__ import annotations

import tf_keras

from tf_distbelief.model_parallel import local_partitions

__all__ = ["PartitionedLocallyConnected2D"]


class PartitionedLocallyConnected2D(
    local_partitions.LocallyConnectedPartitions, tf_keras.layers.Layer
):
    """`tf_keras.layers.LocallyConnected2D` split spatially over devices.

    See `local_partitions.LocallyConnectedPartitions` for the arguments, the
    whole and block layouts and the computation. It computes exactly what
    `tf_keras.layers.LocallyConnected2D` (`padding="valid"`,
    `implementation=1` weights) computes; activations are tf_keras's. Under a
    `DistBeliefStrategy` the blocks are ps variables.
    """

    _keras = tf_keras
    # As `PartitionedDense`: each partition reads its variables where it runs.
    _weights_as_arguments = False
