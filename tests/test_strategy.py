"""DistBeliefStrategy: sharding over ps tasks, embedding lookups, bad input."""

import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.helpers import cluster_bytes
from tests.fixtures.launch import ROOT
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import embedding

PS0 = "/job:ps/replica:0/task:0/device:CPU:0"
PS1 = "/job:ps/replica:0/task:1/device:CPU:0"
VOCAB, DIM = 100_000, 64  # A 25.6 MB float32 table.


@pytest.fixture(scope="module")
def two_ps(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    with strategy.scope():
        model = embedding.build_model(vocab_size=VOCAB, embedding_dim=DIM)
        model.build((None, 8))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    return strategy, coordinator, model


def test_embedding_and_dense_are_sharded_over_two_ps(two_ps):
    _, _, model = two_ps
    table = model.get_layer("embedding").embeddings
    kernel = model.get_layer("logits").kernel
    # Shards go round-robin over the ps tasks (TF's placement), so shard 0 of a
    # variable may sit on either ps; each ps holds exactly one shard.
    assert [v.shape.as_list() for v in table.variables] == [[VOCAB // 2, DIM]] * 2
    assert sorted(v.device for v in table.variables) == [PS0, PS1]
    assert [v.shape.as_list() for v in kernel.variables] == [[DIM // 2, 10]] * 2
    assert sorted(v.device for v in kernel.variables) == [PS0, PS1]


def test_embedding_lookup_moves_only_the_looked_up_rows(two_ps, local_cluster):
    _, coordinator, model = two_ps
    table = model.get_layer("embedding").embeddings
    ids = tf.constant([3, 70_000, 12, 99_999], tf.int64)

    @tf.function
    def lookup():
        return tf.nn.embedding_lookup(table, ids)

    @tf.function
    def read_all():
        return tf.reduce_sum(tf.convert_to_tensor(table))

    coordinator.schedule(lookup).fetch()  # Trace and warm up outside the count.
    coordinator.schedule(read_all).fetch()
    before = cluster_bytes(local_cluster)
    rows = coordinator.schedule(lookup).fetch()
    lookup_bytes = cluster_bytes(local_cluster) - before
    before = cluster_bytes(local_cluster)
    coordinator.schedule(read_all).fetch()
    read_bytes = cluster_bytes(local_cluster) - before

    table_bytes = VOCAB * DIM * 4
    expected = np.concatenate([v.numpy() for v in table.variables])[ids.numpy()]
    np.testing.assert_array_equal(rows, expected)
    assert read_bytes >= table_bytes  # The worker pulled both shards whole.
    assert lookup_bytes < table_bytes / 100, (lookup_bytes, table_bytes)
    # Each shard is read by a gather of its own handle (resource ops run where
    # the resource lives: on that ps), and no op reads a shard whole.
    graph = lookup.get_concrete_function().graph
    captured = {id(internal): external for external, internal in graph.captures}
    gathers = [op for op in graph.get_operations() if op.type == "ResourceGather"]
    gathered = sorted(captured[id(op.inputs[0])].device for op in gathers)
    assert gathered == [PS0, PS1]
    assert not [op for op in graph.get_operations() if op.type == "ReadVariableOp"]


def test_default_partitioner_keeps_small_variables_whole(local_cluster):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=3)
    )
    with strategy.scope():
        big = tf.Variable(tf.zeros([3000, 100]))  # 1.2 MB: 3 shards.
        small = tf.Variable(tf.zeros([10]))
    assert len(big.variables) == 3
    assert [v.shape[0] for v in big.variables] == [1000, 1000, 1000]
    assert not hasattr(small, "variables")
    assert strategy.num_ps == 3 and strategy.num_workers == 1


def test_partitioner_must_be_callable(local_cluster):
    with pytest.raises(
        TypeError, match=r"Argument `variable_partitioner` must be .*Received: 2"
    ):
        strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(), 2)


def test_no_cluster_is_a_clear_error(clean_tf_config):
    with pytest.raises(ValueError, match=r"No cluster: pass a ClusterResolver"):
        strategy_lib.DistBeliefStrategy()


def test_keras3_model_fails_with_a_named_error(local_cluster):
    import keras  # Keras 3, what `tf.keras` is in TF 2.21.

    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=1)
    )
    with pytest.raises(
        strategy_lib.Keras3Error, match=r"does not support Keras 3.*tf_keras"
    ):
        with strategy.scope():
            model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
            model.compile(optimizer="sgd", loss="mse")
    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(strategy_lib.Keras3Error, match=r"does not support Keras 3"):
        with strategy.scope():
            model.compile(optimizer="sgd", loss="mse")
    # tf_keras, the supported Keras, builds under the same scope.
    with strategy.scope():
        tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(4,))]).compile(
            optimizer="sgd", loss="mse"
        )


