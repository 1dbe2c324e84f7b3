"""The TensorFlow and tf_keras internals tf_distbelief relies on: the one place.

Everything else in the package uses public APIs only (ruff's SLF001 rule is on
for every other module). Each entry says why it is needed and which public
route was checked and found missing in TensorFlow 2.21 / tf_keras 2.21.
`check()` verifies that each internal still has the shape we rely on;
`tests/test_tf_internals.py` runs it and fails naming the TensorFlow version.
"""

from __future__ import annotations

import sys
import threading

import tensorflow as tf
import tf_keras

# `ParameterServerStrategy` wraps every ps variable in a `CachingVariable` and
# every `per_worker_variable=True` variable in a `PerWorkerVariable`; Downpour
# subclasses the first (reads redirected to a replica's cache) and must leave
# the second alone. Public route checked: `tf.distribute` exports neither class
# (`tf.distribute.experimental.coordinator.PerWorkerValues` is another type).
from tensorflow.python.distribute import ps_values  # noqa: E402

CachingVariable = ps_values.CachingVariable
PerWorkerVariable = ps_values.PerWorkerVariable
# What `ParameterServerStrategy` wraps ps variables in instead when each worker
# has 2+ GPUs (one replica per GPU); Downpour rejects it by name.
AggregatingVariable = ps_values.AggregatingVariable

# The type of a variable split by a partitioner. Public route checked:
# `tf.__internal__.distribute.ShardedVariable` is the only export (no
# `tf.distribute.ShardedVariable`).
ShardedVariable = tf.__internal__.distribute.ShardedVariable

# `tf.Variable`'s own resource variable class, to tell a plain model weight
# from a distributed one. Public route checked: `tf.Variable` is an abstract
# base that distributed variables also subclass.
from tensorflow.python.ops import resource_variable_ops  # noqa: E402

ResourceVariable = resource_variable_ops.ResourceVariable


def replace_shard(variable, index: int, shard) -> None:
    """Replaces shard `index` of a `ShardedVariable` in place.

    Downpour wraps each shard of a sharded ps variable as it is created, before
    Keras or the optimizer holds references to the shards. Public route
    checked: `ShardedVariable.variables` is a read-only copy.
    """
    variable._variables[index] = shard  # noqa: SLF001


def per_worker_values_exist(variable) -> bool:
    """True once a `per_worker_variable=True` variable has its per-worker copies.

    They are created lazily, on the first function the coordinator schedules;
    reading them before (`read_all`) fails. Public route checked: none.
    """
    return variable._per_worker_vars is not None  # noqa: SLF001


def worker_variable(variable, index: int, timeout_secs: float):
    """Worker `index`'s own variable of a `per_worker_variable=True` variable.

    Creates the per-worker copies first if no function was scheduled yet (as
    the first one would), then waits up to `timeout_secs` for worker
    `index`'s. The result is a variable whose handle lives on that worker:
    eager `assign` and `read_value` on the coordinator run there (what
    `downpour.replica_state` checkpoints and restores). Public route checked:
    `PerWorkerVariable.read_all` copies values to the coordinator (no handle
    to write through) and waits without a bound.

    Returns:
      The worker's variable, or None when it is not there within
      `timeout_secs` (the worker lost, its copy not yet rebuilt) or its
      creation failed.
    """
    variable._maybe_create_per_worker_vars()  # noqa: SLF001
    remote = variable._per_worker_vars._values[index]  # noqa: SLF001
    if not remote._status_available_event.wait(timeout_secs):  # noqa: SLF001
        return None
    return remote._values  # noqa: SLF001  (None when aborted or failed)


def clip_gradients(optimizer, grads: list) -> list:
    """Applies a tf_keras optimizer's `clipnorm`/`clipvalue` settings to `grads`.

    Downpour applies a push with the optimizer's per-variable update, outside
    `apply_gradients` (which cannot run inside `tf.cond`, TF_NOTES.md).
    Public route checked: none; `apply_gradients` clips and applies together.
    """
    return optimizer._clip_gradients(grads)  # noqa: SLF001


def update_step(optimizer, gradient, variable):
    """One tf_keras optimizer update of `variable` by `gradient`, in place.

    Public route checked: `update_step` is public but, on a variable created
    under a strategy, tf_keras dispatches it through the distribution context
    (`_distributed_apply_gradients_fn`), which cannot run on a ps shard inside
    a scheduled function's `tf.cond`; `_update_step` is the per-variable rule.
    """
    return optimizer._update_step(gradient, variable)  # noqa: SLF001


