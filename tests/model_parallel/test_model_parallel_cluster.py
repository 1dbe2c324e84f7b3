"""Model-parallel replicas on the cluster: Downpour over replicas split over devices.

Dean et al. 2012 combine both kinds of parallelism: each Downpour replica (section
4.1) is itself split over several machines (section 3). Here each of 2 workers
exposes 2 CPU devices (the shared `local_cluster`), and each replica of the
locally connected digits model (`tf_distbelief.demos.model_parallel`) puts one
row block of its `PartitionedLocallyConnected2D` layer on each device. The quick
tests build the models in the pytest process with no cluster.

Placement is checked in two ways, since soft placement would silently run ops asked
for a missing `/device:CPU:1` on `CPU:0` (TF_NOTES.md, "Devices"):

* the graph `fit` scheduled: every op of partition 1, forward and backward, asks
  for `/device:CPU:1`, and the coordinator sees that device on every worker, so
  nothing falls back;
* the runtime: a scheduled function returns partition 1's kernel gradient, and the
  tensor handle the coordinator gets back lives on the worker's `CPU:1`.

The same model built with Keras 3 (`tf_distbelief.keras3.layers`) trains by
`keras3.fit` with Downpour segments; the runtime check, the accuracy and the ps
placement run for both (`trained`, parameterised by flavour).
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tf_distbelief import adagrad, downpour, keras3
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import digits, model_parallel, speech
from tf_distbelief.keras3 import variables as keras3_variables
from tf_distbelief.model_parallel import devices as mp

NUM_WORKERS = 2
NUM_PS = 3
DEVICES = mp.cpu_device_names(2)
# tf_keras, Downpour in segments of 4 steps (n_fetch = n_push = 4, no warm
# start), learning rate 0.3: 0.922-0.938 test accuracy after 8 epochs at
# seeds 0-2 (with a warm start and one step per function, as before, 0.927-
# 0.944 in 3 runs); 0.90 leaves margin for the order in which asynchronous
# pushes land.
EPOCHS = 8
MIN_TEST_ACCURACY = 0.90
# One process runs the module, so that each flavour's model (`trained_*`, a
# module fixture of one training) is trained once: handed out test by test,
# both workers trained both.
pytestmark = pytest.mark.xdist_group("model_parallel_cluster")


# --- No cluster: the models --------------------------------------------------


@pytest.mark.parametrize("keras", [2, 3])
def test_speech_mlp_equals_models_speech(keras):
    # Same seeds, same sliced initial values: the same function as the unsplit
    # MLP of the same Keras.
    import keras as keras3

    x = tf.random.stateless_normal([4, speech.NUM_FEATURES], seed=[1, 2])
    split = model_parallel.build_model(
        "speech",
        ["/device:CPU:0"],
        seed=3,
        num_partitions=3,
        speech_hidden_units=8,
        speech_classes=6,
        keras=keras,
    )
    build_whole = speech.build_keras3_model if keras == 3 else speech.build_model
    whole = build_whole(hidden_units=8, num_classes=6, seed=3)
    assert isinstance(split, keras3.Model if keras == 3 else tf_keras.Model)
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
    with pytest.raises(ValueError, match=r"`keras` must be 2 or 3\. Received: 4"):
        model_parallel.build_model("speech", DEVICES, keras=4)


@pytest.mark.parametrize("keras", [2, 3])
def test_job_names_devices_per_replica_a_model_cannot_hold(keras):
    from tf_distbelief import demos, errors, job
    from tf_distbelief.job import runner

    config = job.JobConfig(devices_per_replica=7)
    with pytest.raises(
        errors.ConfigError,
        match=r"`devices_per_replica` must split model 'digits' into partitions "
        r"its layers can hold\. Received: 7 \(.*output rows \(6\)",
    ):
        runner.build_model(
            config, demos.spec("digits", keras=keras), ["/device:CPU:0"] * 7
        )


# --- On the cluster: Downpour, 2 workers x 2 devices --------------------------


def _partition_op_devices(graph, layer_name, k):
    """`{device: [op names]}` of the ops of partition `k` of layer `layer_name`,
    in the graph and in the functions it calls (the body of the loop over a
    segment's steps)."""
    graph_def = graph.as_graph_def()
    nodes = [*graph_def.node]
    for function in graph_def.library.function:
        nodes += function.node_def
    found = {}
    for node in nodes:
        if f"{layer_name}/partition_{k}/" in node.name:
            found.setdefault(node.device, []).append(node.name)
    return found


def _cross_entropy(y, logits):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))


