"""The weights of a partitioned layer: one block per partition, on its device.

Dean et al. 2012, section 3: each partition of a model-parallel replica owns the
parameters of its units. `PartitionedLayer` holds what `PartitionedDense` and
`PartitionedLocallyConnected2D` share: a kernel block and a bias block per
partition, created under the partition's device and initialised as slices of one
whole draw, and the conversion of all blocks to and from the layout of the
unpartitioned `tf_keras` layer (`get_unpartitioned_weights`,
`set_unpartitioned_weights`, `unpartition` for gradients). A subclass says how its
weights split (`_weight_layouts`, `_block_index`) and computes its outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief.model_parallel import devices as model_parallel

__all__ = ["PartitionedLayer", "WeightLayout", "sliced_initializer"]


class WeightLayout(NamedTuple):
    """How one weight of the unpartitioned layer is cut into per-partition blocks.

    Attributes:
      whole_shape: the weight as the unpartitioned `tf_keras` layer holds it
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
      initializer: a `tf_keras` initializer, called as `initializer(shape, dtype)`.
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


class PartitionedLayer(tf_keras.layers.Layer):
    """A `tf_keras` layer whose kernel and bias are split into per-partition blocks.

    After `build`, `block_kernels[k]` and (with `use_bias`) `block_biases[k]` are
    partition `k`'s variables, on `partition_devices[k]`, created in that order so
    that `trainable_weights` is `kernel_0, bias_0, kernel_1, ...`.

    A subclass validates its own arguments, calls `__init__` with the shared ones,
    and in `build` calls `_build_blocks` once the shapes that `_weight_layouts`
    and `_block_index` read are set. It implements:

    * `_weight_layouts()`: `(kernel, bias)` `WeightLayout`s;
    * `_block_index(k)`: the index of partition `k`'s block in each weight's
      `grid_shape` (the same index for the kernel and the bias).
    """

    def __init__(
        self,
        num_partitions: Any,
        devices: Sequence[str] | None,
        activation: Any,
        use_bias: bool,
        kernel_initializer: Any,
        bias_initializer: Any,
        **kwargs,
    ):
        """Stores the arguments both partitioned layers take.

        Args:
          num_partitions: the subclass's partition count or grid, as given.
          devices: device names; `None` means `model_parallel.replica_devices()`.
            Partition `k` runs on `devices[k % len(devices)]`.
          activation: `tf_keras` activation.
          use_bias: whether the layer adds a bias.
          kernel_initializer: initializer of the whole (unpartitioned) kernel.
          bias_initializer: initializer of the whole bias.
          **kwargs: `tf_keras.layers.Layer` arguments (`name`, `dtype`, ...).
        """
        super().__init__(**kwargs)
        self.num_partitions = num_partitions
        self.devices = None if devices is None else list(devices)
        self.activation = tf_keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = tf_keras.initializers.get(kernel_initializer)
        self.bias_initializer = tf_keras.initializers.get(bias_initializer)

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
                            f"{name}_{k}",
                            shape=layout.block_shapes[k],
                            initializer=sliced_initializer(
                                initializer, layout.whole_shape, cache, cut
                            ),
                        )
                    )
        for cache in caches:
            cache.clear()

    def _blocks_by_weight(self) -> list[tuple[WeightLayout, list[tf.Variable]]]:
        """`(layout, blocks)` per weight, in the unpartitioned layer's order."""
        kernel, bias = self._weight_layouts()
        pairs = [(kernel, self.block_kernels)]
        if self.use_bias:
            pairs.append((bias, self.block_biases))
        return pairs

    def unpartition(self, block_values: Sequence) -> list[np.ndarray]:
        """Assembles per-partition values into the unpartitioned layer's layout.

        Args:
          block_values: one array per variable, in `self.trainable_weights` order:
            the block weights themselves, or their gradients.

        Returns:
          `kernel` and, with `use_bias`, `bias`, shaped as the unpartitioned
          `tf_keras` layer's `get_weights()` (see the subclass).
        """
        index = {id(v): i for i, v in enumerate(self.trainable_weights)}
        dtype = self.block_kernels[0].dtype.as_numpy_dtype
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

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            num_partitions=self.num_partitions,
            devices=self.devices,
            activation=tf_keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            kernel_initializer=tf_keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=tf_keras.initializers.serialize(self.bias_initializer),
        )
        return config