def train_counter(model: tf_keras.Model) -> tf.Variable:
    """The step counter that tf_keras `fit` advances (`model._train_counter`).

    A custom `train_function` must advance it as `fit`'s own does. Public route
    checked: none (`model.optimizer.iterations` counts ps updates, not steps).
    """
    return model._train_counter  # noqa: SLF001


def cluster_coordinator(model: tf_keras.Model):
    """The `ClusterCoordinator` tf_keras `fit` created for `model`, or None.

    A custom `train_function` schedules through the same coordinator. Public
    route checked: `ClusterCoordinator(strategy)` returns that same object
    only after `fit` made it; tf_keras keeps it on the model.
    """
    return getattr(model, "_cluster_coordinator", None)


def steps_per_execution(model: tf_keras.Model) -> tf.Variable:
    """The `steps_per_execution` variable of a compiled tf_keras model.

    Public route checked: `compile(steps_per_execution=...)` takes it but no
    public attribute returns it.
    """
    return model._steps_per_execution  # noqa: SLF001


def reduce_per_replica(model: tf_keras.Model, outputs):
    """A step's outputs reduced over replicas, as tf_keras `fit`'s step does.

    `exactly_once` rebuilds tf_keras's scheduled train function (to give each
    step a token) and must return what tf_keras's returns. Public route
    checked: none; `Model.make_train_function` keeps its step function local.
    """
    from tf_keras.src.engine import training as keras_training

    return keras_training.reduce_per_replica(
        outputs,
        model.distribute_strategy,
        reduction=model.distribute_reduction_method,
    )


def busy_coordinator_threads() -> list[str]:
    """Names of `ClusterCoordinator` threads with work in flight.

    A coordinator's worker thread waits in `_CoordinatedClosureQueue.get` when
    idle and its failure handler waits on an event; a thread anywhere else in
    those loops is creating a per-worker resource (variable, iterator),
    running a scheduled function, or reconnecting a worker. A new strategy
    connecting while one is busy crashed the process (SIGSEGV in the eager
    runtime). Public route checked: `ClusterCoordinator.join` waits for
    scheduled functions only, not for resource creation or recovery.
    """
    frames = sys._current_frames()  # noqa: SLF001
    busy = []
    for thread in threading.enumerate():
        frame, stack = frames.get(thread.ident), []
        while frame is not None:
            stack.append(frame.f_code.co_name)
            frame = frame.f_back
        for loop, idle in (("_process_queue", "get"), ("_preemption_handler", "wait")):
            if loop in stack:
                i = stack.index(loop)
                if i == 0 or stack[i - 1] != idle:
                    busy.append(thread.name)
    return busy


def worker_recovery_pending(strategy) -> bool:
    """True while `strategy`'s coordinator is reconnecting a failed worker.

    Its failure handler keeps calling `update_server_def` with this strategy's
    cluster until the worker is back; a new strategy connecting meanwhile is
    reconfigured under it. Public route checked: none.
    """
    coordinator = getattr(strategy, "_cluster_coordinator", None)
    if coordinator is None:
        return False
    handler = coordinator._cluster.failure_handler  # noqa: SLF001
    return handler._cluster_due_for_update_or_finish.is_set()  # noqa: SLF001


class _CountingWatchDog:  # The queue's `WatchDog`, counting finished closures.
    def __init__(self, inner):
        self.inner, self.finished = inner, 0

    def report_closure_done(self):
        self.finished += 1
        self.inner.report_closure_done()

    def __getattr__(self, name):  # `stop`, and any other the queue calls.
        return getattr(self.inner, name)