# In a process of its own: the functions kept stay kept while any cluster of
# the process is connected (the test session's shared cluster would be).
_DROPPED_FUNCTION = """
import gc
import tensorflow as tf
from tensorflow.python.eager import context
from tf_distbelief import cluster, strategy as strategy_lib
from tf_distbelief.tf_internals import coordinator as tf_coordinator
from tf_distbelief.tf_internals import eager_context

local = cluster.LocalCluster(num_workers=1, num_ps=1).start()
strategy = strategy_lib.DistBeliefStrategy(local.resolver)
coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    v = tf.Variable(1.0)
step = tf.function(lambda: v.assign_add(1.0))
name = step.get_concrete_function().name
assert float(coordinator.schedule(step).fetch()) == 2.0
del step
gc.collect()
print("while connected:", context.context().has_function(name),
      name in eager_context.kept_function_names())
# A removal asked for by name (not a dropped function) is made at once.
other = tf.function(lambda: v + 1.0)
other_name = other.get_concrete_function().name
context.context().remove_function(other_name)
print("asked for:", context.context().has_function(other_name))
# A per-worker dataset and its iterator, dropped, are kept until the stop.
per_worker = coordinator.create_per_worker_dataset(
    lambda: tf.data.Dataset.range(8).prefetch(2))
before = tf_coordinator.kept_per_worker_resources()
iterator = iter(per_worker)
print("iterator kept:", tf_coordinator.kept_per_worker_resources() - before)
first = coordinator.schedule(tf.function(lambda it: next(it)), args=(iterator,))
print("read:", int(first.fetch()))
del per_worker, iterator, first
gc.collect()
print("resources kept:", tf_coordinator.kept_per_worker_resources())
for _ in range(tf_coordinator.MAX_KEPT_PER_WORKER_RESOURCES + 1):
    iter(coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(2)))
print("bounded:", tf_coordinator.kept_per_worker_resources()
      == tf_coordinator.MAX_KEPT_PER_WORKER_RESOURCES)
local.stop()
print("after stop:", context.context().has_function(name),
      len(eager_context.kept_function_names()),
      tf_coordinator.kept_per_worker_resources())
"""


def test_dropped_functions_and_iterators_stay_on_the_tasks_until_the_cluster_stops():
    # Removing a function while connected is a blocking call per task with
    # the GIL held (the chief froze for seconds); deleting a dataset iterator
    # holds its worker for seconds. After the stop both are local.
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=ROOT)
    env.pop("TF_CONFIG", None)
    out = subprocess.run(
        [sys.executable, "-c", _DROPPED_FUNCTION],
        check=True,
        env=env,
        timeout=300,
        capture_output=True,
        text=True,
    ).stdout
    assert "while connected: True True" in out, out
    assert "asked for: False" in out, out
    assert "read: 0" in out, out
    assert "iterator kept: 1" in out, out
    assert "resources kept: 1" in out, out
    assert "bounded: True" in out, out
    assert "after stop: False 0 0" in out, out


def test_tensorflows_coordinator_and_strategy_stay_as_tensorflow_defines_them(
    local_cluster,
):
    # The strategy's coordinator keeps per-worker resources and its connection
    # keeps dropped functions; neither reaches TensorFlow's own classes or a
    # stock ParameterServerStrategy connected after it in the same process.
    import gc

    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc
    from tensorflow.python.eager import context

    from tf_distbelief.tf_internals import coordinator as tf_coordinator
    from tf_distbelief.tf_internals import eager_context

    ClusterCoordinator = tf.distribute.experimental.coordinator.ClusterCoordinator
    ours = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=1)
    )
    with ours.scope():
        model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(3,))])
        model.compile(tf_keras.optimizers.SGD(0.1), "mse")
    x = np.ones((16, 3), np.float32)
    model.fit(
        tf.data.Dataset.from_tensor_slices((x, x[:, :1])).repeat().batch(4),
        epochs=1,
        steps_per_epoch=4,
        verbose=0,
    )
    assert type(ClusterCoordinator(ours)) is tf_coordinator.KeepingCoordinator
    assert type(model._cluster_coordinator) is tf_coordinator.KeepingCoordinator
    # ClusterCoordinator's class dictionary holds TensorFlow's own functions.
    for name, value in vars(cc.ClusterCoordinator).items():
        function = getattr(value, "__func__", value)
        if callable(function) and hasattr(function, "__code__"):
            assert function.__module__ == cc.__name__, name
            assert function.__qualname__ == f"ClusterCoordinator.{name}", name

    stock = tf.distribute.experimental.ParameterServerStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=1)
    )
    coordinator = ClusterCoordinator(stock)
    assert type(coordinator) is cc.ClusterCoordinator
    kept = tf_coordinator.kept_per_worker_resources()
    iterator = iter(
        coordinator.create_per_worker_dataset(lambda: tf.data.Dataset.range(4))
    )
    assert tf_coordinator.kept_per_worker_resources() == kept
    del iterator
    with stock.scope():
        v = tf.Variable(1.0)
    step = tf.function(lambda: v.assign_add(1.0))
    name = step.get_concrete_function().name
    assert float(coordinator.schedule(step).fetch()) == 2.0
    assert context.context().has_function(name)
    del step
    gc.collect()
    # Removed at once, as TensorFlow does, not put off.
    assert not context.context().has_function(name)
    assert name not in eager_context.kept_function_names()
