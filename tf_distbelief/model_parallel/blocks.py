"""Activation maps held as a grid of blocks, one block on each partition's device.

Dean et al. 2012, section 3: a spatially partitioned layer computes each block of
its output from the input its windows read; only the halo, the part of that input
held by other partitions, needs to cross. `PartitionedLocallyConnected2D` takes
its input and gives its output either whole or as a row-major list of blocks; this
module holds the block plumbing:

* `whole_shape`: the map a list of blocks makes up, checked against the grid;
* `scatter` and `gather`: a whole map cut into blocks, and blocks joined again;
* `exchange_halo`: each block cut, on its device, into the pieces the partitions
  read (`partition_math.block_reads`), and the pieces handed to their readers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from tf_distbelief import checks
from tf_distbelief.model_parallel import devices as model_parallel

__all__ = ["exchange_halo", "gather", "scatter", "whole_shape"]


def _index(local: list[int]) -> slice | list[int]:
    """A slice for a run of indices (a strided slice is cheaper than a gather)."""
    if local[-1] - local[0] + 1 == len(local):
        return slice(local[0], local[-1] + 1)
    return local


def _take(x: tf.Tensor, rows: slice | list[int], cols: slice | list[int]):
    """`x[:, rows, cols]`; a list of indices is gathered."""
    for axis, index in ((1, rows), (2, cols)):
        if isinstance(index, slice):
            x = x[:, index] if axis == 1 else x[:, :, index]
        else:
            x = tf.gather(x, index, axis=axis)
    return x


def whole_shape(
    input_shape: Any,
    grid: tuple[int, int],
    num_partitions: Any,
    built_shape: tf.TensorShape | None = None,
) -> tuple[tf.TensorShape, tuple[tuple[int, ...], tuple[int, ...]] | None]:
    """The whole input map's shape, and the block bounds if given blocks.

    Args:
      input_shape: one shape of rank 4, `[batch, rows, cols, channels]`, or a
        list of `grid[0] * grid[1]` such block shapes, row-major.
      grid: `(row_blocks, col_blocks)` of the layer taking the input.
      num_partitions: that layer's `num_partitions`, as the errors name it.
      built_shape: the input shape that layer was built for, `None` if unbuilt.

    Returns:
      `(shape, bounds)`: a `tf.TensorShape`, and `None` for a whole input or
      `(row_bounds, col_bounds)` of the blocks in the map.

    Raises:
      ValueError: if the shape is not of rank 4, or the blocks do not tile `grid`,
        or make another map than `built_shape`.
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
    n_rows, n_cols = grid
    shapes = [tf.TensorShape(s) for s in input_shape]
    if len(shapes) != n_rows * n_cols:
        raise checks.argument_error(
            "inputs",
            f"one tensor or a list of {n_rows * n_cols} blocks (the output of a "
            "`PartitionedLocallyConnected2D` with `output_blocks=True` and "
            f"`num_partitions={num_partitions!r}`)",
            shapes,
            shown=f"a list of {len(shapes)} blocks",
        )
    dims = [s.as_list() if s.rank == 4 else None for s in shapes]
    rows = [dims[i * n_cols : (i + 1) * n_cols] for i in range(n_rows)]
    tiles = (
        None not in dims
        and all(None not in d[1:] for d in dims)
        and len({(d[0], d[3]) for d in dims}) == 1
        and all(len({d[1] for d in row}) == 1 for row in rows)
        and all(len({row[j][2] for row in rows}) == 1 for j in range(n_cols))
    )
    if not tiles:
        raise checks.argument_error(
            "inputs",
            f"blocks of a {n_rows} x {n_cols} grid, row-major, of rank 4 with "
            "known rows, columns and channels: blocks in a grid row need equal "
            "rows, blocks in a grid column equal columns, all the same batch and "
            "channels (the output of a layer with "
            f"`num_partitions={num_partitions!r}`)",
            [str(s) for s in shapes],
            what="block shapes",
        )
    row_bounds = [0, *np.cumsum([row[0][1] for row in rows]).tolist()]
    col_bounds = [0, *np.cumsum([d[2] for d in rows[0]]).tolist()]
    batch, channels = dims[0][0], dims[0][3]
    shape = tf.TensorShape([batch, row_bounds[-1], col_bounds[-1], channels])
    if built_shape is not None and shape[1:].as_list() != built_shape[1:].as_list():
        raise checks.argument_error(
            "inputs",
            "blocks that make up the input map this layer was built for, "
            f"{built_shape[1:]}",
            shapes,
            described=f"blocks that make up {shape[1:]} (block shapes "
            f"{[str(s) for s in shapes]}); blocks of another `num_partitions` "
            "tile the map differently.",
        )
    return shape, (tuple(row_bounds), tuple(col_bounds))


