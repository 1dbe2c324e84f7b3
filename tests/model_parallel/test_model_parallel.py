"""Tests of model parallelism (Dean et al. 2012, section 3).

Quick tests run in the pytest process on `CPU:0` alone (every partition on the same
device): arithmetic, errors, and equality with the unpartitioned layers, alone and
stacked (`PartitionedLocallyConnected2D` layers passing blocks, against
`LocallyConnected2D` layers passing whole maps). The layer tests run for both
flavours, the tf_keras layers (`tf_distbelief.model_parallel`) and the Keras 3 ones
(`tf_distbelief.keras3.layers`): a partitioned dense layer against its own Keras's
`Dense`, a partitioned locally connected one against tf_keras's
`LocallyConnected2D` (Keras 3 has none).

Several devices must be configured before TensorFlow initialises, and the pytest
process is shared with other test modules, so `TestFourDevices` runs this file as a
script in a child process. The child makes 4 logical CPU devices, runs the checks and
prints one JSON report, on which the tests assert. Placement is read from the
partition graphs TensorFlow actually executed (`RunMetadata`), which show where each
op ran, so ops silently moved to `CPU:0` are caught.
"""

import json
import os
import re
import subprocess
import sys
from typing import Any, NamedTuple

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.launch import ROOT
from tf_distbelief import cluster
from tf_distbelief.keras3 import layers as keras3_layers
from tf_distbelief.model_parallel import dense as partitioned_dense
from tf_distbelief.model_parallel import devices as model_parallel
from tf_distbelief.model_parallel import locally_connected as plc
from tf_distbelief.model_parallel import partition_math

_TOLERANCE = 1e-5


class _Flavour(NamedTuple):
    """The partitioned layers of one Keras, and that Keras."""

    keras: Any  # `tf_keras` or `keras`.
    dense: type
    lc: type


_FLAVOURS = {
    "tf_keras": _Flavour(
        tf_keras, partitioned_dense.PartitionedDense, plc.PartitionedLocallyConnected2D
    ),
    "keras3": _Flavour(
        keras,
        keras3_layers.PartitionedDense,
        keras3_layers.PartitionedLocallyConnected2D,
    ),
}
flavours = pytest.mark.parametrize("flavour", _FLAVOURS.keys())
_NUM_DEVICES = 4
_CHILD_TIMEOUT_SECS = 180

# (input_shape, kernel_size, strides, num_partitions); shapes chosen so that sizes
# do not divide evenly.
_LC_CASES = {
    "7_rows_1_part": ([2, 9, 8, 3], 3, 1, 1),
    "7_rows_2_parts": ([2, 9, 8, 3], 3, 1, 2),  # Blocks of 4 and 3 rows.
    "7_rows_4_parts": ([2, 9, 8, 3], 3, 1, 4),  # 2, 2, 2, 1.
    "grid_2x2_strided": ([2, 10, 9, 2], (3, 2), (2, 1), (2, 2)),  # 4 x 8 outputs.
    "stride_over_kernel": ([3, 11, 7, 2], (2, 3), (3, 2), 4),  # No halo rows.
    "halo_spans_2_blocks": ([1, 12, 12, 1], 5, 1, 4),  # 2-row blocks, 4-row halo.
    # Rows skipped between windows; the column halo carries only the rows read.
    "stride_over_kernel_grid": ([2, 11, 10, 2], (2, 3), (3, 2), (2, 2)),
}
# (input_shape, ((kernel_size, strides) per layer), num_partitions): layers stacked
# in block mode (`output_blocks=True` but the last). The block boundaries of one
# layer's output and of the next layer's needed input differ, so halo pieces come
# from blocks before a partition's own as well as after.
_STACKED_LC_CASES = {
    "1_part": ([2, 9, 8, 3], ((3, 1), (3, 1)), 1),
    # 11 rows in blocks 6|5; the next layer's 9 rows in 5|4 read rows 0-6 and 5-10.
    "2_parts_uneven": ([2, 13, 8, 3], ((3, 1), (3, 1)), 2),
    # 11 rows in 3|3|3|2; the next layer's 5 rows (stride 2) in 2|1|1|1.
    "4_parts_strided": ([2, 13, 9, 2], (((3, 2), 1), (3, (2, 1))), 4),
    # 9 x 10 in 5|4 x 5|5; the next layer reads rows 0-4|4-8, columns 0-4|4-8.
    "grid_2x2_strided": ([2, 11, 12, 2], ((3, 1), ((2, 3), (1, 2))), (2, 2)),
    # 16 rows in 4s; stride 3 reads rows 0-3, 6-9, 12, 15: partition 2 reads only
    # block 3, and its own block 2 goes to partition 1.
    "own_block_unread": ([1, 18, 5, 2], ((3, 1), (1, 3)), 4),
    # The middle layer takes blocks and gives blocks.
    "3_layers_4_parts": ([2, 14, 6, 2], ((3, 1), (3, 1), (2, 1)), 4),
}
# (units, num_partitions, activation).
_DENSE_CASES = {
    "10_units_1_part": (10, 1, None),
    "10_units_2_parts": (10, 2, "sigmoid"),
    "10_units_4_parts": (10, 4, "softmax"),  # 3, 3, 2, 2; softmax after concat.
}


