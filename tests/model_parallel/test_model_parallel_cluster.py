"""Model-parallel replicas on the cluster: Downpour over replicas split over devices.

Dean et al. 2012 combine both kinds of parallelism: each Downpour replica (section
4.1) is itself split over several machines (section 3). Here each of 2 workers
exposes 2 CPU devices (the shared `local_cluster`), and each replica of the
locally connected digits model (`models.model_parallel`) puts one row block of its
`PartitionedLocallyConnected2D` layer on each device. The quick tests build the
models in the pytest process with no cluster.

Placement is checked in two ways, since soft placement would silently run ops asked
for a missing `/device:CPU:1` on `CPU:0` (TF_NOTES.md, "Devices"):

* the graph `fit` scheduled: every op of partition 1, forward and backward, asks
  for `/device:CPU:1`, and the coordinator sees that device on every worker, so
  nothing falls back;
* the runtime: a scheduled function returns partition 1's kernel gradient, and the
  tensor handle the coordinator gets back lives on the worker's `CPU:1`.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from models import digits, model_parallel, speech
from tf_distbelief import adagrad, downpour
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.fit import training
from tf_distbelief.model_parallel import devices as mp

NUM_WORKERS = 2
NUM_PS = 3
DEVICES = mp.cpu_device_names(2)
# Measured on a loaded 2-core machine (3 runs, 6-10 epochs): 0.927-0.944 test
# accuracy after 8 epochs (0.922 with a learning rate of 0.1); 0.90 leaves margin
# for the order in which asynchronous pushes land.
EPOCHS = 8
MIN_TEST_ACCURACY = 0.90


# --- No cluster: the models --------------------------------------------------


def test_speech_mlp_equals_models_speech():
    # Same seeds, same sliced initial values: the same function as the unsplit MLP.
    x = tf.random.stateless_normal([4, speech.NUM_FEATURES], seed=[1, 2])
    split = model_parallel.build_model(
        "speech",
        ["/device:CPU:0"],
        seed=3,
        num_partitions=3,
        speech_hidden_units=8,
        speech_classes=6,
    )
    whole = speech.build_model(hidden_units=8, num_classes=6, seed=3)
    np.testing.assert_allclose(split(x), whole(x), rtol=0, atol=1e-5)
    assert split.count_params() == whole.count_params()
    assert [layer.num_partitions for layer in split.layers] == [3] * 5


def test_digits_lc_shapes_and_partitions():
    model = model_parallel.build_model("digits", ["/device:CPU:0"] * 2, seed=0)
    (x_train, _), _ = digits.load_data()
    assert model(x_train[:5]).shape == (5, digits.NUM_CLASSES)
    local = model.get_layer("local")
    # 8 x 8 images, 3 x 3 windows: 6 output rows in 2 blocks of 3.
    assert local.row_bounds == [0, 3, 6]
    assert len(local.trainable_weights) == 4  # A kernel and a bias per block.


def test_build_model_errors():
    with pytest.raises(ValueError, match=r"`name` must be one of digits, speech"):
        model_parallel.build_model("embedding", DEVICES)
    with pytest.raises(ValueError, match=r"`devices` must name at least one"):
        model_parallel.build_model("digits", [])
    with pytest.raises(ValueError, match=r"`num_partitions` must be a positive"):
        model_parallel.build_model("speech", DEVICES, num_partitions=0)


# --- On the cluster: Downpour, 2 workers x 2 devices --------------------------


def _partition_op_devices(graph, layer_name, k):
    """`{device: [op names]}` of the ops of partition `k` of layer `layer_name`."""
    found = {}
    for op in graph.get_operations():
        if f"{layer_name}/partition_{k}/" in op.name:
            found.setdefault(op.device, []).append(op.name)
    return found


@pytest.fixture(scope="module")
def trained(local_cluster):
    """The digits model, split over 2 devices per replica, after Downpour `fit`."""
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=NUM_WORKERS, num_ps=NUM_PS)
    )
    downpour.enable(strategy)
    with strategy.scope():
        model = model_parallel.build_model("digits", DEVICES, seed=0)
        model.compile(
            adagrad.Adagrad(0.3),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        replicas = downpour.install(
            model,
            downpour.DownpourConfig(n_fetch=4, n_push=4, warmstart_steps=20),
        )
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train))
        .shuffle(len(x_train), seed=0)
        .repeat()
        .batch(32)
    )
    model.fit(dataset, epochs=EPOCHS, steps_per_epoch=100, verbose=0)
    # The graph `fit` scheduled on the workers: the tf.function that tf_keras's
    # train function (a lambda around `ClusterCoordinator.schedule`) closes over.
    (scheduled,) = [
        cell.cell_contents
        for cell in model.train_function.__closure__
        if isinstance(cell.cell_contents, tf.types.experimental.PolymorphicFunction)
    ]
    (train_graph,) = [f.graph for f in scheduled._list_all_concrete_functions()]
    return {
        "model": model,
        "replicas": replicas,
        "strategy": strategy,
        "train_graph": train_graph,
        "test": (x_test, y_test),
        "train": (x_train, y_train),
    }


@pytest.mark.slow
def test_reaches_test_accuracy(trained):
    stats = trained["replicas"].stats()
    assert all(s.steps > 0 and s.pushes > 0 for s in stats), stats
    x_test, y_test = trained["test"]
    # On the coordinator, which has only CPU:0: both partitions soft-place there.
    accuracy = training.accuracy(trained["model"], x_test, y_test)
    assert accuracy >= MIN_TEST_ACCURACY, accuracy


@pytest.mark.slow
def test_variables_live_on_the_ps(trained):
    variables = trained["model"].trainable_variables
    assert len(variables) == 6  # 2 blocks x (kernel, bias), then the head.
    for v in variables:
        assert tf.DeviceSpec.from_string(v.device).job == "ps", (v.name, v.device)


@pytest.mark.slow
def test_fit_graph_runs_each_partition_on_its_device(trained):
    graph = trained["train_graph"]
    for k, device in enumerate(DEVICES):
        ops = _partition_op_devices(graph, "local", k)
        assert set(ops) == {device}, {d: names[:3] for d, names in ops.items()}
        names = ops[device]
        # Forward and backward (call_on_device puts the gradient there too).
        assert any("gradient" in name.lower() for name in names), names[:5]
        assert any("einsum" in name.lower() for name in names), names[:5]
    # No fall-back: every worker has the device the ops ask for.
    have = {d.name for d in tf.config.list_logical_devices("CPU")}
    for task in range(NUM_WORKERS):
        assert f"/job:worker/replica:0/task:{task}/device:CPU:1" in have


@pytest.mark.slow
def test_partition_1_ran_on_worker_cpu_1(trained):
    model, strategy = trained["model"], trained["strategy"]
    local = model.get_layer("local")
    x_train, y_train = trained["train"]
    x, y = tf.constant(x_train[:32]), tf.constant(y_train[:32])

    @tf.function
    def partition_gradients():
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)
            )
        return tape.gradient(loss, local.block_kernels)

    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    results = [coordinator.schedule(partition_gradients) for _ in range(4)]
    coordinator.join()
    for result in results:
        # `get()` would copy to the coordinator; the handles before that copy
        # carry the device the worker's runtime placed them on.
        handles = result._get_values()
        specs = [tf.DeviceSpec.from_string(h.device) for h in handles]
        assert {s.job for s in specs} == {"worker"}
        assert [f"/device:CPU:{s.device_index}" for s in specs] == DEVICES


def test_worker_device_names_are_the_workers_cpus_without_gpus(trained):
    """On the connected coordinator: the workers have 2 CPU devices, no GPU."""
    assert not [
        d for d in tf.config.list_logical_devices("GPU") if "/job:worker" in d.name
    ]
    assert mp.worker_device_names(2) == DEVICES
    # More devices than the workers have GPUs of: still CPU names.
    assert mp.worker_device_names(3) == mp.cpu_device_names(3)
    with pytest.raises(ValueError, match=r"`num_devices` must be >= 1"):
        mp.worker_device_names(0)