def scatter(
    inputs: tf.Tensor, bounds: tuple[Sequence[int], Sequence[int]]
) -> list[tf.Tensor]:
    """Cuts a whole map into blocks, row-major, where it lives.

    Sliced on the input's device, so that each partition receives only its block.

    Args:
      inputs: `[batch, rows, cols, channels]`.
      bounds: `(row_bounds, col_bounds)` of the blocks, from 0 to `rows` and
        `cols` (`partition_math.owned_input_bounds`).

    Returns:
      `(len(bounds[0]) - 1) * (len(bounds[1]) - 1)` tensors, block `(i, j)` at
      `i * (len(bounds[1]) - 1) + j`.
    """
    with tf.name_scope("scatter"):
        return [
            inputs[:, r0:r1, c0:c1]
            for r0, r1 in zip(bounds[0], bounds[0][1:])
            for c0, c1 in zip(bounds[1], bounds[1][1:])
        ]


def gather(blocks: Sequence[tf.Tensor], num_cols: int) -> tf.Tensor:
    """Joins row-major blocks of a grid `num_cols` blocks wide into one map.

    Args:
      blocks: `[batch, rows_i, cols_j, channels]` per block `(i, j)`, row-major.
      num_cols: blocks per grid row.

    Returns:
      `[batch, sum of rows_i, sum of cols_j, channels]`.
    """
    rows = [blocks[i : i + num_cols] for i in range(0, len(blocks), num_cols)]
    return tf.concat([tf.concat(row, axis=2) for row in rows], axis=1)


def exchange_halo(
    blocks: Sequence[tf.Tensor],
    devices: Sequence[str],
    row_reads: Sequence[Sequence[tuple[int, list[int]]]],
    col_reads: Sequence[Sequence[tuple[int, list[int]]]],
) -> tuple[list[list[tf.Tensor]], list[int]]:
    """Cuts the input blocks into the pieces the partitions read, where they live.

    Partition `k = i * len(col_reads) + j` reads, of input block
    `k2 = i2 * len(col_reads) + j2`, the rows `row_reads[i]` gives for `i2` and the
    columns `col_reads[j]` gives for `j2` (`partition_math.block_reads`). Each
    block is cut on its own partition's device, so that only the pieces other
    partitions read cross; in the backward pass their gradients are summed there.

    Args:
      blocks: the input blocks, row-major, block `k2` on `devices[k2]`.
      devices: device of each partition (and of its input block).
      row_reads: per row of the grid, `(input block row, indices)` it reads.
      col_reads: per column of the grid, `(input block column, indices)`.

    Returns:
      `(pieces, pieces_per_row)`: per partition, the pieces its windows read, in
      row-major block order, and how many pieces make one row of them.
    """
    n_cols = len(col_reads)
    # cuts[k2]: the (rows, cols) of input block `k2` that partitions read, and
    # readers[k2] which partitions, in partition order.
    cuts = [[] for _ in blocks]
    readers = [[] for _ in blocks]
    for k in range(len(devices)):
        i, j = divmod(k, n_cols)
        for i2, rows in row_reads[i]:
            for j2, cols in col_reads[j]:
                cuts[i2 * n_cols + j2].append((_index(rows), _index(cols)))
                readers[i2 * n_cols + j2].append(k)
    pieces = [[] for _ in devices]
    for k2, block in enumerate(blocks):
        if not cuts[k2]:
            # No window reads this block. Blocks of a layer with this grid always
            # hold some window's input; other tilings may not.
            continue
        # All pieces of a block in one call on its device, so that their gradients
        # are summed there. Named for what leaves the device: the piece its own
        # partition reads stays.
        with tf.name_scope(f"halo_{k2}"):
            cut = model_parallel.call_on_device(
                devices[k2],
                lambda x, c=cuts[k2]: [_take(x, r, col) for r, col in c],
                block,
            )
        for k, piece in zip(readers[k2], cut):
            pieces[k].append(piece)
    pieces_per_row = [len(col_reads[k % n_cols]) for k in range(len(devices))]
    return pieces, pieces_per_row
