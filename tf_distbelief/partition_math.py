"""Partition arithmetic for model parallelism (Dean et al. 2012, section 3).

Pure functions of shapes: how a layer's units are split into partitions and how
many bytes of activations cross partition boundaries per forward pass. Only
activations on edges that cross a boundary travel, once per partition that reads
them; for a locally connected layer that is a thin halo, for a fully connected one
the whole input.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import tensorflow as tf

__all__ = [
    "dense_cross_partition_bytes",
    "dense_gather_bytes",
    "locally_connected_halo_bytes",
    "locally_connected_scatter_gather_bytes",
    "split_bounds",
]


def split_bounds(size: int, num_parts: int, name: str = "num_parts") -> list[int]:
    """Splits `range(size)` into `num_parts` contiguous, nearly equal parts.

    Like `np.array_split`: part sizes differ by at most one, larger parts first.
    For example 7 rows over 4 parts gives sizes `2, 2, 2, 1`.

    Args:
      size: number of items to split, at least 1.
      num_parts: number of parts, `1 <= num_parts <= size`.
      name: the caller's argument name, used in the error.

    Returns:
      `num_parts + 1` boundaries; part `i` is `range(bounds[i], bounds[i + 1])`.

    Raises:
      ValueError: if `num_parts` is below 1 or above `size`.
    """
    if not 1 <= num_parts <= size:
        raise ValueError(
            f"Argument `{name}` must be >= 1 and <= {size} (the size being split). "
            f"Received: {num_parts}"
        )
    base, extra = divmod(size, num_parts)
    sizes = [base + (1 if i < extra else 0) for i in range(num_parts)]
    return [0, *np.cumsum(sizes).tolist()]


def _owned_input_bounds(
    out_bounds: Sequence[int], stride: int, input_size: int
) -> list[int]:
    # A partition owns the input rows from its first output row's window start up to
    # the next partition's; the last one owns the rest. With `padding="valid"` a
    # window never starts before its output row times the stride, so the needed
    # rows only ever extend past the owned ones towards later partitions.
    return [b * stride for b in out_bounds[:-1]] + [input_size]


def _halo_elements_1d(out_bounds, stride, kernel, input_size):
    """Per part: (needed input length, owned input length) along one axis."""
    owned = _owned_input_bounds(out_bounds, stride, input_size)
    needed = [
        (out_bounds[i + 1] - 1) * stride + kernel - owned[i]
        for i in range(len(out_bounds) - 1)
    ]
    return needed, [owned[i + 1] - owned[i] for i in range(len(needed))]


def locally_connected_halo_bytes(
    input_shape: Sequence[int],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    partition_grid: Sequence[int],
    dtype: tf.dtypes.DType | str = tf.float32,
) -> int:
    """Bytes of halo one forward pass moves between spatial partitions.

    The output map of a `padding="valid"` locally connected layer is split into a
    `partition_grid[0] x partition_grid[1]` grid of blocks (`split_bounds` per
    axis). Each block owns the input region that starts at its first window and
    ends where the next block's begins. To compute its outputs it also needs the
    border ("halo") of the blocks below and to the right; those elements, counted
    once per block that reads them, are the only activations that cross partitions
    (Dean et al. 2012, section 3). The backward pass sends the same number of bytes
    back as halo gradients.

    Per block the halo is `batch * channels * (needed_rows * needed_cols -
    min(needed_rows, owned_rows) * min(needed_cols, owned_cols))`, where
    `needed_rows = last_output_row * stride + kernel - first_output_row * stride`.

    Args:
      input_shape: `[batch_size, rows, cols, channels]`.
      kernel_size: `[kernel_rows, kernel_cols]`.
      strides: `[stride_rows, stride_cols]`.
      partition_grid: `[row_blocks, col_blocks]`.
      dtype: element type of the activations.

    Returns:
      Bytes crossing partition boundaries in one forward pass.

    Raises:
      ValueError: if the grid does not fit the output map.
    """
    batch, rows, cols, channels = (int(d) for d in input_shape)
    out_rows = (rows - kernel_size[0]) // strides[0] + 1
    out_cols = (cols - kernel_size[1]) // strides[1] + 1
    need_r, own_r = _halo_elements_1d(
        split_bounds(out_rows, partition_grid[0], "partition_grid[0]"),
        strides[0],
        kernel_size[0],
        rows,
    )
    need_c, own_c = _halo_elements_1d(
        split_bounds(out_cols, partition_grid[1], "partition_grid[1]"),
        strides[1],
        kernel_size[1],
        cols,
    )
    elements = 0
    for nr, orow in zip(need_r, own_r):
        for nc, ocol in zip(need_c, own_c):
            # The needed region starts where the owned one does, so their overlap is
            # `min(needed, owned)` per axis (a block needs fewer rows than it owns
            # when it is the last one, or when the stride is longer than the kernel).
            elements += nr * nc - min(nr, orow) * min(nc, ocol)
    return elements * batch * channels * tf.as_dtype(dtype).size


def dense_cross_partition_bytes(
    batch_size: int,
    input_units: int,
    num_partitions: int,
    dtype: tf.dtypes.DType | str = tf.float32,
) -> int:
    """Bytes one forward pass of a column-partitioned dense layer moves.

    Every output unit reads every input unit, so each partition needs the whole
    input. Whether the input arrives split evenly over the partitions or whole on one
    of them, each partition reads the `(num_partitions - 1) / num_partitions` share
    it does not hold, `(num_partitions - 1) * batch_size * input_units` elements in
    all: why fully connected layers split worst (Dean et al. 2012, section 3). The
    backward pass moves as many bytes again (partial input gradients to be summed).

    Args:
      batch_size: examples per step.
      input_units: width of the input.
      num_partitions: partitions of the output units, at least 1.
      dtype: element type of the activations.

    Returns:
      Bytes crossing partition boundaries in one forward pass.

    Raises:
      ValueError: if `num_partitions` is below 1.
    """
    if num_partitions < 1:
        raise ValueError(
            f"Argument `num_partitions` must be >= 1. Received: {num_partitions}"
        )
    elements = (num_partitions - 1) * batch_size * input_units
    return elements * tf.as_dtype(dtype).size


def locally_connected_scatter_gather_bytes(
    input_shape: Sequence[int],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    partition_grid: Sequence[int],
    filters: int,
    dtype: tf.dtypes.DType | str = tf.float32,
) -> int:
    """Bytes a locally connected layer moves because it takes and gives tensors whole.

    `PartitionedLocallyConnected2D` receives its input whole, on one device, and
    concatenates its output there. With the input on block 0's device (the
    replica's default device), every other block receives the input region it owns
    (scatter) and sends its outputs back (gather). A DistBelief network whose
    layers all stay partitioned would move only the halo
    (`locally_connected_halo_bytes`); this is the extra. The backward pass moves as
    many bytes again.

    Args:
      input_shape: `[batch_size, rows, cols, channels]`.
      kernel_size: `[kernel_rows, kernel_cols]`.
      strides: `[stride_rows, stride_cols]`.
      partition_grid: `[row_blocks, col_blocks]`, one device per block.
      filters: output channels per position.
      dtype: element type of the activations.

    Returns:
      Scatter plus gather bytes of one forward pass.

    Raises:
      ValueError: if the grid does not fit the output map.
    """
    batch, rows, cols, channels = (int(d) for d in input_shape)
    out_rows = (rows - kernel_size[0]) // strides[0] + 1
    out_cols = (cols - kernel_size[1]) // strides[1] + 1
    row_bounds = split_bounds(out_rows, partition_grid[0], "partition_grid[0]")
    col_bounds = split_bounds(out_cols, partition_grid[1], "partition_grid[1]")
    own_rows = _owned_input_bounds(row_bounds, strides[0], rows)[1]
    own_cols = _owned_input_bounds(col_bounds, strides[1], cols)[1]
    scatter = (rows * cols - own_rows * own_cols) * channels
    gather = (out_rows * out_cols - row_bounds[1] * col_bounds[1]) * filters
    return (scatter + gather) * batch * tf.as_dtype(dtype).size


def dense_gather_bytes(
    batch_size: int,
    units: int,
    num_partitions: int,
    dtype: tf.dtypes.DType | str = tf.float32,
) -> int:
    """Bytes a column-partitioned dense layer moves to concatenate its output.

    `PartitionedDense` gives its output whole, on partition 0's device: the other
    partitions send their units there. Partitioned layers that fed each other
    directly would not need it (each partition would read the others' slices,
    counted by `dense_cross_partition_bytes`). The backward pass moves as many
    bytes again.

    Args:
      batch_size: examples per step.
      units: output width.
      num_partitions: partitions of the units (`split_bounds`), at least 1.
      dtype: element type of the activations.

    Returns:
      Bytes of the gather in one forward pass.

    Raises:
      ValueError: if `num_partitions` is out of range.
    """
    bounds = split_bounds(units, num_partitions, "num_partitions")
    return batch_size * (units - bounds[1]) * tf.as_dtype(dtype).size
