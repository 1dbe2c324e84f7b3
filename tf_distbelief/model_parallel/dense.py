"""A dense layer whose output units are split over devices.

Dean et al. 2012, section 3: each partition of a model-parallel replica computes its
own units. For a fully connected layer a partition owns a block of output columns:
its slice of the kernel and bias live on its device and it computes
`inputs @ kernel[:, cols] + bias[cols]` there. Every partition needs the whole input,
so `(num_partitions - 1)` copies of it cross partitions per forward pass, which is
why fully connected layers gain least from model parallelism.

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
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief.model_parallel import devices as model_parallel
from tf_distbelief.model_parallel import partition_math

__all__ = ["PartitionedDense"]

# Activations that act on each element alone, so each partition applies them to its
# own units; any other (softmax normalises over all units) runs after the concat.
_ELEMENTWISE_ACTIVATIONS = frozenset(
    [
        "linear",
        "relu",
        "relu6",
        "sigmoid",
        "hard_sigmoid",
        "tanh",
        "elu",
        "selu",
        "gelu",
        "swish",
        "silu",
        "softplus",
        "softsign",
        "exponential",
    ]
)


class PartitionedDense(tf_keras.layers.Layer):
    """`tf_keras.layers.Dense` with its units split over devices.

    Partition `k` owns units `bounds[k]:bounds[k + 1]` (`partition_math.split_bounds`,
    so `units` need not divide evenly: 10 units over 4 partitions gives 3, 3, 2, 2).
    Its kernel `[input_units, its_units]` and bias `[its_units]` are created under
    its device, and its matrix product runs there; the outputs are concatenated.
    Element-wise activations run per partition, others (softmax) after the concat.
    Results equal `tf_keras.layers.Dense` with the same weights
    (`set_unpartitioned_weights`).
    """

    def __init__(
        self,
        units: int,
        num_partitions: int = 1,
        devices: Sequence[str] | None = None,
        activation=None,
        use_bias: bool = True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        """Creates the layer; weights are made in `build`.

        Args:
          units: output width.
          num_partitions: partitions of the units, `1 <= num_partitions <= units`.
          devices: device names; `None` means `model_parallel.replica_devices()`.
            Partition `k` runs on `devices[k % len(devices)]`.
          activation: `tf_keras` activation.
          use_bias: whether to add a `[units]` bias.
          kernel_initializer: initializer of the whole `[input_units, units]` kernel.
          bias_initializer: initializer of the whole bias.
          **kwargs: `tf_keras.layers.Layer` arguments (`name`, `dtype`, ...).

        Raises:
          ValueError: if `units` or `num_partitions` is out of range.
        """
        super().__init__(**kwargs)
        if not isinstance(units, int) or units < 1:
            raise ValueError(f"Argument `units` must be >= 1. Received: {units!r}")
        if not isinstance(num_partitions, int) or not 1 <= num_partitions <= units:
            raise ValueError(
                f"Argument `num_partitions` must be >= 1 and <= `units` ({units}). "
                f"Received: {num_partitions!r}"
            )
        self.units = units
        self.num_partitions = num_partitions
        self.devices = None if devices is None else list(devices)
        self.activation = tf_keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = tf_keras.initializers.get(kernel_initializer)
        self.bias_initializer = tf_keras.initializers.get(bias_initializer)
        self.bounds = partition_math.split_bounds(units, num_partitions)
        self.input_spec = tf_keras.layers.InputSpec(min_ndim=2)

    def build(self, input_shape):
        input_units = tf.TensorShape(input_shape)[-1]
        if input_units is None:
            raise ValueError(
                "Argument `input_shape` must have a known last dimension. "
                f"Received: {input_shape}"
            )
        self.input_units = input_units
        self.partition_devices = model_parallel.assign_devices(
            self.num_partitions, self.devices
        )
        kernel_cache, bias_cache = {}, {}
        self.block_kernels, self.block_biases = [], []
        for k, device in enumerate(self.partition_devices):
            cols = slice(self.bounds[k], self.bounds[k + 1])
            with tf.device(device):
                self.block_kernels.append(
                    self.add_weight(
                        f"kernel_{k}",
                        shape=(input_units, cols.stop - cols.start),
                        initializer=model_parallel.sliced_initializer(
                            self.kernel_initializer,
                            (input_units, self.units),
                            kernel_cache,
                            lambda full, cols=cols: full[:, cols],
                        ),
                    )
                )
                if self.use_bias:
                    self.block_biases.append(
                        self.add_weight(
                            f"bias_{k}",
                            shape=(cols.stop - cols.start,),
                            initializer=model_parallel.sliced_initializer(
                                self.bias_initializer,
                                (self.units,),
                                bias_cache,
                                lambda full, cols=cols: full[cols],
                            ),
                        )
                    )
        kernel_cache.clear()
        bias_cache.clear()
        super().build(input_shape)

    def call(self, inputs):
        name = tf_keras.activations.serialize(self.activation)
        elementwise = isinstance(name, str) and name in _ELEMENTWISE_ACTIVATIONS
        outputs = []
        for k, device in enumerate(self.partition_devices):

            def partition(x, k=k):
                if x.shape.rank == 2:
                    y = tf.matmul(x, self.block_kernels[k])
                else:
                    y = tf.tensordot(x, self.block_kernels[k], [[-1], [0]])
                if self.use_bias:
                    y = y + self.block_biases[k]
                return self.activation(y) if elementwise else y

            with tf.name_scope(f"partition_{k}"):
                outputs.append(model_parallel.call_on_device(device, partition, inputs))
        outputs = tf.concat(outputs, axis=-1)
        return outputs if elementwise else self.activation(outputs)

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape)[:-1].concatenate([self.units])

    def cross_partition_bytes(self, batch_size: int) -> int:
        """Input bytes one forward pass moves between partitions (backward: as many).

        Args:
          batch_size: examples per step (rows of a rank-2 input).

        Returns:
          `partition_math.dense_cross_partition_bytes` for this layer's shapes.
        """
        return partition_math.dense_cross_partition_bytes(
            batch_size, self.input_units, self.num_partitions, self.compute_dtype
        )

    def unpartition(self, block_values: Sequence) -> list[np.ndarray]:
        """Assembles per-partition values into the `tf_keras.layers.Dense` layout.

        Args:
          block_values: one array per variable, in `self.trainable_weights` order:
            the block weights themselves, or their gradients.

        Returns:
          `kernel` `[input_units, units]` and, with `use_bias`, `bias` `[units]`.
        """
        index = {id(v): i for i, v in enumerate(self.trainable_weights)}

        def gather(variables, axis):
            values = [np.asarray(block_values[index[id(v)]]) for v in variables]
            return np.concatenate(values, axis=axis)

        weights = [gather(self.block_kernels, axis=1)]
        if self.use_bias:
            weights.append(gather(self.block_biases, axis=0))
        return weights

    def get_unpartitioned_weights(self) -> list[np.ndarray]:
        """Returns the weights as `tf_keras.layers.Dense.get_weights()` lays them out.

        Returns:
          `[kernel, bias]` (see `unpartition`), or `[kernel]` without bias.
        """
        return self.unpartition([v.numpy() for v in self.trainable_weights])

    def set_unpartitioned_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Loads weights laid out as `tf_keras.layers.Dense` (`get_weights()`).

        Args:
          weights: `[kernel, bias]`, or `[kernel]` without bias.

        Raises:
          ValueError: if the number or shapes of `weights` do not match.
        """
        expected = [(self.input_units, self.units)] + [(self.units,)] * self.use_bias
        got = [tuple(np.shape(w)) for w in weights]
        if got != expected:
            raise ValueError(
                f"Argument `weights` must have shapes {expected}. Received: {got}"
            )
        for k, kernel in enumerate(self.block_kernels):
            cols = slice(self.bounds[k], self.bounds[k + 1])
            kernel.assign(weights[0][:, cols])
            if self.use_bias:
                self.block_biases[k].assign(weights[1][cols])

    def get_config(self):
        config = super().get_config()
        config.update(
            units=self.units,
            num_partitions=self.num_partitions,
            devices=self.devices,
            activation=tf_keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            kernel_initializer=tf_keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=tf_keras.initializers.serialize(self.bias_initializer),
        )
        return config
