"""A dense layer whose output units are split over devices: its computation.

Dean et al. 2012, section 3: each partition of a model-parallel replica computes its
own units. For a fully connected layer a partition owns a block of output columns:
its slice of the kernel and bias live on its device and it computes
`inputs @ kernel[:, cols] + bias[cols]` there. Every partition needs the whole input,
so `(num_partitions - 1)` copies of it cross partitions per forward pass, which is
why fully connected layers gain least from model parallelism.

`DensePartitions` is that layer without its Keras: `model_parallel.dense`
mixes it into a tf_keras layer, `tf_distbelief.keras3.layers` into a Keras 3
layer; both compute exactly what their Keras's `Dense` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import EllipsisType

import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.model_parallel import base, partition_math

__all__ = ["ELEMENTWISE_ACTIVATIONS", "DensePartitions"]

# Activations that act on each element alone, so each partition applies them to its
# own units; any other (softmax normalises over all units) runs after the concat.
ELEMENTWISE_ACTIVATIONS = frozenset(
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


class DensePartitions(base.PartitionedWeights):
    """Mixin: `Dense` with its units split over devices.

    Partition `k` owns units `bounds[k]:bounds[k + 1]` (`partition_math.split_bounds`,
    so `units` need not divide evenly: 10 units over 4 partitions gives 3, 3, 2, 2).
    Its kernel `[input_units, its_units]` and bias `[its_units]` are created under
    its device, and its matrix product runs there; the outputs are concatenated.
    Element-wise activations run per partition, others (softmax) after the concat.
    Results equal `Dense` with the same weights (`set_unpartitioned_weights`,
    which takes `[kernel, bias]` as `Dense.get_weights()` gives them:
    `[input_units, units]` and `[units]`).
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
          activation: activation of the layer's Keras (a name or a function).
          use_bias: whether to add a `[units]` bias.
          kernel_initializer: initializer of the whole `[input_units, units]` kernel.
          bias_initializer: initializer of the whole bias.
          **kwargs: the Keras `Layer`'s arguments (`name`, `dtype`, ...).

        Raises:
          ValueError: if `units` or `num_partitions` is out of range.
        """
        if not checks.is_int(units) or units < 1:
            raise checks.argument_error("units", "an int >= 1", units)
        if not checks.is_int(num_partitions) or not 1 <= num_partitions <= units:
            raise checks.argument_error(
                "num_partitions",
                f"an int >= 1 and <= `units` ({units})",
                num_partitions,
            )
        units, num_partitions = int(units), int(num_partitions)
        super().__init__(**kwargs)
        self._init_partitioned(
            num_partitions,
            devices,
            activation,
            use_bias,
            kernel_initializer,
            bias_initializer,
        )
        self.units = units
        self.bounds = partition_math.split_bounds(units, num_partitions)
        self.input_spec = self._keras.layers.InputSpec(min_ndim=2)

    def build(self, input_shape):
        input_units = tf.TensorShape(input_shape)[-1]
        if input_units is None:
            raise ValueError(
                "Argument `input_shape` must have a known last dimension. "
                f"Received: {input_shape}"
            )
        self.input_units = int(input_units)
        self._build_blocks(self.num_partitions)
        super().build(input_shape)

    def _weight_layouts(self) -> tuple[base.WeightLayout, base.WeightLayout]:
        sizes = [b - a for a, b in zip(self.bounds, self.bounds[1:])]
        kernel = (self.input_units, self.units)
        return (
            base.WeightLayout(kernel, kernel, tuple((kernel[0], n) for n in sizes)),
            base.WeightLayout((self.units,), (self.units,), tuple((n,) for n in sizes)),
        )

    def _block_index(self, k: int) -> tuple[EllipsisType, slice]:
        # The units are the last axis of both the kernel and the bias.
        return ..., slice(self.bounds[k], self.bounds[k + 1])

    def call(self, inputs):
        name = self._activation_name()
        elementwise = isinstance(name, str) and name in ELEMENTWISE_ACTIVATIONS

        def partition(kernel, bias, x):
            if x.shape.rank == 2:
                y = tf.matmul(x, kernel)
            else:
                y = tf.tensordot(x, kernel, [[-1], [0]])
            if bias is not None:
                y = y + bias
            return self.activation(y) if elementwise else y

        outputs = []
        for k in range(len(self.partition_devices)):
            with tf.name_scope(f"partition_{k}"):
                outputs.append(self._on_device(k, partition, inputs))
        outputs = tf.concat(outputs, axis=-1)
        return outputs if elementwise else self.activation(outputs)

    def compute_output_shape(self, input_shape):
        return self._shape([*tf.TensorShape(input_shape)[:-1].as_list(), self.units])

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

    def get_config(self):
        config = super().get_config()
        config.update(self._partitioned_config(), units=self.units)
        return config