class CoordinatorProgress:
    """A `ClusterCoordinator`'s closures: finished, waiting; `fail` stops waits.

    For `step_watch`: the queue's `WatchDog` (told of each closure finished by
    `mark_finished`) is wrapped to count them; `fail` sets the error as a failed
    closure's `mark_failed` does (the waiting `schedule` or `join` raises it) and
    cancels the queued closures (frees a `schedule` blocked on a full queue).
    Public route checked: `ClusterCoordinator.done` only says whether all are
    finished. `of(strategy)`: None before the strategy has a coordinator.
    """

    @classmethod
    def of(cls, strategy) -> CoordinatorProgress | None:
        coordinator = getattr(strategy, "_cluster_coordinator", None)
        return None if coordinator is None else cls(coordinator)

    def __init__(self, coordinator):
        self._queue = queue = coordinator._cluster.closure_queue  # noqa: SLF001
        if not isinstance(queue._watchdog, _CountingWatchDog):  # noqa: SLF001
            queue._watchdog = _CountingWatchDog(queue._watchdog)  # noqa: SLF001
        self._counter = queue._watchdog  # noqa: SLF001

    finished = property(lambda self: self._counter.finished)  # Since first watched.

    def waiting(self) -> int:  # Closures queued or running.
        queue = self._queue
        return queue._queue.qsize() + queue.inflight_closure_count  # noqa: SLF001

    def fail(self, error: Exception, finished: int) -> bool:  # False: one finished.
        queue = self._queue
        with queue._queue_lock:  # noqa: SLF001  (`mark_finished` counts under it)
            if self._counter.finished != finished or not self.waiting():
                return False
            if queue._error is None:  # noqa: SLF001
                queue._error = error  # noqa: SLF001
            queue._stop_waiting_condition.notify_all()  # noqa: SLF001
            queue._cancel_all_closures()  # noqa: SLF001
        return True


def wrap_distributed_apply(optimizer, wrapper) -> None:
    """Routes a tf_keras optimizer's cross-replica apply through `wrapper`.

    After this, the optimizer's update of all its variables for one step runs
    `wrapper(apply, distribution, grads_and_vars, **kwargs)`, where `apply` is
    the optimizer's own function (it updates every variable on its ps shard
    and returns the advanced `iterations`). The non-finite guard puts one
    `tf.cond` around it, so that a step with a NaN/inf gradient changes no ps
    variable and no slot. Public route checked: `apply_gradients` inside a
    `tf.cond` fails under ParameterServerStrategy (its `merge_call` in a cond
    branch raises RuntimeError), and wrapping `apply_gradients` can check the
    gradients but not skip the update; `_distributed_apply_gradients_fn` is
    what tf_keras runs in the cross-replica context, where a `tf.cond` around
    the updates works.
    """
    apply = optimizer._distributed_apply_gradients_fn  # noqa: SLF001

    def guarded(distribution, grads_and_vars, **kwargs):
        return wrapper(apply, distribution, grads_and_vars, **kwargs)

    optimizer._distributed_apply_gradients_fn = guarded  # noqa: SLF001


def saved_object_graph(path: str) -> list:
    """The object graph checkpoint `path` was saved from, node by node.

    Returns:
      `[(children, has_value)]` by node id (0 is the root): `children` maps
      each child's name to its node id; `has_value` is true for a variable.

    Restoring matches values to objects by their place in the graph only, so
    a slot of another optimizer at the same place and of the same shape
    (tf_keras SGD's momentums where AdaGrad's accumulators are expected)
    restores silently; the graph's containers (`optimizer/momentums`,
    `optimizer/_accumulators`) tell them apart. Public route checked:
    `tf.train.CheckpointView` gives node ids and matches against objects,
    not the saved graph's names; they are in its object graph proto
    (`_CHECKPOINTABLE_OBJECT_GRAPH`).
    """
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(
        tf.train.load_checkpoint(path).get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH")
    )
    return [
        (
            {child.local_name: child.node_id for child in node.children},
            any(a.name == "VARIABLE_VALUE" for a in node.attributes),
        )
        for node in graph.nodes
    ]


