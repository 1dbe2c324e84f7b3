"""A locally connected layer split spatially over devices: its computation.

Dean et al. 2012, section 3: locally connected networks split best, because a
spatial block of units reads only a thin border ("halo") of the layer below from
its neighbours. `LocallyConnectedPartitions` cuts the layer's output map into
blocks, one per device; each block's weights live on its device and only the halo
crosses. It is that layer without its Keras: `model_parallel.locally_connected`
mixes it into a tf_keras layer (with examples), `tf_distbelief.keras3.layers`
into a Keras 3 layer. `local_conv_valid` is the unshared-weight convolution each
block computes.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.model_parallel import base, partition_math
from tf_distbelief.model_parallel import blocks as blocks_lib

__all__ = ["LocallyConnectedPartitions", "local_conv_valid"]


def _pair(value: int | Sequence[int], name: str) -> tuple[int, int]:
    pair = (value, value) if checks.is_int(value) else tuple(value)
    if len(pair) != 2 or not all(checks.is_int(v) and v >= 1 for v in pair):
        raise checks.argument_error(
            name, "a positive int or a pair of positive ints", value
        )
    return tuple(int(v) for v in pair)


def _check_num_partitions(value: int, limit: int | None, what: str, name: str):
    bound = "" if limit is None else f" ({limit})"
    if not checks.is_int(value) or value < 1 or (limit and value > limit):
        raise checks.argument_error(name, f">= 1 and <= {what}{bound}", value)


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
    rows = partition_math.valid_output_size(inputs.shape[1], kr, sr)
    cols = partition_math.valid_output_size(inputs.shape[2], kc, sc)
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


class LocallyConnectedPartitions(base.PartitionedWeights):
    """Mixin: `LocallyConnected2D` split spatially over devices (section 3).

    The `[out_rows, out_cols]` output map is cut into a grid of blocks
    (`partition_math.split_bounds` per axis, so sizes need not divide evenly), one
    partition per block. Each block's kernel and bias are created under its device;
    the block's outputs are computed there from the input block it holds plus the
    halo it reads from the neighbouring blocks, sliced on their devices so that only
    the halo crosses. `cross_partition_bytes` gives the halo's size.

    Semantics equal `tf_keras.layers.LocallyConnected2D` with `padding="valid"`,
    `data_format="channels_last"` and `implementation=1` weights (see
    `get_unpartitioned_weights`).

    Input and output come in one of two layouts:

    * Whole: one `[batch, rows, cols, channels]` tensor. The input is cut where it
      lives into the regions the blocks own (from a block's first window to the
      next block's), which travel to their devices (scatter); the output is
      concatenated where TensorFlow places it (gather).
    * Blocks (`output_blocks=True` for the output): a list of `grid[0] * grid[1]`
      tensors, block `(i, j)` at index `i * grid[1] + j` on partition `(i, j)`'s
      device, holding output rows `row_bounds[i]:row_bounds[i + 1]` and columns
      likewise. A layer given such a list by a layer with the same grid and devices
      computes each block from the pieces of the input blocks its windows cover,
      each cut on the device that holds it: the input block boundaries differ from
      this layer's by kernel and stride offsets, so a partition may read rows of
      the block before its own as well as after, and its own block may hold rows
      only others read. The scatter and the gather go away; only the halo crosses
      (`partition_math.locally_connected_block_halo_bytes`).

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
        output_blocks: bool = False,
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
          activation: activation of the layer's Keras, applied per block.
          use_bias: whether to add a `[out_rows, out_cols, filters]` bias.
          kernel_initializer: initializer of the whole (unpartitioned) kernel.
          bias_initializer: initializer of the whole bias.
          output_blocks: if `True`, `call` returns the list of output blocks, each
            on its partition's device, for a next `PartitionedLocallyConnected2D`
            with the same `num_partitions` and `devices`; if `False` (the default,
            what other layers expect), the whole output map.
          **kwargs: the Keras `Layer`'s arguments (`name`, `dtype`, ...).

        Raises:
          ValueError: if an argument is out of range.
        """
        if not checks.is_int(filters) or filters < 1:
            raise checks.argument_error("filters", "an int >= 1", filters)
        filters = int(filters)
        kernel_size = _pair(kernel_size, "kernel_size")
        strides = _pair(strides, "strides")
        grid = (num_partitions, 1) if checks.is_int(num_partitions) else num_partitions
        grid = tuple(grid)
        if len(grid) != 2:
            raise checks.argument_error(
                "num_partitions", "an int or a pair of ints", num_partitions
            )
        _check_num_partitions(grid[0], None, "the output rows", "num_partitions")
        _check_num_partitions(grid[1], None, "the output columns", "num_partitions")
        grid = (int(grid[0]), int(grid[1]))
        num_partitions = grid[0] if checks.is_int(num_partitions) else grid
        super().__init__(**kwargs)
        self._init_partitioned(
            num_partitions,
            devices,
            activation,
            use_bias,
            kernel_initializer,
            bias_initializer,
        )
        self.filters = filters
        self.kernel_size = kernel_size
        self.strides = strides
        self.partition_grid = grid
        self.output_blocks = bool(output_blocks)
        # `(row_bounds, col_bounds)` of the input blocks of the latest call, `None`
        # when it took a whole tensor; `cross_partition_bytes` counts for it. No
        # `InputSpec`: a list of blocks is one input here, not several, and
        # `_whole_input_shape` checks ranks instead.
        self.input_block_bounds = None

    def build(self, input_shape):
        input_shape, _ = self._whole_input_shape(input_shape)
        _, in_rows, in_cols, channels = input_shape.as_list()
        if None in (in_rows, in_cols, channels):
            raise ValueError(
                "Argument `input_shape` must have known rows, columns and channels. "
                f"Received: {input_shape}"
            )
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        self.output_rows = partition_math.valid_output_size(in_rows, kr, sr)
        self.output_cols = partition_math.valid_output_size(in_cols, kc, sc)
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
        self._map_shape = input_shape
        self.row_bounds, self.col_bounds = (
            partition_math.locally_connected_output_bounds(
                input_shape, self.kernel_size, self.strides, self.partition_grid
            )
        )
        self._build_blocks(n_rows * n_cols)
        super().build(input_shape)

    def _weight_layouts(self) -> tuple[base.WeightLayout, base.WeightLayout]:
        # The kernel's positions are row-major `(out_row, out_col)`: as a grid
        # `[out_rows, out_cols, ...]` a block is one slice, as the bias is.
        grid = (self.output_rows, self.output_cols)
        features = (
            self.kernel_size[0] * self.kernel_size[1] * self._map_shape[3],
            self.filters,
        )
        n_blocks = self.partition_grid[0] * self.partition_grid[1]
        blocks = [
            (rows.stop - rows.start, cols.stop - cols.start)
            for rows, cols in map(self._block_index, range(n_blocks))
        ]
        bias = (*grid, self.filters)
        return (
            base.WeightLayout(
                (grid[0] * grid[1], *features),
                (*grid, *features),
                tuple((nr * nc, *features) for nr, nc in blocks),
            ),
            base.WeightLayout(
                bias, bias, tuple((nr, nc, self.filters) for nr, nc in blocks)
            ),
        )

    def _block_index(self, k: int) -> tuple[slice, slice]:
        i, j = divmod(k, self.partition_grid[1])
        rb, cb = self.row_bounds, self.col_bounds
        return slice(rb[i], rb[i + 1]), slice(cb[j], cb[j + 1])

    def _whole_input_shape(self, input_shape):
        """`blocks.whole_shape` for this layer's grid; once built, its map."""
        return blocks_lib.whole_shape(
            input_shape,
            self.partition_grid,
            self.num_partitions,
            self._map_shape if self.built else None,
        )

    def call(self, inputs):
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        shape, bounds = self._whole_input_shape(
            [x.shape for x in inputs]
            if isinstance(inputs, (list, tuple))
            else inputs.shape
        )
        self.input_block_bounds = bounds
        if bounds is None:
            bounds = (
                partition_math.owned_input_bounds(self.row_bounds, sr, shape[1]),
                partition_math.owned_input_bounds(self.col_bounds, sc, shape[2]),
            )
            blocks = blocks_lib.scatter(inputs, bounds)
        else:
            blocks = list(inputs)
        pieces, pieces_per_row = blocks_lib.exchange_halo(
            blocks,
            self.partition_devices,
            partition_math.block_reads(self.row_bounds, sr, kr, bounds[0]),
            partition_math.block_reads(self.col_bounds, sc, kc, bounds[1]),
        )
        outputs = []
        for k in range(len(self.partition_devices)):
            with tf.name_scope(f"partition_{k}"):
                outputs.append(
                    self._on_device(
                        k,
                        functools.partial(self._block_outputs, pieces_per_row[k]),
                        *pieces[k],
                    )
                )
        if self.output_blocks:
            return outputs
        return blocks_lib.gather(outputs, self.partition_grid[1])

    def _block_outputs(self, pieces_per_row, kernel, bias, *pieces):
        """A block's outputs from the pieces of input it reads, row-major, with
        its `kernel` and `bias` (None without `use_bias`)."""
        rows = [
            tf.concat(pieces[r : r + pieces_per_row], axis=2)
            for r in range(0, len(pieces), pieces_per_row)
        ]
        x = tf.concat(rows, axis=1)
        # Only the inputs windows read arrived: with a stride longer than the kernel
        # the windows now lie side by side, a kernel apart.
        strides = [min(pair) for pair in zip(self.strides, self.kernel_size)]
        y = local_conv_valid(x, kernel, self.kernel_size, strides)
        if bias is not None:
            y = y + bias
        return self.activation(y)

    def compute_output_shape(self, input_shape):
        input_shape, _ = self._whole_input_shape(input_shape)
        if not self.output_blocks:
            (kr, kc), (sr, sc) = self.kernel_size, self.strides
            rows = partition_math.valid_output_size(input_shape[1], kr, sr)
            cols = partition_math.valid_output_size(input_shape[2], kc, sc)
            return self._shape([input_shape[0], rows, cols, self.filters])
        row_bounds, col_bounds = partition_math.locally_connected_output_bounds(
            input_shape, self.kernel_size, self.strides, self.partition_grid
        )
        return [
            self._shape([input_shape[0], r1 - r0, c1 - c0, self.filters])
            for r0, r1 in zip(row_bounds, row_bounds[1:])
            for c0, c1 in zip(col_bounds, col_bounds[1:])
        ]

    def cross_partition_bytes(self, batch_size: int) -> int:
        """Halo bytes one forward pass moves between blocks (backward: as many).

        For the input layout of the latest call (see `input_block_bounds`): whole,
        the halo between the owned input regions; as blocks, what crosses from the
        previous layer's blocks.

        Args:
          batch_size: examples per step.

        Returns:
          `partition_math.locally_connected_halo_bytes` for a whole input,
          `partition_math.locally_connected_block_halo_bytes` for blocks.
        """
        shape = [batch_size, *self._map_shape[1:]]
        args = (self.kernel_size, self.strides, self.partition_grid)
        if self.input_block_bounds is None:
            return partition_math.locally_connected_halo_bytes(
                shape, *args, self.compute_dtype
            )
        return partition_math.locally_connected_block_halo_bytes(
            shape, self.input_block_bounds, *args, self.compute_dtype
        )

    def scatter_gather_bytes(self, batch_size: int) -> int:
        """Bytes one forward pass moves to cut up a whole input and join the output.

        The scatter counts if the latest call took a whole tensor, the gather unless
        `output_blocks`; between stacked layers in block mode neither happens.

        Args:
          batch_size: examples per step.

        Returns:
          `partition_math.locally_connected_scatter_gather_bytes` for this layer.
        """
        return partition_math.locally_connected_scatter_gather_bytes(
            [batch_size, *self._map_shape[1:]],
            self.kernel_size,
            self.strides,
            self.partition_grid,
            self.filters,
            self.compute_dtype,
            input_whole=self.input_block_bounds is None,
            output_whole=not self.output_blocks,
        )

    def get_config(self):
        config = super().get_config()
        config.update(
            self._partitioned_config(),
            filters=self.filters,
            kernel_size=self.kernel_size,
            strides=self.strides,
            output_blocks=self.output_blocks,
        )
        return config