@pytest.fixture(scope="module")
def trained_tf_keras(local_cluster):
    """The tf_keras digits model, split over 2 devices per replica, after
    Downpour `model.fit`."""
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=NUM_WORKERS, num_ps=NUM_PS)
    )
    downpour.enable(strategy)
    with strategy.scope():
        model = model_parallel.build_model("digits", DEVICES, seed=0)
        # Segments of 4 steps between fetches and pushes in each scheduled
        # function (as the Keras 3 fixture): a quarter of the functions.
        model.compile(
            adagrad.Adagrad(0.3),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=4,
        )
        replicas = downpour.install(model, downpour.DownpourConfig(n_fetch=4, n_push=4))
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
    local = model.get_layer("local")
    x, y = tf.constant(x_train[:32]), tf.constant(y_train[:32])

    @tf.function
    def partition_gradients():
        with tf.GradientTape() as tape:
            loss = _cross_entropy(y, model(x, training=True))
        return tape.gradient(loss, local.block_kernels)

    return {
        "model": model,
        "stats": replicas.stats(),
        "strategy": strategy,
        "train_graph": train_graph,
        "test": (x_test, y_test),
        "ps_variables": model.trainable_variables,
        "partition_gradients": partition_gradients,
    }


@pytest.fixture(scope="module")
def trained_keras3(local_cluster):
    """The Keras 3 digits model, split over 2 devices per replica, after
    Downpour `keras3.fit` (segments of 4 steps between fetches and pushes)."""
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=NUM_WORKERS, num_ps=NUM_PS)
    )
    # Outside the scope, once connected: the devices are the workers'.
    model = model_parallel.build_model("digits", DEVICES, seed=0, keras=3)
    (x_train, y_train), (x_test, y_test) = digits.load_data()
    history = keras3.fit(
        model,
        x_train,
        y_train,
        strategy=strategy,
        batch_size=32,
        epochs=EPOCHS,
        steps_per_epoch=100,
        steps_per_execution=4,
        loss=_cross_entropy,
        optimizer=keras3.Adagrad(0.3),
        downpour=downpour.DownpourConfig(n_fetch=4, n_push=4),
        seed=0,
    )
    weights = history.ps_weights
    local = model.get_layer("local")
    kernels = [weights.paths.index(v.path) for v in local.block_kernels]
    x, y = tf.constant(x_train[:32]), tf.constant(y_train[:32])

    @tf.function
    def partition_gradients():
        # As `keras3.fit`'s steps: `stateless_call` on the ps values.
        values = [keras3_variables.read(v) for v in weights.trainable]
        with tf.GradientTape() as tape:
            tape.watch(values)
            logits, _ = model.stateless_call(values, [], x, training=True)
            loss = _cross_entropy(y, logits)
        grads = tape.gradient(loss, values)
        return [grads[i] for i in kernels]

    return {
        "model": model,
        "stats": history.downpour.stats(),
        "strategy": strategy,
        "test": (x_test, y_test),
        "ps_variables": weights.trainable,
        "partition_gradients": partition_gradients,
    }


@pytest.fixture(scope="module", params=["tf_keras", "keras3"])
def trained(request):
    return request.getfixturevalue(f"trained_{request.param}")


@pytest.mark.slow
def test_reaches_test_accuracy(trained):
    stats = trained["stats"]
    assert all(s.steps > 0 and s.pushes > 0 for s in stats), stats
    x_test, y_test = trained["test"]
    # On the coordinator, which has only CPU:0: both partitions soft-place there.
    logits = trained["model"].predict(x_test, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, -1) == y_test))
    assert accuracy >= MIN_TEST_ACCURACY, accuracy


@pytest.mark.slow
def test_variables_live_on_the_ps(trained):
    variables = trained["ps_variables"]
    assert len(variables) == 6  # 2 blocks x (kernel, bias), then the head.
    for shard in (s for v in variables for s in keras3_variables.shards_of(v)):
        device = tf.DeviceSpec.from_string(shard.device)
        assert device.job == "ps", (shard.name, shard.device)


@pytest.mark.slow
def test_fit_graph_runs_each_partition_on_its_device(trained_tf_keras):
    graph = trained_tf_keras["train_graph"]
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
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(
        trained["strategy"]
    )
    results = [coordinator.schedule(trained["partition_gradients"]) for _ in range(4)]
    coordinator.join()
    for result in results:
        # `get()` would copy to the coordinator; the handles before that copy
        # carry the device the worker's runtime placed them on.
        handles = result._get_values()
        specs = [tf.DeviceSpec.from_string(h.device) for h in handles]
        assert {s.job for s in specs} == {"worker"}
        assert [f"/device:CPU:{s.device_index}" for s in specs] == DEVICES


def test_worker_device_names_are_the_workers_cpus_without_gpus(trained_tf_keras):
    """On the connected coordinator: the workers have 2 CPU devices, no GPU."""
    assert not [
        d for d in tf.config.list_logical_devices("GPU") if "/job:worker" in d.name
    ]
    assert mp.worker_device_names(2) == DEVICES
    # More devices than the workers have GPUs of: still CPU names.
    assert mp.worker_device_names(3) == mp.cpu_device_names(3)
    with pytest.raises(ValueError, match=r"`num_devices` must be >= 1"):
        mp.worker_device_names(0)
