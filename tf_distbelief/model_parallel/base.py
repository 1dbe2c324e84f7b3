"""The weights of a partitioned layer: one block per partition, on its device.

Dean et al. 2012, section 3: each partition of a model-parallel replica owns the
parameters of its units. `PartitionedWeights` holds what every partitioned layer
shares, in tf_keras and in Keras 3 alike: a kernel block and a bias block per
partition, created under the partition's device and initialised as slices of one
whole draw, the conversion of all blocks to and from the layout of the
unpartitioned layer's weights (`get_unpartitioned_weights`,
`set_unpartitioned_weights`, `unpartition` for gradients), and the call of one
partition's computation on its device with its weights (`_on_device`). A layer
says how its weights split (`_weight_layouts`, `_block_index`) and computes its
outputs (`dense_partitions`, `local_partitions`); the layer classes add the
Keras base class (`dense`, `locally_connected` for tf_keras;
`tf_distbelief.keras3.layers` for Keras 3).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.model_parallel import devices as model_parallel

__all__ = ["PartitionedWeights", "WeightLayout", "sliced_initializer"]


class WeightLayout(NamedTuple):
    """How one weight of the unpartitioned layer is cut into per-partition blocks.

    Attributes:
      whole_shape: the weight as the unpartitioned layer holds it
        (`get_weights()`); its initializer draws this shape.
      grid_shape: the same elements reshaped so that partition `k`'s block is the
        slice `grid[layer._block_index(k)]`.
      block_shapes: per partition, the shape of its variable: its slice, reshaped.
    """

    whole_shape: tuple[int, ...]
    grid_shape: tuple[int, ...]
    block_shapes: tuple[tuple[int, ...], ...]


def sliced_initializer(
    initializer: Callable,
    full_shape: Sequence[int],
    cache: dict,
    block: Callable[[tf.Tensor], tf.Tensor],
) -> Callable:
    """Makes an initializer for one partition's block of a larger variable.

    The first call draws the whole `full_shape` value once into `cache`; every call
    returns `block(value)`. Drawing the whole keeps the unpartitioned layer's
    distribution (fan-in and fan-out of the whole kernel) and, with a seeded
    initializer, its exact values, at the cost of one full-size tensor at build
    time; clear `cache` once all blocks are built.

    Args:
      initializer: a tf_keras or Keras 3 initializer, called as
        `initializer(shape, dtype)`.
      full_shape: shape of the unpartitioned variable.
      cache: a dict shared by the blocks of one variable; starts empty.
      block: maps the full value to this partition's block.

    Returns:
      A callable `(shape, dtype=None, **kwargs) -> tf.Tensor`; `shape` is ignored.
    """

    def init(shape, dtype=None, **kwargs):
        del shape, kwargs  # The block's shape follows from `block`.
        if "value" not in cache:
            cache["value"] = initializer(full_shape, dtype=dtype)
        return block(cache["value"])

    return init


class PartitionedWeights:
    """Mixin: a layer's kernel and bias split into per-partition blocks.

    After `build`, `block_kernels[k]` and (with `use_bias`) `block_biases[k]` are
    partition `k`'s variables, on `partition_devices[k]`, created in that order so
    that `trainable_weights` is `kernel_0, bias_0, kernel_1, ...`.

    The class that mixes it in is a Keras layer (tf_keras or Keras 3) and sets
    `_keras` to that Keras module (`tf_keras` or `keras`): activations and
    initializers are resolved and serialised by it. Its `__init__` calls
    `_init_partitioned` after the Keras `Layer.__init__`, and its `build` calls
    `_build_blocks` once the shapes that `_weight_layouts` and `_block_index` read
    are set. It implements:

    * `_weight_layouts()`: `(kernel, bias)` `WeightLayout`s;
    * `_block_index(k)`: the index of partition `k`'s block in each weight's
      `grid_shape` (the same index for the kernel and the bias).
    """

    _keras: Any = None  # `tf_keras` or `keras`: set by the layer class.
    # Whether `_on_device` passes the block weights to the partition's function
    # as tensors (Keras 3: under `stateless_call` a weight is a value handed
    # in, which `tf.custom_gradient` differentiates only as an argument) or
    # lets it read the variables (tf_keras: the gradient reaches a variable
    # `ShardedVariable` or not, through `tf.custom_gradient`'s `variables`).
    _weights_as_arguments = True

    def _init_partitioned(
        self,
        num_partitions: Any,
        devices: Sequence[str] | None,
        activation: Any,
        use_bias: bool,
        kernel_initializer: Any,
        bias_initializer: Any,
    ) -> None:
        """Stores the arguments every partitioned layer takes.

        Args:
          num_partitions: the layer's partition count or grid, as given.
          devices: a list of device names; `None` means
            `model_parallel.replica_devices()`. Partition `k` runs on
            `devices[k % len(devices)]`.
          activation: activation (a name or a function of the layer's Keras).
          use_bias: whether the layer adds a bias.
          kernel_initializer: initializer of the whole (unpartitioned) kernel.
          bias_initializer: initializer of the whole bias.

        Raises:
          ValueError: `devices` is not a list of device names or None (one
            string is refused: it is not a list of one).
        """
        if isinstance(devices, str) or not (
            devices is None or all(isinstance(d, str) for d in devices)
        ):
            raise checks.argument_error(
                "devices",
                "a list of device names, e.g. ['/device:CPU:0', '/device:CPU:1'], or "
                "None",
                devices,
            )
        self.num_partitions = num_partitions
        self.devices = None if devices is None else list(devices)
        self.activation = self._keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = self._keras.initializers.get(kernel_initializer)
        self.bias_initializer = self._keras.initializers.get(bias_initializer)

    def _weight_layouts(self) -> tuple[WeightLayout, WeightLayout]:
        """`(kernel, bias)` layouts; called once the layer knows its shapes."""
        raise NotImplementedError

    def _block_index(self, k: int) -> tuple[Any, ...]:
        """Index of partition `k`'s block in the kernel's and the bias's grid."""
        raise NotImplementedError

    def _cut(self, whole, layout: WeightLayout, k: int):
        """Partition `k`'s block of a whole weight (`whole_shape`), as its variable
        holds it: a `tf.Tensor` from a tensor (initial values), else a NumPy array."""
        reshape = tf.reshape if tf.is_tensor(whole) else np.reshape
        grid = reshape(whole, layout.grid_shape)
        return reshape(grid[self._block_index(k)], layout.block_shapes[k])

    def _build_blocks(self, num_blocks: int) -> None:
        """Creates the block variables, each under its partition's device.

        Args:
          num_blocks: number of partitions.

        Raises:
          ValueError: if `devices` names a device this process lacks
            (`model_parallel.assign_devices`).
        """
        self.partition_devices = model_parallel.assign_devices(num_blocks, self.devices)
        kernel, bias = self._weight_layouts()
        self.block_kernels, self.block_biases = [], []
        weights = [("kernel", kernel, self.kernel_initializer, self.block_kernels)]
        if self.use_bias:
            weights.append(("bias", bias, self.bias_initializer, self.block_biases))
        caches = [{} for _ in weights]
        for k, device in enumerate(self.partition_devices):
            with tf.device(device):
                for (name, layout, initializer, blocks), cache in zip(weights, caches):
                    cut = functools.partial(self._cut, layout=layout, k=k)
                    blocks.append(
                        self.add_weight(
                            name=f"{name}_{k}",
                            shape=layout.block_shapes[k],
                            initializer=sliced_initializer(
                                initializer, layout.whole_shape, cache, cut
                            ),
                        )
                    )
        for cache in caches:
            cache.clear()

    def _on_device(self, k: int, fn: Callable, *inputs) -> Any:
        """Calls `fn(kernel, bias, *inputs)` on partition `k`'s device.

        Forward and backward (`model_parallel.call_on_device`); `kernel` and
        `bias` are partition `k`'s (`bias` None without `use_bias`), as tensors
        or as the variables themselves (`_weights_as_arguments`).
        """
        device = self.partition_devices[k]
        kernel = self.block_kernels[k]
        bias = self.block_biases[k] if self.use_bias else None
        if not self._weights_as_arguments:
            return model_parallel.call_on_device(
                device, lambda *xs: fn(kernel, bias, *xs), *inputs
            )
        weights = [tf.convert_to_tensor(w) for w in (kernel, bias) if w is not None]

        def partition(*args):
            kernel, bias = args[0], args[1] if self.use_bias else None
            return fn(kernel, bias, *args[len(weights) :])

        return model_parallel.call_on_device(device, partition, *weights, *inputs)

    @staticmethod
    def _shape(dims: Sequence[int | None]) -> Any:
        """A shape as the layer's Keras wants it from `compute_output_shape`
        (tf_keras: a `tf.TensorShape`; the Keras 3 layers override it)."""
        return tf.TensorShape(dims)

    def _activation_name(self) -> Any:
        """The activation's serialised name (a string for a built-in one)."""
        return self._keras.activations.serialize(self.activation)

    def _blocks_by_weight(self) -> list[tuple[WeightLayout, list]]:
        """`(layout, blocks)` per weight, in the unpartitioned layer's order."""
        kernel, bias = self._weight_layouts()
        pairs = [(kernel, list(self.block_kernels))]
        if self.use_bias:
            pairs.append((bias, list(self.block_biases)))
        return pairs

    def unpartition(self, block_values: Sequence) -> list[np.ndarray]:
        """Assembles per-partition values into the unpartitioned layer's layout.

        Args:
          block_values: one array per variable, in `self.trainable_weights` order:
            the block weights themselves, or their gradients.

        Returns:
          `kernel` and, with `use_bias`, `bias`, shaped as the unpartitioned
          layer's `get_weights()` (see the layer class).
        """
        index = {id(v): i for i, v in enumerate(self.trainable_weights)}
        dtype = np.dtype(tf.as_dtype(self.block_kernels[0].dtype).as_numpy_dtype)
        weights = []
        for layout, blocks in self._blocks_by_weight():
            grid = np.zeros(layout.grid_shape, dtype)
            for k, block in enumerate(blocks):
                where = self._block_index(k)
                value = np.asarray(block_values[index[id(block)]])
                grid[where] = value.reshape(grid[where].shape)
            weights.append(grid.reshape(layout.whole_shape))
        return weights

    def get_unpartitioned_weights(self) -> list[np.ndarray]:
        """Returns the weights as the unpartitioned layer's `get_weights()` does.

        Returns:
          `[kernel, bias]` (see `unpartition`), or `[kernel]` without bias.
        """
        return self.unpartition([v.numpy() for v in self.trainable_weights])

    def set_unpartitioned_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Loads weights laid out as the unpartitioned layer's `get_weights()`.

        Args:
          weights: `[kernel, bias]`, or `[kernel]` without bias.

        Raises:
          ValueError: if the number or shapes of `weights` do not match.
        """
        pairs = self._blocks_by_weight()
        expected = [layout.whole_shape for layout, _ in pairs]
        got = [tuple(np.shape(w)) for w in weights]
        if got != expected:
            raise ValueError(
                f"Argument `weights` must have shapes {expected}. Received: {got}"
            )
        for (layout, blocks), whole in zip(pairs, weights):
            for k, block in enumerate(blocks):
                block.assign(self._cut(np.asarray(whole), layout, k))

    def _partitioned_config(self) -> dict[str, Any]:
        """The `get_config` entries of `_init_partitioned`'s arguments."""
        return dict(
            num_partitions=self.num_partitions,
            devices=None if self.devices is None else list(self.devices),
            activation=self._activation_name(),
            use_bias=self.use_bias,
            kernel_initializer=self._keras.initializers.serialize(
                self.kernel_initializer
            ),
            bias_initializer=self._keras.initializers.serialize(self.bias_initializer),
        )
