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
lower = partitioned_locally_connected.PartitionedLocallyConnected2D(
    8, 3, num_partitions=4, output_blocks=True
)
upper = partitioned_locally_connected.PartitionedLocallyConnected2D(
    8, 3, num_partitions=4
)
blocks = lower(x)  # 4 tensors [2, rows, 7, 8] of 2, 2, 2 and 1 rows.
y = upper(blocks)  # [2, 5, 5, 8], as two stacked `LocallyConnected2D`.
# The upper blocks read rows 0-3, 2-4, 3-5, 4-6 and hold 0-1, 2-3, 4-5, 6: rows
# 2-3, 4, 3 and 4-5 cross, 6 rows * 7 cols * 8 channels * 2 examples * 4 B.
upper.cross_partition_bytes(batch_size=2)  # 2688
```
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief.model_parallel import devices as model_parallel
from tf_distbelief.model_parallel import partition_math

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


def _split_by_block(
    indices: Sequence[int], bounds: Sequence[int]
) -> list[tuple[int, slice | list[int]]]:
    """Splits sorted indices by the blocks `bounds` cuts their axis into.

    Returns:
      `(block, index)` for each block holding some of `indices`: a slice of the
      block when they form a run there, else a list of indices in the block.
    """
    pieces = []
    for b, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        local = [v - lo for v in indices if lo <= v < hi]
        if local:
            run = local[-1] - local[0] + 1 == len(local)
            pieces.append((b, slice(local[0], local[-1] + 1) if run else local))
    return pieces


def _take(x: tf.Tensor, rows: slice | list[int], cols: slice | list[int]):
    """`x[:, rows, cols]`; a list of indices is gathered."""
    for axis, index in ((1, rows), (2, cols)):
        if isinstance(index, slice):
            x = x[:, index] if axis == 1 else x[:, :, index]
        else:
            x = tf.gather(x, index, axis=axis)
    return x


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
          activation: `tf_keras` activation, applied per block.
          use_bias: whether to add a `[out_rows, out_cols, filters]` bias.
          kernel_initializer: initializer of the whole (unpartitioned) kernel.
          bias_initializer: initializer of the whole bias.
          output_blocks: if `True`, `call` returns the list of output blocks, each
            on its partition's device, for a next `PartitionedLocallyConnected2D`
            with the same `num_partitions` and `devices`; if `False` (the default,
            what other layers expect), the whole output map.
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

    def _whole_input_shape(self, input_shape):
        """The whole input map's shape, and the block bounds if given blocks.

        Args:
          input_shape: one shape of rank 4, or a list of block shapes.

        Returns:
          `(shape, bounds)`: a `tf.TensorShape`, and `None` for a whole input or
          `(row_bounds, col_bounds)` of the blocks.

        Raises:
          ValueError: if the shape is not of rank 4, or the blocks do not tile this
            layer's grid, or (once built) make another map than it was built for.
        """
        if (
            not isinstance(input_shape, (list, tuple))
            or not input_shape
            or not (isinstance(input_shape[0], (list, tuple, tf.TensorShape)))
        ):
            shape = tf.TensorShape(input_shape)
            if shape.rank != 4:
                raise ValueError(
                    "Argument `inputs` must have rank 4 ([batch, rows, cols, "
                    f"channels]) or be a list of blocks. Received shape: {shape}"
                )
            return shape, None
        n_rows, n_cols = self.partition_grid
        shapes = [tf.TensorShape(s) for s in input_shape]
        if len(shapes) != n_rows * n_cols:
            raise ValueError(
                f"Argument `inputs` must be one tensor or a list of {n_rows * n_cols} "
                f"blocks (the output of a `PartitionedLocallyConnected2D` with "
                f"`output_blocks=True` and `num_partitions={self.num_partitions!r}`)"
                f". Received: a list of {len(shapes)} blocks"
            )
        dims = [s.as_list() if s.rank == 4 else None for s in shapes]
        grid = [dims[i * n_cols : (i + 1) * n_cols] for i in range(n_rows)]
        tiles = (
            None not in dims
            and all(None not in d[1:] for d in dims)
            and len({(d[0], d[3]) for d in dims}) == 1
            and all(len({d[1] for d in row}) == 1 for row in grid)
            and all(len({row[j][2] for row in grid}) == 1 for j in range(n_cols))
        )
        if not tiles:
            raise ValueError(
                f"Argument `inputs` must be blocks of a {n_rows} x {n_cols} grid, "
                "row-major, of rank 4 with known rows, columns and channels: blocks "
                "in a grid row need equal rows, blocks in a grid column equal "
                "columns, all the same batch and channels (the output of a layer "
                f"with `num_partitions={self.num_partitions!r}`). Received block "
                f"shapes: {[str(s) for s in shapes]}"
            )
        row_bounds = [0, *np.cumsum([row[0][1] for row in grid]).tolist()]
        col_bounds = [0, *np.cumsum([d[2] for d in grid[0]]).tolist()]
        batch, channels = dims[0][0], dims[0][3]
        shape = tf.TensorShape([batch, row_bounds[-1], col_bounds[-1], channels])
        if self.built and shape[1:].as_list() != self._input_shape[1:].as_list():
            raise ValueError(
                "Argument `inputs` must be blocks that make up the input map this "
                f"layer was built for, {self._input_shape[1:]}. Received blocks "
                f"that make up {shape[1:]} (block shapes "
                f"{[str(s) for s in shapes]}); blocks of another `num_partitions` "
                "tile the map differently."
            )
        return shape, (tuple(row_bounds), tuple(col_bounds))

    def call(self, inputs):
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        n_rows, n_cols = self.partition_grid
        shape, bounds = self._whole_input_shape(
            [x.shape for x in inputs]
            if isinstance(inputs, (list, tuple))
            else inputs.shape
        )
        self.input_block_bounds = bounds
        if bounds is None:
            # Input a block owns: from its first window's start to the next block's.
            bounds = (
                [b * sr for b in self.row_bounds[:-1]] + [shape[1]],
                [b * sc for b in self.col_bounds[:-1]] + [shape[2]],
            )
            with tf.name_scope("scatter"):
                # Sliced where the input lives, so each device receives only its
                # block.
                blocks = [
                    inputs[:, r0:r1, c0:c1]
                    for r0, r1 in zip(bounds[0], bounds[0][1:])
                    for c0, c1 in zip(bounds[1], bounds[1][1:])
                ]
        else:
            blocks = list(inputs)
        # The input rows and columns each output block's windows read: from its
        # first window's start to its last window's end, less the inputs between
        # windows when the stride is longer than the kernel.
        read_r = [
            partition_math.read_input_indices(b, e, sr, kr)
            for b, e in zip(self.row_bounds, self.row_bounds[1:])
        ]
        read_c = [
            partition_math.read_input_indices(b, e, sc, kc)
            for b, e in zip(self.col_bounds, self.col_bounds[1:])
        ]
        # cuts[k2]: the (rows, cols) of input block `k2` that partitions read, and
        # readers[k2] which partitions, in partition order; a partition's pieces
        # come in row-major block order.
        cuts = [[] for _ in blocks]
        readers = [[] for _ in blocks]
        layouts = []
        for k in range(n_rows * n_cols):
            i, j = divmod(k, n_cols)
            rows = _split_by_block(read_r[i], bounds[0])
            cols = _split_by_block(read_c[j], bounds[1])
            layouts.append(len(cols))
            for i2, row_index in rows:
                for j2, col_index in cols:
                    cuts[i2 * n_cols + j2].append((row_index, col_index))
                    readers[i2 * n_cols + j2].append(k)
        pieces = [[] for _ in layouts]  # By reading partition.
        for k2, block in enumerate(blocks):
            if not cuts[k2]:
                # No window reads this block. Blocks of a layer with this grid
                # always hold some window's input; other tilings may not.
                continue
            # All pieces of a block in one call on its device, so that their
            # gradients are summed there. Named for what leaves the device: the
            # piece its own partition reads stays.
            with tf.name_scope(f"halo_{k2}"):
                cut = model_parallel.call_on_device(
                    self.partition_devices[k2],
                    lambda x, c=cuts[k2]: [_take(x, r, col) for r, col in c],
                    block,
                )
            for k, piece in zip(readers[k2], cut):
                pieces[k].append(piece)
        outputs = []
        for k, device in enumerate(self.partition_devices):
            with tf.name_scope(f"partition_{k}"):
                outputs.append(
                    model_parallel.call_on_device(
                        device,
                        functools.partial(self._block_outputs, k, layouts[k]),
                        *pieces[k],
                    )
                )
        if self.output_blocks:
            return outputs
        rows = [outputs[i * n_cols : (i + 1) * n_cols] for i in range(n_rows)]
        return tf.concat([tf.concat(row, axis=2) for row in rows], axis=1)

    def _block_outputs(self, k, pieces_per_row, *pieces):
        """Block `k`'s outputs from the pieces of input it reads, row-major."""
        rows = [
            tf.concat(pieces[r : r + pieces_per_row], axis=2)
            for r in range(0, len(pieces), pieces_per_row)
        ]
        x = tf.concat(rows, axis=1)
        # Only the inputs windows read arrived: with a stride longer than the kernel
        # the windows now lie side by side, a kernel apart.
        strides = [min(pair) for pair in zip(self.strides, self.kernel_size)]
        y = local_conv_valid(x, self.block_kernels[k], self.kernel_size, strides)
        if self.use_bias:
            y = y + self.block_biases[k]
        return self.activation(y)

    def compute_output_shape(self, input_shape):
        input_shape, _ = self._whole_input_shape(input_shape)
        (kr, kc), (sr, sc) = self.kernel_size, self.strides
        rows = (input_shape[1] - kr) // sr + 1
        cols = (input_shape[2] - kc) // sc + 1
        if not self.output_blocks:
            return tf.TensorShape([input_shape[0], rows, cols, self.filters])
        row_bounds = partition_math.split_bounds(rows, self.partition_grid[0])
        col_bounds = partition_math.split_bounds(cols, self.partition_grid[1])
        return [
            tf.TensorShape([input_shape[0], r1 - r0, c1 - c0, self.filters])
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
        shape = [batch_size, *self._input_shape[1:]]
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
            [batch_size, *self._input_shape[1:]],
            self.kernel_size,
            self.strides,
            self.partition_grid,
            self.filters,
            self.compute_dtype,
            input_whole=self.input_block_bounds is None,
            output_whole=not self.output_blocks,
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
            output_blocks=self.output_blocks,
        )
        return config
