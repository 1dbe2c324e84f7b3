"""Tests of model parallelism (Dean et al. 2012, section 3).

Quick tests run in the pytest process on `CPU:0` alone (every partition on the same
device): arithmetic, errors, and equality with the unpartitioned `tf_keras` layers.

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

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_distbelief import cluster, model_parallel, partition_math, partitioned_dense
from tf_distbelief import partitioned_locally_connected as plc

_TOLERANCE = 1e-5
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
}
# (units, num_partitions, activation).
_DENSE_CASES = {
    "10_units_1_part": (10, 1, None),
    "10_units_2_parts": (10, 2, "sigmoid"),
    "10_units_4_parts": (10, 4, "softmax"),  # 3, 3, 2, 2; softmax after concat.
}


def _compare(reference, layer, x):
    """Max abs differences of outputs and gradients between two layers."""
    reference(x), layer(x)
    layer.set_unpartitioned_weights(reference.get_weights())
    # A random upstream gradient, so that every output contributes differently.
    upstream = tf.random.stateless_normal(reference(x).shape, seed=[1, 2])
    grads = []
    for lay in (reference, layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = lay(x)
            loss = tf.reduce_sum(y * upstream)
        grads.append((y, tape.gradient(loss, [x, *lay.trainable_weights])))
    (y_ref, g_ref), (y, g) = grads
    errors = {
        "output": np.abs(y_ref - y).max(),
        "input_grad": np.abs(g_ref[0] - g[0]).max(),
    }
    for name, a, b in zip(
        ("kernel_grad", "bias_grad"), g_ref[1:], layer.unpartition(g[1:])
    ):
        errors[name] = np.abs(np.asarray(a) - b).max()
    return {k: float(v) for k, v in errors.items()}


def _compare_lc(case, devices):
    shape, kernel_size, strides, parts = case
    x = tf.random.stateless_normal(shape, seed=[3, 4])
    reference = tf_keras.layers.LocallyConnected2D(
        5, kernel_size, strides=strides, activation="tanh", bias_initializer="ones"
    )
    layer = plc.PartitionedLocallyConnected2D(
        5, kernel_size, strides, parts, devices, activation="tanh"
    )
    return _compare(reference, layer, x)


def _compare_dense(case, devices):
    units, parts, activation = case
    x = tf.random.stateless_normal([6, 7], seed=[5, 6])
    reference = tf_keras.layers.Dense(
        units, activation=activation, bias_initializer="ones"
    )
    layer = partitioned_dense.PartitionedDense(units, parts, devices, activation)
    return _compare(reference, layer, x)


def _halo_bytes_brute_force(shape, kernel_size, strides, grid, dtype_size=4):
    """Counts, position by position, the input a block reads but does not own."""
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

    def test_server_config(self):
        config = cluster.server_config(3, inter_op_threads=4)
        assert config.device_count["CPU"] == 3
        assert config.inter_op_parallelism_threads == 4

    def test_cpu_device_names(self):
        assert model_parallel.cpu_device_names(2) == ["/device:CPU:0", "/device:CPU:1"]


class TestErrors:
    def test_num_partitions_zero(self):
        with pytest.raises(
            ValueError,
            match=r"`num_partitions` must be >= 1 and <= the output rows\. "
            r"Received: 0",
        ):
            plc.PartitionedLocallyConnected2D(4, 3, num_partitions=0)

    def test_num_partitions_above_output_rows(self):
        layer = plc.PartitionedLocallyConnected2D(4, 3, 1, 8, ["/device:CPU:0"])
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

    def test_dense_num_partitions_above_units(self):
        with pytest.raises(
            ValueError,
            match=r"`num_partitions` must be >= 1 and <= `units` \(10\)\. "
            r"Received: 11",
        ):
            partitioned_dense.PartitionedDense(10, num_partitions=11)

    def test_missing_device(self):
        layer = partitioned_dense.PartitionedDense(4, 2, ["/device:CPU:9"])
        with pytest.raises(ValueError, match=r"`devices` names '/device:CPU:9'"):
            layer.build([2, 3])

    def test_bad_kernel_size(self):
        with pytest.raises(ValueError, match=r"`kernel_size` must be .* \(0, 2\)"):
            plc.PartitionedLocallyConnected2D(4, (0, 2))

    def test_bad_weight_shapes(self):
        layer = partitioned_dense.PartitionedDense(4, 2, ["/device:CPU:0"])
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

    @pytest.mark.parametrize("case", _LC_CASES.values(), ids=_LC_CASES.keys())
    def test_locally_connected_equals_tf_keras(self, case):
        errors = _compare_lc(case, ["/device:CPU:0"])
        assert max(errors.values()) < _TOLERANCE, errors

    @pytest.mark.parametrize("case", _DENSE_CASES.values(), ids=_DENSE_CASES.keys())
    def test_dense_equals_tf_keras(self, case):
        errors = _compare_dense(case, ["/device:CPU:0"])
        assert max(errors.values()) < _TOLERANCE, errors

    def test_seeded_initializer_matches_unpartitioned(self):
        init = tf_keras.initializers.GlorotUniform(seed=7)
        reference = tf_keras.layers.Dense(10, kernel_initializer=init)
        layer = partitioned_dense.PartitionedDense(
            10, 4, ["/device:CPU:0"], kernel_initializer=init
        )
        reference.build([None, 6]), layer.build([None, 6])
        np.testing.assert_array_equal(
            layer.get_unpartitioned_weights()[0], reference.get_weights()[0]
        )

    def test_trains_in_a_keras_model(self):
        model = tf_keras.Sequential(
            [
                tf_keras.Input([9, 8, 3]),
                plc.PartitionedLocallyConnected2D(4, 3, 1, (2, 2), ["/device:CPU:0"]),
                tf_keras.layers.Flatten(),
                partitioned_dense.PartitionedDense(
                    5, 2, ["/device:CPU:0"], activation="softmax"
                ),
            ]
        )
        model.compile("sgd", "sparse_categorical_crossentropy")
        x = tf.random.stateless_normal([8, 9, 8, 3], seed=[7, 7])
        y = tf.zeros([8], tf.int32)
        before = model.evaluate(x, y, verbose=0)
        model.fit(x, y, epochs=3, verbose=0)
        assert model.evaluate(x, y, verbose=0) < before

    def test_config_round_trip(self):
        layer = plc.PartitionedLocallyConnected2D(
            4, (3, 2), 2, (2, 1), activation="relu"
        )
        clone = plc.PartitionedLocallyConnected2D.from_config(layer.get_config())
        assert clone.get_config() == layer.get_config()


# --- Child process: 4 logical CPU devices. ------------------------------------------

_SCOPE = re.compile(r"(?:^|/)(lc|dense)/(partition|halo)_(\d+)(?:_to_\d+)?/")


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


def _placement_report():
    """Where each partition's forward and backward ops ran, by partition."""
    lc = plc.PartitionedLocallyConnected2D(4, 3, 1, 4, name="lc", activation="relu")
    dense = partitioned_dense.PartitionedDense(
        10, 4, name="dense", activation="softmax"
    )
    x = tf.random.stateless_normal([2, 9, 8, 3], seed=[1, 1])

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = dense(tf.reshape(lc(x), [2, -1]))
            loss = tf.reduce_sum(y * y)
        return tape.gradient(loss, [x, *lc.trainable_weights, *dense.trainable_weights])

    seen = {}  # "<layer> <forward|backward> <partition|halo> <k>" -> devices.
    for graph in _run_with_metadata(step, x):
        for node in graph.node:
            match = _SCOPE.search(node.name)
            if not match or node.op in ("_Send", "_Recv", "Const"):
                continue
            pass_ = "backward" if node.name.startswith("gradient_tape/") else "forward"
            key = f"{match[1]} {pass_} {match[2]} {match[3]}"
            seen.setdefault(key, set()).add(_short(node.device))
    return {
        "ops": {k: sorted(v) for k, v in seen.items()},
        "variables": {
            name: [_short(v.device) for v in layer.block_kernels + layer.block_biases]
            for name, layer in (("lc", lc), ("dense", dense))
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
    for graph in graphs:
        for node in graph.node:
            # Control-edge tokens (`GroupCrossDeviceControlEdges`) carry no data.
            if node.op != "_Send" or "GroupCrossDeviceControlEdges" in node.input[0]:
                continue
            source = node.input[0] if ":" in node.input[0] else node.input[0] + ":0"
            kind = next(
                (k for k in ("halo", "scatter", "partition") if f"/{k}" in source),
                source,
            )
            try:
                shape = traced.get_tensor_by_name(source).shape
                size = int(np.prod(shape)) * 4
            except (KeyError, ValueError):
                size = -1  # Not in the traced graph: a Grappler rewrite.
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


def _child_report():
    model_parallel.configure_logical_cpus(_NUM_DEVICES)
    return {
        "devices": model_parallel.replica_devices(),
        "lc": {k: _compare_lc(c, None) for k, c in _LC_CASES.items()},
        "dense": {k: _compare_dense(c, None) for k, c in _DENSE_CASES.items()},
        "placement": _placement_report(),
        "traffic": _halo_traffic_report(),
        "server": _server_report(),
    }


class TestFourDevices:
    @pytest.fixture(scope="class")
    @classmethod
    def report(cls):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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

    @pytest.mark.parametrize("case", _LC_CASES.keys())
    def test_locally_connected_equals_tf_keras(self, report, case):
        assert max(report["lc"][case].values()) < _TOLERANCE, report["lc"][case]

    @pytest.mark.parametrize("case", _DENSE_CASES.keys())
    def test_dense_equals_tf_keras(self, report, case):
        assert max(report["dense"][case].values()) < _TOLERANCE, report["dense"][case]

    def test_variables_on_their_devices(self, report):
        variables = report["placement"]["variables"]
        expected = [f"CPU:{k}" for k in range(_NUM_DEVICES)] * 2  # Kernels, biases.
        assert variables == {"lc": expected, "dense": expected}

    def test_each_partition_runs_on_its_device(self, report):
        ops = report["placement"]["ops"]
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