def _apply(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def _compare(reference, layer, x):
    """Max abs differences of outputs and gradients between two layers.

    `reference` and `layer` may be lists of layers, applied in turn (stacks).
    """
    references = reference if isinstance(reference, list) else [reference]
    layers = layer if isinstance(layer, list) else [layer]
    _apply(references, x), _apply(layers, x)
    for ref, lay in zip(references, layers):
        lay.set_unpartitioned_weights(ref.get_weights())
    # A random upstream gradient, so that every output contributes differently.
    upstream = tf.random.stateless_normal(_apply(references, x).shape, seed=[1, 2])
    grads = []
    for stack in (references, layers):
        variables = [v for lay in stack for v in lay.trainable_weights]
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = _apply(stack, x)
            loss = tf.reduce_sum(y * upstream)
        grads.append((y, tape.gradient(loss, [x, *variables])))
    (y_ref, g_ref), (y, g) = grads
    errors = {
        "output": np.abs(y_ref - y).max(),
        "input_grad": np.abs(g_ref[0] - g[0]).max(),
    }
    g_ref, g = g_ref[1:], g[1:]
    for n, (ref, lay) in enumerate(zip(references, layers)):
        n_ref, n_lay = len(ref.trainable_weights), len(lay.trainable_weights)
        suffix = f"_{n}" if len(layers) > 1 else ""
        for name, a, b in zip(
            ("kernel_grad", "bias_grad"), g_ref[:n_ref], lay.unpartition(g[:n_lay])
        ):
            errors[name + suffix] = np.abs(np.asarray(a) - b).max()
        g_ref, g = g_ref[n_ref:], g[n_lay:]
    return {k: float(v) for k, v in errors.items()}


def _compare_lc(case, devices, flavour="tf_keras"):
    shape, kernel_size, strides, parts = case
    x = tf.random.stateless_normal(shape, seed=[3, 4])
    reference = tf_keras.layers.LocallyConnected2D(
        5, kernel_size, strides=strides, activation="tanh", bias_initializer="ones"
    )
    layer = _FLAVOURS[flavour].lc(
        5, kernel_size, strides, parts, devices, activation="tanh"
    )
    return _compare(reference, layer, x)


def _stacked_lc(specs, parts, devices, filters=(4, 3, 2), flavour="tf_keras"):
    """`(references, layers)`: `LocallyConnected2D`s and partitioned ones in block
    mode, one per `(kernel_size, strides)` of `specs`."""
    references, layers = [], []
    for n, (kernel_size, strides) in enumerate(specs):
        references.append(
            tf_keras.layers.LocallyConnected2D(
                filters[n],
                kernel_size,
                strides=strides,
                activation="tanh",
                bias_initializer="ones",
            )
        )
        layers.append(
            _FLAVOURS[flavour].lc(
                filters[n],
                kernel_size,
                strides,
                parts,
                devices,
                activation="tanh",
                output_blocks=n < len(specs) - 1,
                name=f"lc{n + 1}",
            )
        )
    return references, layers


def _compare_stacked_lc(case, devices, flavour="tf_keras"):
    shape, specs, parts = case
    x = tf.random.stateless_normal(shape, seed=[3, 4])
    return _compare(*_stacked_lc(specs, parts, devices, flavour=flavour), x)


def _compare_dense(case, devices, flavour="tf_keras"):
    units, parts, activation = case
    x = tf.random.stateless_normal([6, 7], seed=[5, 6])
    layers = _FLAVOURS[flavour]
    reference = layers.keras.layers.Dense(
        units, activation=activation, bias_initializer="ones"
    )
    layer = layers.dense(units, parts, devices, activation)
    return _compare(reference, layer, x)


def _halo_bytes_brute_force(
    shape, kernel_size, strides, grid, dtype_size=4, held_by=None
):
    """Counts, position by position, the input a block reads but does not own.

    `held_by`: `(block of each input row, block of each input column)` when the
    input arrives in blocks; by default (whole input) a block owns the positions
    from its first window on.
    """
    batch, rows, cols, channels = shape
    (kr, kc), (sr, sc) = (
        (v, v) if isinstance(v, int) else v for v in (kernel_size, strides)
    )
    out_r, out_c = (rows - kr) // sr + 1, (cols - kc) // sc + 1
    grid = (grid, 1) if isinstance(grid, int) else grid
    rb = np.array_split(np.arange(out_r), grid[0])
    cb = np.array_split(np.arange(out_c), grid[1])
    # Owner of each input position: the block whose windows start at or before it.
    owner = np.zeros((rows, cols, 2), int)
    for i, r in enumerate(rb):
        owner[r[0] * sr :, :, 0] = i
    for j, c in enumerate(cb):
        owner[:, c[0] * sc :, 1] = j
    if held_by is not None:
        owner[:, :, 0] = np.asarray(held_by[0])[:, None]
        owner[:, :, 1] = np.asarray(held_by[1])[None, :]
    elements = 0
    for i, r in enumerate(rb):
        for j, c in enumerate(cb):
            read = {
                (y * sr + dy, x * sc + dx)
                for y in r
                for x in c
                for dy in range(kr)
                for dx in range(kc)
            }
            elements += sum(tuple(owner[p]) != (i, j) for p in read)
    return elements * batch * channels * dtype_size


class TestArithmetic:
    def test_split_bounds_uneven(self):
        assert partition_math.split_bounds(7, 4) == [0, 2, 4, 6, 7]
        assert partition_math.split_bounds(10, 4) == [0, 3, 6, 8, 10]
        assert partition_math.split_bounds(7, 1) == [0, 7]

    def test_halo_bytes_by_hand_rows(self):
        # 6 x 5 input, 3 x 3 kernel: 4 output rows, blocks of 2. Block 0 owns input
        # rows 0-1 and reads rows 0-3: 2 halo rows * 5 cols * 3 channels * batch 2.
        got = partition_math.locally_connected_halo_bytes(
            [2, 6, 5, 3], (3, 3), (1, 1), (2, 1)
        )
        assert got == 2 * 5 * 3 * 2 * 4

    def test_halo_bytes_by_hand_grid(self):
        # 9 x 8 input, 3 x 3 kernel: 7 x 6 outputs in blocks of rows 4|3, cols 3|3.
        # Block (0,0) owns 4 x 3 inputs and reads 6 x 5: 18. Block (0,1) owns 4 x 5
        # and reads 6 x 5: 10. Block (1,0) owns 5 x 3 and reads 5 x 5: 10.
        got = partition_math.locally_connected_halo_bytes(
            [2, 9, 8, 3], (3, 3), (1, 1), (2, 2)
        )
        assert got == (18 + 10 + 10) * 2 * 3 * 4

    @pytest.mark.parametrize("case", _LC_CASES.values(), ids=_LC_CASES.keys())
    def test_halo_bytes_match_brute_force(self, case):
        shape, kernel_size, strides, parts = case
        layer = plc.PartitionedLocallyConnected2D(
            2, kernel_size, strides, parts, ["/device:CPU:0"]
        )
        layer.build(shape)
        assert layer.cross_partition_bytes(shape[0]) == _halo_bytes_brute_force(
            shape, kernel_size, strides, parts
        )

    def test_dense_bytes(self):
        layer = partitioned_dense.PartitionedDense(10, 4, ["/device:CPU:0"])
        layer.build([8, 440])
        assert layer.cross_partition_bytes(8) == 3 * 8 * 440 * 4
        assert partition_math.dense_cross_partition_bytes(8, 440, 1) == 0

    def test_scatter_gather_bytes_match_measured(self):
        # The case of `TestFourDevices.test_measured_halo_traffic`: 9 x 8 x 3 input,
        # 3 x 3 kernel, 2 x 2 blocks, 4 filters, batch 2; block 0 owns 4 x 3 inputs
        # and makes 4 x 3 of the 7 x 6 outputs.
        got = partition_math.locally_connected_scatter_gather_bytes(
            [2, 9, 8, 3], (3, 3), (1, 1), (2, 2), filters=4
        )
        assert got == (9 * 8 - 4 * 3) * 2 * 3 * 4 + (7 * 6 - 4 * 3) * 2 * 4 * 4

    def test_dense_gather_bytes(self):
        # 10 units over 4 partitions: 3, 3, 2, 2; partition 0 keeps its 3.
        assert partition_math.dense_gather_bytes(8, 10, 4) == 7 * 8 * 4
        assert partition_math.dense_gather_bytes(8, 10, 1) == 0

    def test_output_bounds(self):
        # 11 x 12 input, 3 x 3 kernel: 9 x 10 outputs in blocks of 5|4 x 5|5.
        assert partition_math.locally_connected_output_bounds(
            [2, 11, 12, 2], (3, 3), (1, 1), (2, 2)
        ) == ([0, 5, 9], [0, 5, 10])

    def test_block_halo_bytes_by_hand_rows(self):
        # "2_parts_uneven": the first layer's 11 x 6 x 4 output is held in row
        # blocks 0-5 | 6-10. The second (3 x 3) makes 9 rows, 5|4: partition 0 reads
        # rows 0-6 and lacks row 6, partition 1 reads rows 5-10 and lacks row 5,
        # which block 0 holds. 2 rows * 6 cols * 4 channels * batch 2.
        got = partition_math.locally_connected_block_halo_bytes(
            [2, 11, 6, 4], ([0, 6, 11], [0, 6]), (3, 3), (1, 1), (2, 1)
        )
        assert got == 2 * 6 * 4 * 2 * 4

    def test_read_input_indices(self):
        assert partition_math.read_input_indices(1, 3, 1, 3) == [1, 2, 3, 4]
        # Stride 3, kernel 2: rows 5 and 8 lie between windows.
        assert partition_math.read_input_indices(1, 3, 3, 2) == [3, 4, 6, 7]

    def test_block_halo_bytes_by_hand_stride_over_kernel(self):
        # "own_block_unread": 16 x 3 x 4 held in rows 0-3|4-7|8-11|12-15; a 1 x 1
        # kernel, stride 3, makes 6 x 1 outputs in 2|1|1|1 reading rows 0,3|6,9|12|
        # 15 of column 0. Row 9 crosses to partition 1 (not rows 7-8, which no window
        # reads) and row 12 to partition 2, which holds rows 8-11. 2 * 4 channels.
        got = partition_math.locally_connected_block_halo_bytes(
            [1, 16, 3, 4], ([0, 4, 8, 12, 16], [0, 3]), (1, 1), (3, 3), (4, 1)
        )
        assert got == 2 * 1 * 4 * 1 * 4

    def test_block_halo_bytes_by_hand_grid(self):
        # "grid_2x2_strided": 9 x 10 x 4 held in rows 0-4|5-8, columns 0-4|5-9. The
        # (2, 3) kernel, strides (1, 2), makes 8 x 4 outputs in 4|4 x 2|2, reading
        # rows 0-4|4-8 and columns 0-4|4-8. Block (0,0) reads 5 x 5, all its own;
        # (0,1) holds 5 x 4 of its 5 x 5; (1,0) 4 x 5; (1,1) 4 x 4: 0+5+5+9.
        got = partition_math.locally_connected_block_halo_bytes(
            [2, 9, 10, 4], ([0, 5, 9], [0, 5, 10]), (2, 3), (1, 2), (2, 2)
        )
        assert got == (0 + 5 + 5 + 9) * 4 * 2 * 4

    def test_block_halo_bytes_by_hand_benchmark(self):
        # `benchmarks/model_parallel_bench.py`, lc model at 2 partitions: batch 32,
        # 40 x 40 x 8 -> 36 x 36 x 32 in rows 0-17|18-35 -> 32 x 32 in 16|16.
        # Partition 0 reads rows 0-19 (lacks 18-19), partition 1 rows 16-35 (lacks
        # 16-17): 4 rows * 36 cols * 32 channels * batch 32.
        bounds = partition_math.locally_connected_output_bounds(
            [32, 40, 40, 8], (5, 5), (1, 1), (2, 1)
        )
        got = partition_math.locally_connected_block_halo_bytes(
            [32, 36, 36, 32], bounds, (5, 5), (1, 1), (2, 1)
        )
        assert got == 4 * 36 * 32 * 32 * 4 == 589_824

    @pytest.mark.parametrize(
        "case", _STACKED_LC_CASES.values(), ids=_STACKED_LC_CASES.keys()
    )
    def test_block_halo_bytes_match_brute_force(self, case):
        shape, specs, parts = case
        _, layers = _stacked_lc(specs, parts, ["/device:CPU:0"])
        _apply(layers, tf.zeros(shape))
        for lower, upper in zip(layers, layers[1:]):
            # The block holding each row and each column of the lower output.
            held_by = [
                np.concatenate(
                    [
                        np.full(len(b), i)
                        for i, b in enumerate(np.array_split(np.arange(size), n))
                    ]
                )
                for size, n in zip(
                    (lower.output_rows, lower.output_cols), lower.partition_grid
                )
            ]
            upper_shape = [shape[0], lower.output_rows, lower.output_cols]
            assert upper.cross_partition_bytes(shape[0]) == _halo_bytes_brute_force(
                [*upper_shape, lower.filters],
                upper.kernel_size,
                upper.strides,
                upper.partition_grid,
                held_by=held_by,
            )

    def test_block_mode_scatter_gather_bytes(self):
        # The case of `TestFourDevices.test_measured_block_halo_traffic`: only the
        # first layer scatters (11 x 12 x 2 input, block (0,0) owns 5 x 5 of it) and
        # only the last gathers (8 x 4 x 3 output, block (0,0) makes 4 x 2).
        _, (lc1, lc2) = _stacked_lc(
            ((3, 1), ((2, 3), (1, 2))), (2, 2), ["/device:CPU:0"]
        )
        _apply([lc1, lc2], tf.zeros([2, 11, 12, 2]))
        assert lc1.scatter_gather_bytes(2) == (11 * 12 - 5 * 5) * 2 * 2 * 4
        assert lc2.scatter_gather_bytes(2) == (8 * 4 - 4 * 2) * 3 * 2 * 4
        assert lc2.cross_partition_bytes(2) == (0 + 5 + 5 + 9) * 4 * 2 * 4
        # The same layer given a whole input counts the halo of its owned regions.
        lc2(tf.zeros([2, 9, 10, 4]))
        assert lc2.input_block_bounds is None
        assert lc2.cross_partition_bytes(2) == (
            partition_math.locally_connected_halo_bytes(
                [2, 9, 10, 4], (2, 3), (1, 2), (2, 2)
            )
        )

    def test_server_config(self):
        config = cluster.server_config(3, inter_op_threads=4)
        assert config.device_count["CPU"] == 3
        assert config.inter_op_parallelism_threads == 4

    def test_cpu_device_names(self):
        assert model_parallel.cpu_device_names(2) == ["/device:CPU:0", "/device:CPU:1"]


class TestErrors:
    @flavours
    def test_num_partitions_zero(self, flavour):
        with pytest.raises(
            ValueError,
            match=r"`num_partitions` must be >= 1 and <= the output rows\. "
            r"Received: 0",
        ):
            _FLAVOURS[flavour].lc(4, 3, num_partitions=0)

    @flavours
    def test_num_partitions_above_output_rows(self, flavour):
        layer = _FLAVOURS[flavour].lc(4, 3, 1, 8, ["/device:CPU:0"])
        with pytest.raises(
            ValueError,
            match=r"`num_partitions` must be >= 1 and <= the output rows \(7\)\. "
            r"Received: 8",
        ):
            layer.build([2, 9, 8, 3])

    def test_num_partitions_above_output_cols(self):
        layer = plc.PartitionedLocallyConnected2D(4, 3, 1, (1, 7), ["/device:CPU:0"])
        with pytest.raises(ValueError, match=r"output columns \(6\)\. Received: 7"):
            layer.build([2, 9, 8, 3])

    def test_blocks_wrong_count(self):
        layer = plc.PartitionedLocallyConnected2D(4, 3, 1, 2, ["/device:CPU:0"])
        blocks = [tf.zeros([2, 4, 8, 3])] * 3
        with pytest.raises(
            ValueError,
            match=r"`inputs` must be one tensor or a list of 2 blocks \(the output "
            r"of a `PartitionedLocallyConnected2D` with `output_blocks=True` and "
            r"`num_partitions=2`\)\. Received: a list of 3 blocks",
        ):
            layer(blocks)

    def test_blocks_of_another_grid(self):
        # 1 x 2 blocks of a 7 x 5 map (columns 3|2) do not tile a 2 x 1 grid.
        lower = plc.PartitionedLocallyConnected2D(
            4, 3, 1, (1, 2), ["/device:CPU:0"], output_blocks=True
        )
        upper = plc.PartitionedLocallyConnected2D(4, 3, 1, (2, 1), ["/device:CPU:0"])
        with pytest.raises(
            ValueError,
            match=r"`inputs` must be blocks of a 2 x 1 grid, row-major.*"
            r"`num_partitions=\(2, 1\)`\)\. Received block shapes: "
            r"\['\(2, 7, 3, 4\)', '\(2, 7, 2, 4\)'\]",
        ):
            upper(lower(tf.zeros([2, 9, 7, 3])))

    def test_blocks_of_another_grid_after_build(self):
        # 2 x 1 blocks of an 8 x 6 map (rows 4|4) would tile a 1 x 2 grid as 4 x 12;
        # a layer built for 8 x 6 tells.
        lower = plc.PartitionedLocallyConnected2D(
            4, 3, 1, (2, 1), ["/device:CPU:0"], output_blocks=True
        )
        upper = plc.PartitionedLocallyConnected2D(4, 3, 1, (1, 2), ["/device:CPU:0"])
        upper.build([2, 8, 6, 4])
        with pytest.raises(
            ValueError,
            match=r"`inputs` must be blocks that make up the input map this layer "
            r"was built for, \(8, 6, 4\)\. Received blocks that make up "
            r"\(4, 12, 4\)",
        ):
            upper(lower(tf.zeros([2, 10, 8, 3])))

    def test_input_rank(self):
        layer = plc.PartitionedLocallyConnected2D(4, 3, 1, 2, ["/device:CPU:0"])
        with pytest.raises(
            ValueError, match=r"`inputs` must have rank 4 .*Received shape: \(9, 8\)"
        ):
            layer(tf.zeros([9, 8]))

    def test_block_input_bounds(self):
        with pytest.raises(
            ValueError,
            match=r"`input_bounds\[0\]` must rise from 0 to 11 in 2 steps\. "
            r"Received: \[0, 6, 10\]",
        ):
            partition_math.locally_connected_block_halo_bytes(
                [2, 11, 6, 4], ([0, 6, 10], [0, 6]), (3, 3), (1, 1), (2, 1)
            )

    @flavours
    def test_dense_num_partitions_above_units(self, flavour):
        with pytest.raises(
            ValueError,
            match=r"`num_partitions` must be an int >= 1 and <= `units` \(10\)\. "
            r"Received: 11",
        ):
            _FLAVOURS[flavour].dense(10, num_partitions=11)

    @flavours
    def test_missing_device(self, flavour):
        layer = _FLAVOURS[flavour].dense(4, 2, ["/device:CPU:9"])
        with pytest.raises(ValueError, match=r"`devices` names '/device:CPU:9'"):
            layer.build([2, 3])

    def test_bad_kernel_size(self):
        with pytest.raises(ValueError, match=r"`kernel_size` must be .* \(0, 2\)"):
            plc.PartitionedLocallyConnected2D(4, (0, 2))

    @flavours
    def test_devices_must_be_a_list_of_names(self, flavour):
        with pytest.raises(
            ValueError,
            match=r"`devices` must be a list of device names, e.g\. .*or None\. "
            r"Received: '/device:CPU:1'",
        ):
            _FLAVOURS[flavour].dense(4, 2, "/device:CPU:1")

    @flavours
    def test_numpy_ints_are_ints(self, flavour):
        layers = _FLAVOURS[flavour]
        dense = layers.dense(np.int64(8), np.int32(2), ["/device:CPU:0"])
        lc = layers.lc(np.int64(4), np.int64(3), 1, (np.int64(2), 1))
        assert (dense.units, dense.num_partitions) == (8, 2)
        assert type(dense.units) is int
        assert (lc.filters, lc.kernel_size, lc.partition_grid) == (4, (3, 3), (2, 1))
        with pytest.raises(
            ValueError, match=r"`units` must be an int >= 1\. Received: '8'"
        ):
            layers.dense("8")

    def test_keras3_layers_refuse_xla(self):
        model = keras.Sequential(
            [keras.Input([4]), keras3_layers.PartitionedDense(3, 2, ["/device:CPU:0"])]
        )
        model.compile("sgd", "mse", jit_compile=True)
        assert model.jit_compile is False
        model.compile("sgd", "mse", jit_compile="auto")
        assert model.jit_compile is False

    @flavours
    def test_bad_weight_shapes(self, flavour):
        layer = _FLAVOURS[flavour].dense(4, 2, ["/device:CPU:0"])
        layer.build([2, 3])
        with pytest.raises(ValueError, match=r"`weights` must have shapes"):
            layer.set_unpartitioned_weights([np.zeros([3, 5]), np.zeros([5])])

    def test_cpu_device_names_bad_count(self):
        with pytest.raises(ValueError, match=r"`num_devices` must be >= 1\. Rec"):
            model_parallel.cpu_device_names(0)

    def test_split_bounds_too_many_parts(self):
        with pytest.raises(ValueError, match=r"<= 3 .*Received: 4"):
            partition_math.split_bounds(3, 4)

    def test_device_type(self):
        with pytest.raises(ValueError, match=r"`device_type` must be .*'TPU'"):
            model_parallel.replica_devices("TPU")

    def test_configure_after_initialisation(self):
        have = len(tf.config.list_logical_devices("CPU"))  # Initialises TF.
        with pytest.raises(RuntimeError, match="already initialised"):
            model_parallel.configure_logical_cpus(have + 1)


class TestOneDevice:
    """Partitions all on `CPU:0`: the split arithmetic, without device copies."""

    @flavours
    @pytest.mark.parametrize("case", _LC_CASES.values(), ids=_LC_CASES.keys())
    def test_locally_connected_equals_tf_keras(self, case, flavour):
        errors = _compare_lc(case, ["/device:CPU:0"], flavour)
        assert max(errors.values()) < _TOLERANCE, errors

    @flavours
    @pytest.mark.parametrize("case", _DENSE_CASES.values(), ids=_DENSE_CASES.keys())
    def test_dense_equals_dense(self, case, flavour):
        errors = _compare_dense(case, ["/device:CPU:0"], flavour)
        assert max(errors.values()) < _TOLERANCE, errors

    @flavours
    @pytest.mark.parametrize(
        "case", _STACKED_LC_CASES.values(), ids=_STACKED_LC_CASES.keys()
    )
    def test_stacked_locally_connected_equals_tf_keras(self, case, flavour):
        errors = _compare_stacked_lc(case, ["/device:CPU:0"], flavour)
        assert max(errors.values()) < _TOLERANCE, errors

    @flavours
    def test_output_blocks_are_the_output_split(self, flavour):
        # 7 x 6 outputs in rows 4|3, columns 3|3; blocks row-major.
        reference = tf_keras.layers.LocallyConnected2D(4, 3, bias_initializer="ones")
        layer = _FLAVOURS[flavour].lc(
            4, 3, 1, (2, 2), ["/device:CPU:0"], output_blocks=True
        )
        x = tf.random.stateless_normal([2, 9, 8, 3], seed=[5, 5])
        reference(x), layer(x)
        layer.set_unpartitioned_weights(reference.get_weights())
        y = reference(x).numpy()
        blocks = layer(x)
        expected = [y[:, :4, :3], y[:, :4, 3:], y[:, 4:, :3], y[:, 4:, 3:]]
        assert [b.shape for b in blocks] == [e.shape for e in expected]
        shapes = layer.compute_output_shape([2, 9, 8, 3])
        assert [tuple(s) for s in shapes] == [e.shape for e in expected]
        for block, part in zip(blocks, expected):
            np.testing.assert_allclose(block, part, rtol=0, atol=_TOLERANCE)

    @flavours
    def test_block_mode_trains_in_a_keras_model(self, flavour):
        layers = _FLAVOURS[flavour]
        inputs = layers.keras.Input([9, 8, 3])
        blocks = layers.lc(4, 3, 1, (2, 2), ["/device:CPU:0"], output_blocks=True)(
            inputs
        )
        h = layers.lc(4, 3, 1, (2, 2), ["/device:CPU:0"])(blocks)
        outputs = layers.keras.layers.Dense(5, activation="softmax")(
            layers.keras.layers.Flatten()(h)
        )
        model = layers.keras.Model(inputs, outputs)
        model.compile("sgd", "sparse_categorical_crossentropy")
        x = tf.random.stateless_normal([8, 9, 8, 3], seed=[7, 7])
        y = tf.zeros([8], tf.int32)
        before = model.evaluate(x, y, verbose=0)
        model.fit(x, y, epochs=3, verbose=0)
        assert model.evaluate(x, y, verbose=0) < before

    @flavours
    def test_seeded_initializer_matches_unpartitioned(self, flavour):
        layers = _FLAVOURS[flavour]
        init = layers.keras.initializers.GlorotUniform(seed=7)
        reference = layers.keras.layers.Dense(10, kernel_initializer=init)
        layer = layers.dense(10, 4, ["/device:CPU:0"], kernel_initializer=init)
        reference.build((None, 6)), layer.build((None, 6))
        np.testing.assert_array_equal(
            layer.get_unpartitioned_weights()[0], reference.get_weights()[0]
        )

    @flavours
    def test_trains_in_a_keras_model(self, flavour):
        layers = _FLAVOURS[flavour]
        model = layers.keras.Sequential(
            [
                layers.keras.Input([9, 8, 3]),
                layers.lc(4, 3, 1, (2, 2), ["/device:CPU:0"]),
                layers.keras.layers.Flatten(),
                layers.dense(5, 2, ["/device:CPU:0"], activation="softmax"),
            ]
        )
        model.compile("sgd", "sparse_categorical_crossentropy")
        x = tf.random.stateless_normal([8, 9, 8, 3], seed=[7, 7])
        y = tf.zeros([8], tf.int32)
        before = model.evaluate(x, y, verbose=0)
        model.fit(x, y, epochs=3, verbose=0)
        assert model.evaluate(x, y, verbose=0) < before

    @flavours
    def test_config_round_trip(self, flavour):
        lc = _FLAVOURS[flavour].lc
        layer = lc(4, (3, 2), 2, (2, 1), activation="relu")
        clone = lc.from_config(layer.get_config())
        assert clone.get_config() == layer.get_config()

    @flavours
    def test_config_round_trip_output_blocks(self, flavour):
        lc = _FLAVOURS[flavour].lc
        layer = lc(4, 3, 1, 2, output_blocks=True)
        clone = lc.from_config(layer.get_config())
        assert clone.get_config() == layer.get_config()
        assert clone.output_blocks

    def test_keras3_model_file_round_trip(self, tmp_path):
        # A Keras 3 model with both layers saves to `.keras` and loads back
        # (registered serializables) with the same predictions.
        model = keras.Sequential(
            [
                keras.Input([9, 8, 3]),
                keras3_layers.PartitionedLocallyConnected2D(
                    4, 3, 1, (2, 2), ["/device:CPU:0"], activation="relu"
                ),
                keras.layers.Flatten(),
                keras3_layers.PartitionedDense(5, 2, ["/device:CPU:0"]),
            ]
        )
        x = tf.random.stateless_normal([3, 9, 8, 3], seed=[8, 8]).numpy()
        path = str(tmp_path / "model.keras")
        model.save(path)
        loaded = keras.models.load_model(path)
        assert [type(layer) for layer in loaded.layers] == [
            type(layer) for layer in model.layers
        ]
        np.testing.assert_array_equal(loaded(x), model(x))


# --- Child process: 4 logical CPU devices. ------------------------------------------

# Keras 3 may add a suffix to a layer's scope in a graph (`lc_1`).
_SCOPE = re.compile(
    r"(?:^|/)(lc\d?|dense)(?:_\d+)?/(partition|halo)_(\d+)(?:_to_\d+)?/"
)
# A tensor sent between devices, by the layer and the step of it that made it.
_SENT_BY = re.compile(r"(?:^|/)(lc\d)/(halo|scatter|partition)")


def _short(device):
    return tf.DeviceSpec.from_string(device).to_string().split("device:")[-1]


def _run_with_metadata(fn, *args):
    """Runs a new `tf.function` once; returns its executed partition graphs."""
    from tensorflow.python.eager import context  # Run metadata has no public API.

    context.enable_run_metadata()
    try:
        fn(*args)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    return [g for f in metadata.function_graphs for g in f.partition_graphs]


def _variable_device(variable):
    # A Keras 3 variable holds its `tf.Variable` as `value`.
    return (
        variable.device if isinstance(variable, tf.Variable) else variable.value.device
    )


def _placement_report(flavour):
    """Where each partition's forward and backward ops ran, by partition.

    tf_keras: the layers called on their variables. Keras 3: as `keras3.fit`
    trains, `stateless_call` on values handed in, differentiated by them.
    """
    layers = _FLAVOURS[flavour]
    lc = layers.lc(4, 3, 1, 4, name="lc", activation="relu")
    dense = layers.dense(10, 4, name="dense", activation="softmax")
    model = layers.keras.Sequential(
        [layers.keras.Input([9, 8, 3]), lc, layers.keras.layers.Flatten(), dense]
    )
    x = tf.random.stateless_normal([2, 9, 8, 3], seed=[1, 1])
    values = [tf.convert_to_tensor(v) for v in model.trainable_weights]

    @tf.function
    def step(x, values):
        with tf.GradientTape() as tape:
            tape.watch([x, *values])
            if flavour == "keras3":
                y, _ = model.stateless_call(values, [], x)
            else:
                y = model(x)
            loss = tf.reduce_sum(y * y)
        targets = values if flavour == "keras3" else model.trainable_weights
        return tape.gradient(loss, [x, *targets])

    return {
        "ops": _devices_by_scope(_run_with_metadata(step, x, values)),
        "variables": {
            name: [
                _short(_variable_device(v))
                for v in [*layer.block_kernels, *layer.block_biases]
            ]
            for name, layer in (("lc", lc), ("dense", dense))
        },
    }


def _devices_by_scope(graphs):
    """`"<layer> <forward|backward> <partition|halo> <k>"` -> devices its ops ran on."""
    seen = {}
    for graph in graphs:
        for node in graph.node:
            match = _SCOPE.search(node.name)
            if not match or node.op in ("_Send", "_Recv", "Const"):
                continue
            pass_ = "backward" if node.name.startswith("gradient_tape/") else "forward"
            key = f"{match[1]} {pass_} {match[2]} {match[3]}"
            seen.setdefault(key, set()).add(_short(node.device))
    return {k: sorted(v) for k, v in seen.items()}


def _stacked_placement_report(flavour):
    """Where each partition of three stacked layers in block mode ran its ops."""
    _, layers = _stacked_lc(
        _STACKED_LC_CASES["3_layers_4_parts"][1], 4, None, flavour=flavour
    )
    x = tf.random.stateless_normal([2, 14, 6, 2], seed=[1, 1])
    variables = [v for layer in layers for v in layer.trainable_weights]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = _apply(layers, x)
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, *variables])

    return _devices_by_scope(_run_with_metadata(step, x))


