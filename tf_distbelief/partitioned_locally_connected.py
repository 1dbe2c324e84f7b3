"""A locally connected layer split spatially over devices.

Dean et al. 2012, section 3: locally connected networks split best, because a
spatial block of units reads only a thin border ("halo") of the layer below from
its neighbours. `PartitionedLocallyConnected2D` cuts its output map into blocks, one
per device; each block's weights live on its device and only the halo crosses.

It computes exactly what `tf_keras.layers.LocallyConnected2D` computes, and takes
and gives weights in the same layout, so weights can be copied between them:

```python
import tensorflow as tf
import tf_keras
from tf_distbelief import model_parallel, partitioned_locally_connected

model_parallel.configure_logical_cpus(4)  # Before TensorFlow initialises.
reference = tf_keras.layers.LocallyConnected2D(8, 3)
layer = partitioned_locally_connected.PartitionedLocallyConnected2D(
    8, 3, num_partitions=4
)  # 7 output rows: blocks of 2, 2, 2 and 1.
x = tf.random.normal([2, 9, 9, 3])
reference(x), layer(x)
layer.set_unpartitioned_weights(reference.get_weights())
# 3 blocks read 2 halo rows: 3 * 2 rows * 9 cols * 3 channels * 2 examples * 4 B.
layer.cross_partition_bytes(batch_size=2)  # 1296
```
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief import model_parallel, partition_math

__all__ = ["PartitionedLocallyConnected2D", "local_conv_valid"]


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v >= 1 for v in pair):
        raise ValueError(
            f"Argument `{name}` must be a positive int or a pair of positive ints. "
            f"Received: {value!r}"
        )
    return pair


def _check_num_partitions(value: int, limit: int | None, what: str, name: str):
    bound = "" if limit is None else f" ({limit})"
    if not isinstance(value, int) or value < 1 or (limit and value > limit):
        raise ValueError(
            f"Argument `{name}` must be >= 1 and <= {what}{bound}. Received: {value!r}"
        )


def local_conv_valid(
    inputs: tf.Tensor,
    kernel: tf.Tensor,
    kernel_size: tuple[int, int],
    strides: tuple[int, int],
) -> tf.Tensor:
    """Locally connected (unshared-weight) convolution with `padding="valid"`.

    `y[b, r, c, o] = sum_f patch(x)[b, r, c, f] * kernel[r * cols + c, f, o]`, where
    a patch is flattened in `(kernel_row, kernel_col, channel)` order, as in
    `tf_keras.layers.LocallyConnected2D(implementation=1)`.

    Args:
      inputs: `[batch_size, in_rows, in_cols, channels]`.
      kernel: `[out_rows * out_cols, kernel_rows * kernel_cols * channels, filters]`.
      kernel_size: `(kernel_rows, kernel_cols)`.
      strides: `(stride_rows, stride_cols)`.

    Returns:
      `[batch_size, out_rows, out_cols, filters]`.
    """
    (kr, kc), (sr, sc) = kernel_size, strides
    rows = (inputs.shape[1] - kr) // sr + 1
    cols = (inputs.shape[2] - kc) // sc + 1
    # One strided slice per kernel offset: cheaper to differentiate than
    # `tf.image.extract_patches`, whose gradient is a scatter.
    taps = [
        inputs[:, i : i + (rows - 1) * sr + 1 : sr, j : j + (cols - 1) * sc + 1 : sc]
        for i in range(kr)
        for j in range(kc)
    ]
    patches = tf.stack(taps, axis=3)  # [batch, rows, cols, kr * kc, channels]
    patches = tf.reshape(patches, [-1, rows * cols, kernel.shape[1]])
    outputs = tf.einsum("bpf,pfo->bpo", patches, kernel)
    return tf.reshape(outputs, [-1, rows, cols, kernel.shape[2]])


class PartitionedLocallyConnected2D(tf_keras.layers.Layer):
    """`LocallyConnected2D` split spatially over devices (Dean et al. 2012, sec. 3).

    The `[out_rows, out_cols]` output map is cut into a grid of blocks
    (`partition_math.split_bounds` per axis, so sizes need not divide evenly), one
    partition per block. Each block's kernel and bias are created under its device;
    the block's outputs are computed there from the input region it owns plus the
    halo it reads from the blocks below and to its right, sliced on their devices
    so that only the halo crosses. `cross_partition_bytes` gives the halo's size.

    Semantics equal `tf_keras.layers.LocallyConnected2D` with `padding="valid"`,
    `data_format="channels_last"` and `implementation=1` weights (see
    `get_unpartitioned_weights`). The layer's input arrives whole and its output
    leaves whole (concatenated where TensorFlow places it); only the exchange
    between blocks is counted as cross-partition traffic.

    Example: `PartitionedLocallyConnected2D(16, 3, num_partitions=(2, 2))` on a
    `[batch, 34, 34, 3]` input gives four `16 x 16` output blocks.
    """

    def __init__(
        self,
        filters: int,
        kernel_size: int | Sequence[int],
        strides: int | Sequence[int] = 1,
        num_partitions: int | Sequence[int] = 1,
        devices: Sequence[str] | None = None,
        activation=None,
        use_bias: bool = True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        """Creates the layer; weights are made in `build`.

        Args:
          filters: output channels per position.
          kernel_size: window `(rows, cols)`, or one int for both.
          strides: window step `(rows, cols)`, or one int for both.
          num_partitions: an int `n` splits the output rows into `n` blocks; a pair
            `(n_rows, n_cols)` splits rows and columns into a grid, partitions
            numbered row-major.
          devices: device names; `None` means `model_parallel.replica_devices()`.
            Partition `k` runs on `devices[k % len(devices)]`.
          activation: `tf_keras` activation, applied per block.
          use_bias: whether to add a `[out_rows, out_cols, filters]` bias.
          kernel_initializer: initializer of the whole (unpartitioned) kernel.
          bias_initializer: initializer of the whole bias.
          **kwargs: `tf_keras.layers.Layer` arguments (`name`, `dtype`, ...).

        Raises:
          ValueError: if an argument is out of range.
        """
        super().__init__(**kwargs)
        if not isinstance(filters, int) or filters < 1:
            raise ValueError(f"Argument `filters` must be >= 1. Received: {filters!r}")
        self.filters = filters
        self.kernel_size = _pair(kernel_size, "kernel_size")
        self.strides = _pair(strides, "strides")
        grid = (
            (num_partitions, 1) if isinstance(num_partitions, int) else num_partitions
        )
        grid = tuple(grid)
        if len(grid) != 2:
            raise ValueError(
                "Argument `num_partitions` must be an int or a pair of ints. "
                f"Received: {num_partitions!r}"
            )
        _check_num_partitions(grid[0], None, "the output rows", "num_partitions")
        _check_num_partitions(grid[1], None, "the output columns", "num_partitions")
        self.num_partitions = num_partitions
        self.partition_grid = grid
        self.devices = None if devices is None else list(devices)
        self.activation = tf_keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = tf_keras.initializers.get(kernel_initializer)
        self.bias_initializer = tf_keras.initializers.get(bias_initializer)
        self.input_spec = tf_keras.layers.InputSpec(ndim=4)

    def build(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        _, in_rows, in_cols, channels = input_shape.as_list()
        if None in (in_rows, in_cols, channels):
            raise ValueError(
                "Argument `input_shape` must have known rows, columns and channels. "
                f"Received: {input_shape}"
            )
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        self.output_rows = (in_rows - kr) // sr + 1
        self.output_cols = (in_cols - kc) // sc + 1
        if self.output_rows < 1 or self.output_cols < 1:
            raise ValueError(
                f"Argument `kernel_size` {self.kernel_size} is larger than the input "
                f"map {(in_rows, in_cols)}; the output would be empty."
            )
        n_rows, n_cols = self.partition_grid
        _check_num_partitions(
            n_rows, self.output_rows, "the output rows", "num_partitions"
        )
        _check_num_partitions(
            n_cols, self.output_cols, "the output columns", "num_partitions"
        )
        self._input_shape = input_shape
        self.row_bounds = partition_math.split_bounds(self.output_rows, n_rows)
        self.col_bounds = partition_math.split_bounds(self.output_cols, n_cols)
        self.partition_devices = model_parallel.assign_devices(
            n_rows * n_cols, self.devices
        )
        feature_dim = kr * kc * channels
        full_kernel = (self.output_rows * self.output_cols, feature_dim, self.filters)
        full_bias = (self.output_rows, self.output_cols, self.filters)
        kernel_cache, bias_cache = {}, {}
        self.block_kernels, self.block_biases = [], []
        for k, device in enumerate(self.partition_devices):
            rows, cols = self._block_slices(k)
            nr, nc = rows.stop - rows.start, cols.stop - cols.start

            def kernel_block(full, rows=rows, cols=cols, nr=nr, nc=nc):
                full = tf.reshape(full, full_bias[:2] + full_kernel[1:])
                return tf.reshape(full[rows, cols], [nr * nc, *full_kernel[1:]])

            with tf.device(device):
                self.block_kernels.append(
                    self.add_weight(
                        f"kernel_{k}",
                        shape=(nr * nc, feature_dim, self.filters),
                        initializer=model_parallel.sliced_initializer(
                            self.kernel_initializer,
                            full_kernel,
                            kernel_cache,
                            kernel_block,
                        ),
                    )
                )
                if self.use_bias:
                    self.block_biases.append(
                        self.add_weight(
                            f"bias_{k}",
                            shape=(nr, nc, self.filters),
                            initializer=model_parallel.sliced_initializer(
                                self.bias_initializer,
                                full_bias,
                                bias_cache,
                                lambda full, rows=rows, cols=cols: full[rows, cols],
                            ),
                        )
                    )
        kernel_cache.clear()
        bias_cache.clear()
        super().build(input_shape)

    def _block_slices(self, k: int) -> tuple[slice, slice]:
        i, j = divmod(k, self.partition_grid[1])
        rb, cb = self.row_bounds, self.col_bounds
        return slice(rb[i], rb[i + 1]), slice(cb[j], cb[j + 1])

    def call(self, inputs):
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        n_rows, n_cols = self.partition_grid
        # Input a block owns: from its first window's start to the next block's.
        own_r = [b * sr for b in self.row_bounds[:-1]] + [inputs.shape[1]]
        own_c = [b * sc for b in self.col_bounds[:-1]] + [inputs.shape[2]]
        # End (exclusive) of the input a block needs: its last window's end.
        need_r = [(b - 1) * sr + kr for b in self.row_bounds[1:]]
        need_c = [(b - 1) * sc + kc for b in self.col_bounds[1:]]
        with tf.name_scope("scatter"):
            # Sliced where the input lives, so each device receives only its block.
            owned = [
                [
                    inputs[:, own_r[i] : own_r[i + 1], own_c[j] : own_c[j + 1]]
                    for j in range(n_cols)
                ]
                for i in range(n_rows)
            ]
        outputs = []
        for i in range(n_rows):
            row_outputs = []
            for j in range(n_cols):
                k = i * n_cols + j
                # The needed input as rows of pieces, one row per block row it
                # overlaps; pieces of other blocks are cut on their devices so that
                # only the halo travels.
                pieces = []
                for i2 in range(i, n_rows):
                    rows = min(own_r[i2 + 1], need_r[i]) - own_r[i2]
                    if rows <= 0:
                        break
                    pieces.append([])
                    for j2 in range(j, n_cols):
                        cols = min(own_c[j2 + 1], need_c[j]) - own_c[j2]
                        if cols <= 0:
                            break
                        k2 = i2 * n_cols + j2
                        if k2 == k:
                            pieces[-1].append((rows, cols))  # Cut below, on `k`.
                            continue
                        with tf.name_scope(f"halo_{k2}_to_{k}"):
                            pieces[-1].append(
                                model_parallel.call_on_device(
                                    self.partition_devices[k2],
                                    lambda x, r=rows, c=cols: x[:, :r, :c],
                                    owned[i2][j2],
                                )
                            )
                with tf.name_scope(f"partition_{k}"):
                    row_outputs.append(
                        model_parallel.call_on_device(
                            self.partition_devices[k],
                            functools.partial(self._block_outputs, k, pieces),
                            owned[i][j],
                            *[p for row in pieces for p in row if tf.is_tensor(p)],
                        )
                    )
            outputs.append(tf.concat(row_outputs, axis=2))
        return tf.concat(outputs, axis=1)

    def _block_outputs(self, k, pieces, own, *halo):
        """Block `k`'s outputs from its own input and its halo pieces, in order."""
        rows, cols = pieces[0][0]
        halo = iter(halo)
        pieces = [
            [own[:, :rows, :cols] if j == i == 0 else next(halo) for j in range(len(r))]
            for i, r in enumerate(pieces)
        ]
        x = tf.concat([tf.concat(row, axis=2) for row in pieces], axis=1)
        y = local_conv_valid(x, self.block_kernels[k], self.kernel_size, self.strides)
        if self.use_bias:
            y = y + self.block_biases[k]
        return self.activation(y)

    def compute_output_shape(self, input_shape):
        input_shape = tf.TensorShape(input_shape)
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        rows = (input_shape[1] - kr) // sr + 1
        cols = (input_shape[2] - kc) // sc + 1
        return tf.TensorShape([input_shape[0], rows, cols, self.filters])

    def cross_partition_bytes(self, batch_size: int) -> int:
        """Halo bytes one forward pass moves between blocks (backward: as many).

        Args:
          batch_size: examples per step.

        Returns:
          `partition_math.locally_connected_halo_bytes` for this layer's shapes.
        """
        shape = [batch_size, *self._input_shape[1:]]
        return partition_math.locally_connected_halo_bytes(
            shape,
            self.kernel_size,
            self.strides,
            self.partition_grid,
            self.compute_dtype,
        )

    def unpartition(self, block_values: Sequence) -> list[np.ndarray]:
        """Assembles per-block values into the `LocallyConnected2D` layout.

        Args:
          block_values: one array per variable, in `self.trainable_weights` order:
            the block weights themselves, or their gradients.

        Returns:
          `kernel` `[out_rows * out_cols, kernel_rows * kernel_cols * channels,
          filters]` and, with `use_bias`, `bias` `[out_rows, out_cols, filters]`.
        """
        index = {id(v): i for i, v in enumerate(self.trainable_weights)}
        shape = (self.output_rows, self.output_cols)
        dtype = self.block_kernels[0].dtype.as_numpy_dtype
        kernel = np.zeros(shape + tuple(self.block_kernels[0].shape[1:]), dtype)
        bias = np.zeros(shape + (self.filters,), kernel.dtype)
        for k, block in enumerate(self.block_kernels):
            rows, cols = self._block_slices(k)
            value = np.asarray(block_values[index[id(block)]])
            kernel[rows, cols] = value.reshape(kernel[rows, cols].shape)
            if self.use_bias:
                bias[rows, cols] = block_values[index[id(self.block_biases[k])]]
        kernel = kernel.reshape((-1,) + kernel.shape[2:])
        return [kernel, bias] if self.use_bias else [kernel]

    def get_unpartitioned_weights(self) -> list[np.ndarray]:
        """Returns the weights as `LocallyConnected2D.get_weights()` lays them out.

        Returns:
          `[kernel, bias]` (see `unpartition`), or `[kernel]` without bias.
        """
        return self.unpartition([v.numpy() for v in self.trainable_weights])

    def set_unpartitioned_weights(self, weights: Sequence[np.ndarray]) -> None:
        """Loads weights laid out as `LocallyConnected2D` (implementation 1).

        Args:
          weights: `[kernel, bias]` (or `[kernel]` without bias) as returned by
            `tf_keras.layers.LocallyConnected2D.get_weights()`.

        Raises:
          ValueError: if the number or shapes of `weights` do not match.
        """
        expected = [w.shape for w in self.get_unpartitioned_weights()]
        got = [np.shape(w) for w in weights]
        if got != expected:
            raise ValueError(
                f"Argument `weights` must have shapes {expected}. Received: {got}"
            )
        kernel = np.reshape(
            weights[0], (self.output_rows, self.output_cols, -1, self.filters)
        )
        for k, block in enumerate(self.block_kernels):
            rows, cols = self._block_slices(k)
            block.assign(kernel[rows, cols].reshape(block.shape))
            if self.use_bias:
                self.block_biases[k].assign(weights[1][rows, cols])

    def get_config(self):
        config = super().get_config()
        config.update(
            filters=self.filters,
            kernel_size=self.kernel_size,
            strides=self.strides,
            num_partitions=self.num_partitions,
            devices=self.devices,
            activation=tf_keras.activations.serialize(self.activation),
            use_bias=self.use_bias,
            kernel_initializer=tf_keras.initializers.serialize(self.kernel_initializer),
            bias_initializer=tf_keras.initializers.serialize(self.bias_initializer),
        )
        return config