def disconnect_from_tasks(addresses) -> bool:
    """Closes this process's eager contexts on the tasks at `addresses`.

    Call it while the tasks still run, before ending them. Until then the
    eager context of a process that trained on them (the chief) keeps a
    remote context on each task, and at interpreter exit every tf.function
    it ever traced asks each task to remove it: once the tasks are gone,
    each request logs "Failed to remove function remotely ... Connection
    refused" (hundreds of lines). Updating the server def to a cluster
    without those tasks closes their remote contexts while they can still
    answer (TensorFlow's own route for a task leaving a cluster), after which
    a function removal has no remote target. The local task keeps its
    address, so no new server is started.

    Public route checked: `tf.config.experimental_connect_to_cluster` only
    updates the server def when the cluster is unchanged and otherwise sets
    a new one (a new server on a new port); there is no public disconnect;
    `context.update_server_def` is the internal it calls.

    Args:
      addresses: `host:port` of the tasks to disconnect from.

    Returns:
      True if the context was connected to one of them and now is not.
    """
    from tensorflow.python.eager import context

    server_def = context.get_server_def()
    addresses = set(addresses)
    if server_def is None or not any(
        address in addresses
        for job in server_def.cluster.job
        for address in job.tasks.values()
    ):
        return False
    local = type(server_def)()
    local.CopyFrom(server_def)
    del local.cluster.job[:]
    for job in server_def.cluster.job:
        tasks = {
            index: address
            for index, address in job.tasks.items()
            if address not in addresses
            or (job.name, index) == (server_def.job_name, server_def.task_index)
        }
        if tasks:
            local.cluster.job.add(name=job.name).tasks.update(tasks)
    local.ClearField("cluster_device_filters")
    context.context().update_server_def(local)
    return True


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    versions = f"TensorFlow {tf.__version__}, tf_keras {tf_keras.__version__}"
    expectations = [
        ("ps_values.CachingVariable.get", hasattr(CachingVariable, "get")),
        ("ps_values.PerWorkerVariable", isinstance(PerWorkerVariable, type)),
        ("ps_values.AggregatingVariable", isinstance(AggregatingVariable, type)),
        (
            "ShardedVariable._variables",
            "_variables" in ShardedVariable.__init__.__code__.co_names,
        ),
        (
            "PerWorkerVariable._per_worker_vars",
            "_per_worker_vars" in PerWorkerVariable.__init__.__code__.co_names,
        ),
        (
            "PerWorkerVariable._maybe_create_per_worker_vars",
            callable(getattr(PerWorkerVariable, "_maybe_create_per_worker_vars", None)),
        ),
        (
            "RemoteValueImpl._status_available_event, _values",
            {"_status_available_event", "_values"}
            <= set(_remote_value_impl().__init__.__code__.co_names),
        ),
        (
            "tf_keras Optimizer._clip_gradients",
            callable(getattr(tf_keras.optimizers.Optimizer, "_clip_gradients", None)),
        ),
        (
            "tf_keras Optimizer._update_step",
            callable(getattr(tf_keras.optimizers.Optimizer, "_update_step", None)),
        ),
        (
            "tf_keras Optimizer._distributed_apply_gradients_fn",
            "_distributed_apply_gradients_fn"
            in _source_names(tf_keras.optimizers.Optimizer),
        ),
        (
            "tf_keras Model._train_counter",
            "_train_counter" in _source_names(tf_keras.Model),
        ),
        (
            "tf_keras Model._cluster_coordinator",
            "_cluster_coordinator" in _source_names(tf_keras.Model),
        ),
        (
            "tf_keras training.reduce_per_replica",
            callable(getattr(_keras_training(), "reduce_per_replica", None)),
        ),
        (
            "tf_keras Model._steps_per_execution",
            "_steps_per_execution" in _source_names(tf_keras.Model),
        ),
    ]
    from tensorflow.python.eager import context

    expectations += [
        ("eager context.get_server_def", callable(context.get_server_def)),
        (
            "eager Context.update_server_def",
            callable(getattr(context.Context, "update_server_def", None)),
        ),
    ]
    from tensorflow.python.distribute.coordinator import cluster_coordinator as cc

    queue = cc._CoordinatedClosureQueue  # noqa: SLF001
    names = {"_watchdog", "_queue", "_error", "_queue_lock", "_stop_waiting_condition"}
    ok = names <= set(queue.__init__.__code__.co_names)
    ok = ok and callable(getattr(queue, "_cancel_all_closures", None))
    expectations.append(("_CoordinatedClosureQueue internals for step_watch", ok))
    missing = [name for name, ok in expectations if not ok]
    assert not missing, (
        f"TensorFlow internals that tf_distbelief relies on changed shape in "
        f"{versions}: {', '.join(missing)}. See tf_distbelief/_tf_internals.py."
    )


def _remote_value_impl():
    from tensorflow.python.distribute.coordinator import values

    return values.RemoteValueImpl


def _keras_training():
    from tf_keras.src.engine import training as keras_training

    return keras_training


def _source_names(cls: type) -> set[str]:
    """Attribute names the methods of `cls` use (from their code objects)."""
    names = set()
    for attr in vars(cls).values():
        code = getattr(getattr(attr, "__wrapped__", attr), "__code__", None)
        if code is not None:
            names.update(code.co_names)
    return names