def _sent_tensors(graphs, traced):
    """`(source tensor name, bytes)` of every tensor sent between devices."""
    sent = []
    for graph in graphs:
        for node in graph.node:
            # Control-edge tokens (`GroupCrossDeviceControlEdges`) carry no data.
            if node.op != "_Send" or "GroupCrossDeviceControlEdges" in node.input[0]:
                continue
            source = node.input[0] if ":" in node.input[0] else node.input[0] + ":0"
            try:
                shape = traced.get_tensor_by_name(source).shape
                size = int(np.prod(shape)) * 4
            except (KeyError, ValueError):
                size = -1  # Not in the traced graph: a Grappler rewrite.
            sent.append((source, size))
    return sent


def _stacked_traffic_report():
    """Bytes sent between devices by two stacked layers in block mode, by kind.

    The case of `TestArithmetic.test_block_halo_bytes_by_hand_grid`: `lc1` takes
    `[2, 11, 12, 2]` whole and gives 2 x 2 blocks of its `[2, 9, 10, 4]` output to
    `lc2`, which gives `[2, 8, 4, 3]` whole.
    """
    _, (lc1, lc2) = _stacked_lc(((3, 1), ((2, 3), (1, 2))), (2, 2), None)
    x = tf.random.stateless_normal([2, 11, 12, 2], seed=[2, 2])
    lc2(lc1(x))

    @tf.function
    def forward(x):
        return lc2(lc1(x))

    @tf.function
    def forward_backward(x):  # The input gradient only: no weight gradients sent.
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = lc2(lc1(x))
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, x)

    forward_sent = {}
    for source, size in _sent_tensors(
        _run_with_metadata(forward, x), forward.get_concrete_function(x).graph
    ):
        match = _SENT_BY.search(source)
        kind = f"{match[1]} {match[2]}" if match else source
        forward_sent[kind] = forward_sent.get(kind, 0) + size
    both = _sent_tensors(
        _run_with_metadata(forward_backward, x),
        forward_backward.get_concrete_function(x).graph,
    )
    return {
        "forward": forward_sent,
        "forward_backward_bytes": sum(size for _, size in both),
        "unknown_sizes": [source for source, size in both if size < 0],
        "expected": {
            "lc1 halo": lc1.cross_partition_bytes(2),
            "lc2 halo": lc2.cross_partition_bytes(2),
            "lc1 scatter_gather": lc1.scatter_gather_bytes(2),
            "lc2 scatter_gather": lc2.scatter_gather_bytes(2),
        },
    }


