"""`DistBeliefStrategy`: variables on parameter-server shards (Dean et al. 2012, §4).

A subclass of `tf.distribute.experimental.ParameterServerStrategy`: it reuses
TensorFlow's ClusterCoordinator, ShardedVariable and partitioners, and works with
tf_keras (Keras 2) `Model.fit`. What it adds:

* a default partitioner bounded by the number of ps tasks;
* validation of the cluster (`tf_distbelief.cluster`) before it connects;
* a clear error when a Keras 3 model is used with it;
* a hook (`variable_wrapper`) through which Downpour wraps every ps variable:
  `scope()` enters TensorFlow's own scope and then a `tf.variable_creator_scope`
  (the public route to see each variable as the strategy creates it).
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Callable, Iterator

import tensorflow as tf
from absl import logging

from tf_distbelief import checks, errors, partitioning
from tf_distbelief import cluster as cluster_lib
from tf_distbelief.cluster import config as cluster_config
from tf_distbelief.cluster import connect as connect_lib
from tf_distbelief.faults import settings, step_watch
from tf_distbelief.tf_internals import coordinator as tf_coordinator
from tf_distbelief.tf_internals import eager_context

KERAS3_MESSAGE = (
    "DistBeliefStrategy (a ParameterServerStrategy) does not support Keras 3 "
    "(`tf.keras` / `keras` in TensorFlow 2.21): Keras 3 has no parameter-server "
    "training. Build the model with tf_keras (Keras 2): `import tf_keras` and use "
    "`tf_keras.Sequential`, `tf_keras.layers`, ... (or set TF_USE_LEGACY_KERAS=1 "
    "before importing TensorFlow); or build the Keras 3 model outside the "
    "strategy's scope and train it with `tf_distbelief.keras3.fit(model, ..., "
    "strategy=strategy)`."
)


class Keras3Error(errors.DistBeliefError, RuntimeError):
    """A Keras 3 model or optimizer was used with `DistBeliefStrategy`.

    A RuntimeError rather than a TypeError so that Keras 3's deserialization,
    which rewrites TypeErrors, passes the message through unchanged.
    """


def make_partitioner(name: str, num_ps: int, shard_bytes: int):
    """Returns the TensorFlow partitioner that `name` names.

    Args:
      name: one of `partitioning.PARTITIONERS`: `min_size` / `max_size`
        (shards of `shard_bytes`, at most one per ps: `MinSizePartitioner` /
        `MaxSizePartitioner`) or `fixed` (one shard per ps:
        `FixedShardsPartitioner`).
      num_ps: ps tasks, >= 1.
      shard_bytes: the shard size of `min_size` and `max_size`, in bytes.

    Returns:
      A `tf.distribute.experimental.partitioners.Partitioner`.

    Raises:
      ValueError: `name` is not one of `partitioning.PARTITIONERS`.
    """
    partitioners = tf.distribute.experimental.partitioners
    if name == "min_size":
        return partitioners.MinSizePartitioner(shard_bytes, max_shards=num_ps)
    if name == "max_size":
        return partitioners.MaxSizePartitioner(shard_bytes, max_shards=num_ps)
    if name == "fixed":
        return partitioners.FixedShardsPartitioner(num_ps)
    raise checks.argument_error(
        "partitioner",
        f"one of {', '.join(partitioning.PARTITIONERS)}",
        name,
        setting=True,
    )


def default_partitioner(
    num_ps: int, min_shard_bytes: int = partitioning.DEFAULT_MIN_SHARD_BYTES
):
    """Returns the default variable partitioner for `num_ps` ps tasks.

    `tf.distribute.experimental.partitioners.MinSizePartitioner`: a variable is cut
    along its first axis into at most `num_ps` shards of at least
    `min_shard_bytes` each, so small variables (biases) stay whole.

    Args:
      num_ps: number of ps tasks, >= 1.
      min_shard_bytes: the smallest shard, in bytes.

    Returns:
      A `tf.distribute.experimental.partitioners.Partitioner`.
    """
    return make_partitioner("min_size", num_ps, min_shard_bytes)


# How long a new strategy waits for an earlier one's coordinator to go idle:
# creating a worker's per-worker variables and iterators takes well under a
# second; a worker being reconnected takes up to about a minute.
COORDINATOR_IDLE_TIMEOUT_SECS = 60.0
_POLL_SECS = 0.05
# Between two idle looks: a worker thread is back in its queue's `get`
# between two closures for microseconds, not milliseconds.
_IDLE_LOOK_SECS = 0.005


def wait_for_idle_coordinators(
    timeout_secs: float = COORDINATOR_IDLE_TIMEOUT_SECS,
) -> list[str]:
    """Waits until no `ClusterCoordinator` of this process has work in flight.

    An earlier strategy's coordinator may still be creating per-worker
    resources (the caches of a trace that failed, an iterator for a worker
    that got no step) or reconnecting a worker; connecting a new strategy then
    crashed the process. `DistBeliefStrategy` calls this before it connects;
    tests call it between tests.

    Args:
      timeout_secs: the longest wait, in seconds.

    Returns:
      The names of the threads still busy at the deadline (empty when idle);
      a warning names them.
    """
    deadline = time.monotonic() + timeout_secs
    quiet = 0
    while True:
        busy = tf_coordinator.busy_coordinator_threads()
        if not busy:
            quiet += 1
            if quiet == 2:  # Idle at two looks in a row, not between closures.
                return []
            time.sleep(_IDLE_LOOK_SECS)
            continue
        quiet = 0
        if time.monotonic() > deadline:
            logging.warning(
                "ClusterCoordinator threads of an earlier strategy still busy "
                "after %g s: %s; connecting anyway.",
                timeout_secs,
                busy,
            )
            return busy
        time.sleep(_POLL_SECS)


def wait_for_worker_recovery(strategy, timeout_secs: float = 120.0) -> None:
    """Waits until `strategy`'s coordinator has reconnected a failed worker.

    Call it after restarting a killed worker, before connecting a new
    strategy.

    Args:
      strategy: a `DistBeliefStrategy` (or any ParameterServerStrategy).
      timeout_secs: the longest wait, in seconds.

    Raises:
      TimeoutError: still recovering after `timeout_secs` seconds.
    """
    deadline = time.monotonic() + timeout_secs
    while tf_coordinator.worker_recovery_pending(strategy):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"The coordinator was still recovering a worker after "
                f"{timeout_secs:g} s."
            )
        time.sleep(0.1)


def _called_from_keras3() -> bool:
    """True when a Keras 3 (`keras.src`) frame is on the call stack."""
    frame = inspect.currentframe()
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("keras.src") or module == "keras":
            return True
        frame = frame.f_back
    return False


class DistBeliefStrategy(tf.distribute.experimental.ParameterServerStrategy):
    """Parameter-server training with variables sharded over the ps tasks.

    The DistBelief layout (Dean et al. 2012, section 4): parameter-server shards
    (`ps` tasks) each hold a slice of every large variable; model replicas
    (`worker` tasks) compute gradients; the coordinator (`chief`, this process)
    schedules work with `tf.distribute.experimental.coordinator.ClusterCoordinator`.

    Example, on a local cluster:
      ```
      import tf_keras
      import tf_distbelief as tfdb

      with tfdb.cluster.LocalCluster(num_workers=2, num_ps=2) as local:
        strategy = tfdb.DistBeliefStrategy(local.resolver)
        with strategy.scope():
          model = tf_keras.Sequential([tf_keras.layers.Dense(10)])
          model.compile(tfdb.adagrad.Adagrad(0.1), "sparse_categorical_crossentropy")
        model.fit(dataset, epochs=2, steps_per_epoch=100)
      ```

    Args:
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver` of the
        chief; None reads `TF_CONFIG` (see `tf_distbelief.cluster`). The
        `evaluator` job, if any, is left out of the cluster the strategy connects
        to.
      variable_partitioner: any `tf.distribute.experimental.partitioners`
        Partitioner (or a callable `(shape, dtype) -> [num_shards, 1, ...]`);
        None means `default_partitioner(num_ps)`.
      connect_timeout_secs: how long to wait for every ps and worker task to
        accept connections before connecting, in seconds (default 300).
      step_stall_timeout_secs: the longest time, in seconds (finite, > 0), that
        scheduled steps wait with none finishing (every worker gone): then the
        waiting `schedule` or `join` (in `fit`, `evaluate`) raises
        `step_watch.StepStallError` naming the workers not accepting
        connections (`step_watch.StepWatch`; default 600).

    Raises:
      ClusterConnectError: a task did not answer within `connect_timeout_secs`
        (the error names each such task and its address).
      ClusterConfigError: the cluster is invalid, or there is no cluster at all
        (start a `LocalCluster`).
      TypeError: `variable_partitioner` is not callable.
      ValueError: `step_stall_timeout_secs` is not a finite number > 0.
      Keras3Error: a Keras 3 model, optimizer or metric creates variables under
        this strategy's scope, or Keras 3 `fit` distributes a dataset with it.
    """

    def __init__(
        self,
        cluster_resolver=None,
        variable_partitioner=None,
        connect_timeout_secs: float = connect_lib.DEFAULT_CONNECT_TIMEOUT_SECS,
        step_stall_timeout_secs: float = settings.DEFAULT_STEP_STALL_TIMEOUT_SECS,
    ):
        step_watch.check_timeout(step_stall_timeout_secs)
        resolver = cluster_lib.resolve_cluster(cluster_resolver)
        if resolver is None:
            raise cluster_config.ClusterConfigError(
                "No cluster: pass a ClusterResolver (for example "
                "`tf_distbelief.cluster.LocalCluster(...).start().resolver`) or set "
                "`TF_CONFIG`."
            )
        resolver = cluster_lib.training_cluster_resolver(resolver)
        num_ps = len(resolver.cluster_spec().as_dict()["ps"])
        if variable_partitioner is None:
            variable_partitioner = default_partitioner(num_ps)
        elif not callable(variable_partitioner):
            raise checks.argument_error(
                "variable_partitioner",
                "a tf.distribute.experimental.partitioners.Partitioner or a callable "
                "(shape, dtype) -> list of ints",
                variable_partitioner,
            )
        # TensorFlow waits for unreachable tasks silently and without bound.
        connect_lib.wait_for_tasks(
            resolver.cluster_spec().as_dict(), connect_timeout_secs
        )
        # Connecting while an earlier coordinator of this process still works
        # crashed the process (see `wait_for_idle_coordinators`).
        wait_for_idle_coordinators()
        # After a cluster on the same chief address was left (a LocalCluster
        # stopped and started again on fixed ports), TensorFlow would start a
        # second chief server on the port the first one still holds.
        eager_context.rejoin_on_local_server(
            resolver.cluster_spec().as_cluster_def(), "chief", 0
        )
        super().__init__(resolver, variable_partitioner)
        # A tf.function dropped while connected would be removed from every
        # task by a blocking call holding the GIL: seconds on a busy cluster.
        eager_context.keep_remote_functions()
        # The strategy's one coordinator (TensorFlow makes it at the first
        # `scope()`; `fit` asks for it): a per-worker dataset iterator dropped
        # at the end of a `fit` would hold its worker for seconds (tf.data
        # threads) while it is deleted, so this one keeps the newest.
        tf_coordinator.make_keeping_coordinator(self)
        self.variable_wrapper: Callable | None = None
        self.num_ps = num_ps
        workers = resolver.cluster_spec().job_tasks("worker")
        self.num_workers = len(workers)
        # TensorFlow's coordinator waits without a bound for a worker to serve.
        self.step_watch = step_watch.StepWatch(
            self,
            step_stall_timeout_secs,
            {f"/job:worker/task:{i}": address for i, address in enumerate(workers)},
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[DistBeliefStrategy]:
        """TensorFlow's `Strategy.scope()`, seeing each variable it creates.

        Inside TensorFlow's scope, a `tf.variable_creator_scope` is the innermost
        creator: it receives every variable (a `ShardedVariable` when the
        partitioner splits it) after the strategy made it, rejects Keras 3, and
        passes it through `variable_wrapper` (set by Downpour's `enable`).

        Yields:
          This strategy, as `with strategy.scope() as s:` does for TensorFlow's.

        Raises:
          Keras3Error: a Keras 3 model, optimizer or metric creates a variable.
        """
        with super().scope(), tf.variable_creator_scope(self._create_variable):
            yield self

    def _create_variable(self, next_creator, **kwargs):
        if _called_from_keras3():
            raise Keras3Error(KERAS3_MESSAGE)
        variable = next_creator(**kwargs)
        if self.variable_wrapper is not None:
            variable = self.variable_wrapper(variable, **kwargs)
        return variable

    @property
    def ps_devices(self) -> list[str]:
        """Devices of the ps tasks, `/job:ps/replica:0/task:i/device:CPU:0`."""
        return [f"/job:ps/replica:0/task:{i}/device:CPU:0" for i in range(self.num_ps)]

    def experimental_distribute_dataset(self, dataset, options=None):
        if _called_from_keras3():
            raise Keras3Error(KERAS3_MESSAGE)
        return super().experimental_distribute_dataset(dataset, options)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        if _called_from_keras3():
            raise Keras3Error(KERAS3_MESSAGE)
        return super().distribute_datasets_from_function(dataset_fn, options)
