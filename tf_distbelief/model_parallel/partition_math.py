"""Partition arithmetic for model parallelism (Dean et al. 2012, section 3).

Pure functions of shapes: how a layer's units are split into partitions and how
many bytes of activations cross partition boundaries per forward pass. Only
activations on edges that cross a boundary travel, once per partition that reads
them; for a locally connected layer that is a thin halo, for a fully connected one
the whole input.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from tf_distbelief import checks

__all__ = [
    "block_reads",
    "dense_cross_partition_bytes",
    "dense_gather_bytes",
    "locally_connected_block_halo_bytes",
    "locally_connected_halo_bytes",
    "locally_connected_output_bounds",
    "locally_connected_scatter_gather_bytes",
    "owned_input_bounds",
    "read_input_indices",
    "split_bounds",
    "valid_output_size",
]


def _itemsize(dtype: Any) -> int:
    """Bytes of one element of `dtype`: a `tf.DType` (its `size`), a NumPy
    dtype or a name such as "float32"; no TensorFlow import needed."""
    size = getattr(dtype, "size", None)
    if isinstance(size, int):
        return size
    return np.dtype(dtype).itemsize


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
        raise checks.argument_error(
            name, f">= 1 and <= {size} (the size being split)", num_parts
        )
    base, extra = divmod(size, num_parts)
    sizes = [base + (1 if i < extra else 0) for i in range(num_parts)]
    return [0, *np.cumsum(sizes).tolist()]


def owned_input_bounds(
    out_bounds: Sequence[int], stride: int, input_size: int
) -> list[int]:
    """Where a whole input is cut so that each part owns a region of it, one axis.

    Part `i` owns the inputs from its first output's window start,
    `out_bounds[i] * stride`, up to the next part's; the last part owns the rest.
    With `padding="valid"` no window starts before its output times the stride, so
    the inputs a part reads beyond its own lie only towards later parts.

    Args:
      out_bounds: `split_bounds` of the outputs along the axis.
      stride: window step, at least 1.
      input_size: inputs along the axis.

    Returns:
      `len(out_bounds)` boundaries from 0 to `input_size`.
    """
    return [b * stride for b in out_bounds[:-1]] + [input_size]


def read_input_indices(
    first_output: int, end_output: int, stride: int, kernel: int
) -> list[int]:
    """Input indices the windows of outputs `first_output:end_output` read.

    Along one axis of a `padding="valid"` layer, output `r` reads inputs
    `r * stride` to `r * stride + kernel - 1`. With `stride <= kernel` the windows
    touch or overlap and the indices form one run; with a longer stride the inputs
    between windows are read by no one and left out. Either way `n` outputs read
    `(n - 1) * min(stride, kernel) + kernel` inputs.

    Args:
      first_output: first output index.
      end_output: one past the last output index, `> first_output`.
      stride: window step, at least 1.
      kernel: window size, at least 1.

    Returns:
      Sorted input indices, without duplicates.
    """
    if stride <= kernel:
        return list(range(first_output * stride, (end_output - 1) * stride + kernel))
    return [
        r * stride + d for r in range(first_output, end_output) for d in range(kernel)
    ]


def block_reads(
    out_bounds: Sequence[int],
    stride: int,
    kernel: int,
    in_bounds: Sequence[int],
) -> list[list[tuple[int, list[int]]]]:
    """Which inputs each part reads, by the input block that holds them, one axis.

    Part `i` makes outputs `out_bounds[i]:out_bounds[i + 1]` and reads
    `read_input_indices` of them; the input is held in blocks, block `b` holding
    inputs `in_bounds[b]:in_bounds[b + 1]`. Both the halo arithmetic and the
    layer that cuts the pieces use this, so that they agree on what crosses.

    Args:
      out_bounds: output boundaries of the parts.
      stride: window step, at least 1.
      kernel: window size, at least 1.
      in_bounds: input block boundaries, rising from 0 to the input size.

    Returns:
      Per part, `(block, indices)` for each block holding inputs it reads, in block
      order; `indices` are sorted and relative to the block's start.
    """
    reads = []
    for first, end in zip(out_bounds, out_bounds[1:]):
        read = read_input_indices(first, end, stride, kernel)
        pieces = []
        for b, (lo, hi) in enumerate(zip(in_bounds, in_bounds[1:])):
            local = [v - lo for v in read if lo <= v < hi]
            if local:
                pieces.append((b, local))
        reads.append(pieces)
    return reads


def valid_output_size(input_size: int, kernel: int, stride: int) -> int:
    """Outputs along one axis of a `padding="valid"` windowed layer.

    Args:
      input_size: inputs along the axis.
      kernel: window size, at least 1.
      stride: window step, at least 1.

    Returns:
      `(input_size - kernel) // stride + 1`; below 1 when the window does not fit.
    """
    return (input_size - kernel) // stride + 1


def locally_connected_output_bounds(
    input_shape: Sequence[int],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    partition_grid: Sequence[int],
) -> tuple[list[int], list[int]]:
    """Where a partitioned locally connected layer cuts its output map into blocks.

    Args:
      input_shape: `[batch_size, rows, cols, channels]` of the layer's input.
      kernel_size: `[kernel_rows, kernel_cols]`.
      strides: `[stride_rows, stride_cols]`.
      partition_grid: `[row_blocks, col_blocks]`.

    Returns:
      `(row_bounds, col_bounds)`: `split_bounds` of the output rows and columns;
      block `(i, j)` holds output rows `row_bounds[i]:row_bounds[i + 1]` and columns
      `col_bounds[j]:col_bounds[j + 1]`.

    Raises:
      ValueError: if the grid does not fit the output map.
    """
    out_rows = valid_output_size(int(input_shape[1]), kernel_size[0], strides[0])
    out_cols = valid_output_size(int(input_shape[2]), kernel_size[1], strides[1])
    return (
        split_bounds(out_rows, partition_grid[0], "partition_grid[0]"),
        split_bounds(out_cols, partition_grid[1], "partition_grid[1]"),
    )


def locally_connected_block_halo_bytes(
    input_shape: Sequence[int],
    input_bounds: tuple[Sequence[int], Sequence[int]],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    partition_grid: Sequence[int],
    dtype: Any = "float32",
) -> int:
    """Bytes one forward pass moves into a layer whose input arrives in blocks.

    The input map is held in a `partition_grid` of blocks, block `(i, j)` (rows
    `input_bounds[0][i]:input_bounds[0][i + 1]`, columns likewise) on the device
    of the layer's partition `(i, j)`: for example the output blocks of a previous
    partitioned layer with the same grid (`locally_connected_output_bounds`). Output
    block `(i, j)` reads the inputs its windows cover (`read_input_indices` of its
    rows times those of its columns); each of them outside the block the partition
    holds crosses, once, from the block that holds it. Nothing less can work, and
    the layer sends nothing more. Per output block, making `n` rows from
    `first_row` on:

        needed_rows = (n - 1) * min(stride, kernel) + kernel
        held_rows = number of read_input_indices(first_row, first_row + n,
                    stride, kernel) in [input_bounds[0][i], input_bounds[0][i + 1])

    (with `stride <= kernel` the read rows are one run from `first_row * stride`,
    and `held_rows` is its overlap with the held block), columns likewise; the
    block receives `needed_rows * needed_cols - held_rows * held_cols` elements of
    `batch * channels` values each. The read rows need not start where the held
    ones do: block boundaries of consecutive layers differ by kernel and stride
    offsets, so a partition may read rows of the block before its own, and hold
    rows only another partition reads. The backward pass sends as many bytes back
    (halo gradients).

    Args:
      input_shape: `[batch_size, rows, cols, channels]` of the whole input map.
      input_bounds: `(row_bounds, col_bounds)` of the input blocks,
        `partition_grid[0] + 1` and `partition_grid[1] + 1` boundaries from 0 to
        `rows` and `cols`.
      kernel_size: `[kernel_rows, kernel_cols]`.
      strides: `[stride_rows, stride_cols]`.
      partition_grid: `[row_blocks, col_blocks]`, of the output and of the input.
      dtype: element type of the activations.

    Returns:
      Bytes crossing partition boundaries in one forward pass.

    Raises:
      ValueError: if the grid does not fit the output map, or `input_bounds` do not
        split the input map into `partition_grid` blocks.
    """
    batch, rows, cols, channels = (int(d) for d in input_shape)
    for axis, (bounds, size) in enumerate(zip(input_bounds, (rows, cols))):
        bounds = list(bounds)
        if (
            len(bounds) != partition_grid[axis] + 1
            or bounds[0] != 0
            or bounds[-1] != size
            or any(a >= b for a, b in zip(bounds, bounds[1:]))
        ):
            raise ValueError(
                f"Argument `input_bounds[{axis}]` must rise from 0 to {size} in "
                f"{partition_grid[axis]} steps. Received: {bounds}"
            )
    out_rows, out_cols = locally_connected_output_bounds(
        input_shape, kernel_size, strides, partition_grid
    )
    row_reads = block_reads(out_rows, strides[0], kernel_size[0], input_bounds[0])
    col_reads = block_reads(out_cols, strides[1], kernel_size[1], input_bounds[1])
    # Output block (i, j) receives every piece it reads but that of block (i, j).
    elements = sum(
        len(piece_rows) * len(piece_cols)
        for i, row_pieces in enumerate(row_reads)
        for j, col_pieces in enumerate(col_reads)
        for i2, piece_rows in row_pieces
        for j2, piece_cols in col_pieces
        if (i2, j2) != (i, j)
    )
    return elements * batch * channels * _itemsize(dtype)


def locally_connected_halo_bytes(
    input_shape: Sequence[int],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    partition_grid: Sequence[int],
    dtype: Any = "float32",
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
    `needed_rows = (n - 1) * min(stride, kernel) + kernel` for `n` output rows
    counts the input rows its windows read: `locally_connected_block_halo_bytes`
    with the owned regions as input blocks. The read rows start where the owned ones
    do, so they overlap by `min(needed, owned)`; with a stride longer than the
    kernel a block owns all the rows it reads.

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
    row_bounds, col_bounds = locally_connected_output_bounds(
        input_shape, kernel_size, strides, partition_grid
    )
    owned = (
        owned_input_bounds(row_bounds, strides[0], int(input_shape[1])),
        owned_input_bounds(col_bounds, strides[1], int(input_shape[2])),
    )
    return locally_connected_block_halo_bytes(
        input_shape, owned, kernel_size, strides, partition_grid, dtype
    )


def dense_cross_partition_bytes(
    batch_size: int,
    input_units: int,
    num_partitions: int,
    dtype: Any = "float32",
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
        raise checks.argument_error("num_partitions", ">= 1", num_partitions)
    elements = (num_partitions - 1) * batch_size * input_units
    return elements * _itemsize(dtype)


def locally_connected_scatter_gather_bytes(
    input_shape: Sequence[int],
    kernel_size: Sequence[int],
    strides: Sequence[int],
    partition_grid: Sequence[int],
    filters: int,
    dtype: Any = "float32",
    *,
    input_whole: bool = True,
    output_whole: bool = True,
) -> int:
    """Bytes a locally connected layer moves because it takes or gives tensors whole.

    `PartitionedLocallyConnected2D` receives its input whole, on one device, unless
    it gets the blocks of a previous partitioned layer, and concatenates its output
    there, unless built with `output_blocks=True`. With the whole input on block 0's
    device (the replica's default device), every other block receives the input
    region it owns (scatter); a whole output is gathered on block 0's device from
    the others (gather). A DistBelief network whose layers all stay partitioned
    would move only the halo (`locally_connected_halo_bytes`,
    `locally_connected_block_halo_bytes`); this is the extra. The backward pass
    moves as many bytes again.

    Args:
      input_shape: `[batch_size, rows, cols, channels]`.
      kernel_size: `[kernel_rows, kernel_cols]`.
      strides: `[stride_rows, stride_cols]`.
      partition_grid: `[row_blocks, col_blocks]`, one device per block.
      filters: output channels per position.
      dtype: element type of the activations.
      input_whole: whether the input arrives whole (scattered); `False` when it
        arrives as blocks.
      output_whole: whether the output leaves whole (gathered); `False` with
        `output_blocks=True`.

    Returns:
      Scatter plus gather bytes of one forward pass.

    Raises:
      ValueError: if the grid does not fit the output map.
    """
    batch, rows, cols, channels = (int(d) for d in input_shape)
    row_bounds, col_bounds = locally_connected_output_bounds(
        input_shape, kernel_size, strides, partition_grid
    )
    own_rows = owned_input_bounds(row_bounds, strides[0], rows)[1]
    own_cols = owned_input_bounds(col_bounds, strides[1], cols)[1]
    scatter = (rows * cols - own_rows * own_cols) * channels
    gather = (row_bounds[-1] * col_bounds[-1] - row_bounds[1] * col_bounds[1]) * filters
    elements = scatter * input_whole + gather * output_whole
    return elements * batch * _itemsize(dtype)


def dense_gather_bytes(
    batch_size: int,
    units: int,
    num_partitions: int,
    dtype: Any = "float32",
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
    return batch_size * (units - bounds[1]) * _itemsize(dtype)