def _halo_traffic_report():
    """Bytes of every tensor sent between devices in one forward pass, by kind."""
    layer = plc.PartitionedLocallyConnected2D(4, 3, 1, (2, 2), name="lc")
    x = tf.random.stateless_normal([2, 9, 8, 3], seed=[2, 2])
    layer(x)
    forward = tf.function(layer)
    graphs = _run_with_metadata(forward, x)
    traced = forward.get_concrete_function(x).graph
    sent = {}
    for source, size in _sent_tensors(graphs, traced):
        kind = next(
            (k for k in ("halo", "scatter", "partition") if f"/{k}" in source),
            source,
        )
        sent[kind] = sent.get(kind, 0) + size
    return {"sent_bytes": sent, "expected_halo_bytes": layer.cross_partition_bytes(2)}


def _server_report():
    """Devices of a server built with `server_config(3)`, and where an op ran."""
    server = tf.distribute.Server.create_local_server(config=cluster.server_config(3))
    with tf.Graph().as_default(), tf.compat.v1.Session(server.target) as session:
        devices = [_short(d.name) for d in session.list_devices()]
        with tf.device("/device:CPU:2"):
            y = tf.constant(1.0, name="one") + 1.0
        options = tf.compat.v1.RunOptions(
            trace_level=tf.compat.v1.RunOptions.FULL_TRACE
        )
        metadata = tf.compat.v1.RunMetadata()
        session.run(y, options=options, run_metadata=metadata)
    ran_on = {
        _short(d.device)
        for d in metadata.step_stats.dev_stats
        for n in d.node_stats
        if n.node_name.startswith("add")
    }
    return {"devices": devices, "add_ran_on": sorted(ran_on)}


def _flavour_report(flavour):
    """Equality and placement of one flavour's layers on 4 devices."""
    return {
        "lc": {k: _compare_lc(c, None, flavour) for k, c in _LC_CASES.items()},
        "lc_stacked": {
            k: _compare_stacked_lc(c, None, flavour)
            for k, c in _STACKED_LC_CASES.items()
        },
        "dense": {k: _compare_dense(c, None, flavour) for k, c in _DENSE_CASES.items()},
        "placement": _placement_report(flavour),
        "stacked_placement": _stacked_placement_report(flavour),
    }


def _child_report():
    model_parallel.configure_logical_cpus(_NUM_DEVICES)
    return {
        "devices": model_parallel.replica_devices(),
        **{flavour: _flavour_report(flavour) for flavour in _FLAVOURS},
        "traffic": _halo_traffic_report(),
        "stacked_traffic": _stacked_traffic_report(),
        "server": _server_report(),
    }


# One process runs the class: its report (a child of about 15 s) is made once.
@pytest.mark.xdist_group("four_devices")
class TestFourDevices:
    @pytest.fixture(scope="class")
    @classmethod
    def report(cls):
        root = ROOT
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        result = subprocess.run(
            [sys.executable, os.path.abspath(__file__)],
            check=False,
            capture_output=True,
            text=True,
            timeout=_CHILD_TIMEOUT_SECS,
            env=env,
            cwd=root,
        )
        assert result.returncode == 0, result.stderr[-4000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    def test_devices(self, report):
        assert report["devices"] == [f"/device:CPU:{i}" for i in range(_NUM_DEVICES)]

    @flavours
    @pytest.mark.parametrize("case", _LC_CASES.keys())
    def test_locally_connected_equals_tf_keras(self, report, case, flavour):
        errors = report[flavour]["lc"][case]
        assert max(errors.values()) < _TOLERANCE, errors

    @flavours
    @pytest.mark.parametrize("case", _STACKED_LC_CASES.keys())
    def test_stacked_locally_connected_equals_tf_keras(self, report, case, flavour):
        errors = report[flavour]["lc_stacked"][case]
        assert max(errors.values()) < _TOLERANCE, errors

    @flavours
    @pytest.mark.parametrize("case", _DENSE_CASES.keys())
    def test_dense_equals_dense(self, report, case, flavour):
        errors = report[flavour]["dense"][case]
        assert max(errors.values()) < _TOLERANCE, errors

    @flavours
    def test_variables_on_their_devices(self, report, flavour):
        variables = report[flavour]["placement"]["variables"]
        expected = [f"CPU:{k}" for k in range(_NUM_DEVICES)] * 2  # Kernels, biases.
        assert variables == {"lc": expected, "dense": expected}

    @flavours
    def test_each_partition_runs_on_its_device(self, report, flavour):
        ops = report[flavour]["placement"]["ops"]
        for layer in ("lc", "dense"):
            for pass_ in ("forward", "backward"):
                for k in range(_NUM_DEVICES):
                    key = f"{layer} {pass_} partition {k}"
                    assert ops.get(key) == [f"CPU:{k}"], (key, ops.get(key))
        # Halo pieces are cut on the device of the block that owns them.
        for key, devices in ops.items():
            if " halo " in key:
                assert devices == [f"CPU:{key.split()[-1]}"], (key, devices)

    def test_measured_halo_traffic(self, report):
        traffic = report["traffic"]
        # By hand (see `TestArithmetic.test_halo_bytes_by_hand_grid`).
        assert traffic["expected_halo_bytes"] == (18 + 10 + 10) * 2 * 3 * 4
        assert traffic["sent_bytes"]["halo"] == traffic["expected_halo_bytes"]
        # Everything else crossing devices is the input's scatter and the outputs'
        # gather, block by block. The input [2, 9, 8, 3] lives on CPU:0 with block
        # (0, 0), which owns 4 x 3 of its positions; the output [2, 7, 6, 4] is
        # gathered there too, and block (0, 0) made 4 x 3 of it.
        assert traffic["sent_bytes"] == {
            "halo": traffic["expected_halo_bytes"],
            "scatter": (9 * 8 - 4 * 3) * 2 * 3 * 4,
            "partition": (7 * 6 - 4 * 3) * 2 * 4 * 4,
        }
        # ... which `partition_math` predicts.
        assert traffic["sent_bytes"]["scatter"] + traffic["sent_bytes"][
            "partition"
        ] == partition_math.locally_connected_scatter_gather_bytes(
            [2, 9, 8, 3], (3, 3), (1, 1), (2, 2), filters=4
        )

    @flavours
    def test_stacked_partitions_run_on_their_devices(self, report, flavour):
        ops = report[flavour]["stacked_placement"]
        for layer in ("lc1", "lc2", "lc3"):
            for pass_ in ("forward", "backward"):
                for k in range(_NUM_DEVICES):
                    key = f"{layer} {pass_} partition {k}"
                    assert ops.get(key) == [f"CPU:{k}"], (key, ops.get(key))
        # Pieces of block `k2` are cut where it lives: in block mode, where the
        # previous layer's partition `k2` made it. (Grappler drops a cut that takes
        # a whole block for its own partition, so not every `k2` has ops.)
        halo = {k: v for k, v in ops.items() if " halo " in k}
        for layer in ("lc1", "lc2", "lc3"):
            assert any(k.startswith(f"{layer} forward halo") for k in halo), halo
        for key, devices in halo.items():
            assert devices == [f"CPU:{key.split()[-1]}"], (key, devices)

    def test_measured_block_halo_traffic(self, report):
        traffic = report["stacked_traffic"]
        # By hand. lc1 as in `TestArithmetic.test_halo_bytes_by_hand_grid`: 11 x 12
        # input, 9 x 10 outputs in 5|4 x 5|5; the blocks read 7 x 7, 7 x 7, 6 x 7,
        # 6 x 7 inputs and own 5 x 5, 5 x 7, 6 x 5, 6 x 7 of them. lc2: see
        # `TestArithmetic.test_block_halo_bytes_by_hand_grid`.
        lc1_halo = (24 + 14 + 12 + 0) * 2 * 2 * 4
        lc2_halo = (0 + 5 + 5 + 9) * 2 * 4 * 4
        scatter = (11 * 12 - 5 * 5) * 2 * 2 * 4  # lc1's input, from CPU:0.
        gather = (8 * 4 - 4 * 2) * 2 * 3 * 4  # lc2's output, to CPU:0.
        # lc1's output blocks stay on their devices: nothing "lc1 partition" is sent.
        assert traffic["forward"] == {
            "lc1 scatter": scatter,
            "lc1 halo": lc1_halo,
            "lc2 halo": lc2_halo,
            "lc2 partition": gather,
        }
        assert traffic["expected"] == {
            "lc1 halo": lc1_halo,
            "lc2 halo": lc2_halo,
            "lc1 scatter_gather": scatter,
            "lc2 scatter_gather": gather,
        }
        # The backward pass sends as many bytes back, and nothing else.
        assert traffic["unknown_sizes"] == []
        assert traffic["forward_backward_bytes"] == 2 * (
            scatter + lc1_halo + lc2_halo + gather
        )

    def test_server_exposes_cpu_devices(self, report):
        server = report["server"]
        assert [d for d in server["devices"] if d.startswith("CPU")] == [
            "CPU:0",
            "CPU:1",
            "CPU:2",
        ]
        assert server["add_ran_on"] == ["CPU:2"]


if __name__ == "__main__":
    print(json.dumps(_child_report()))
