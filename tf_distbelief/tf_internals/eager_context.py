"""The eager context and a cluster's remote tasks: functions kept registered
on them while connected, and leaving them before they end.

Used by the strategy when it connects (`keep_remote_functions`, and
`rejoin_on_local_server` after a cluster was left) and by
`cluster.local` when it stops the tasks it started (`disconnect_from_tasks`;
after it, `connected_to_no_remote_task` tells when `coordinator`'s kept
per-worker resources can be dropped).
"""

from __future__ import annotations

import sys
import threading

from absl import logging
from tensorflow.python.eager import context

from tf_distbelief.tf_internals import _shapes


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
    server_def = context.get_server_def()
    addresses = set(addresses)
    if server_def is None or not _names(server_def, addresses):
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
    with _KEPT_LOCK:
        _CONNECTIONS[:] = [kept for kept in _CONNECTIONS if not _names(kept, addresses)]
    context.context().update_server_def(local)
    if not _has_remote_tasks(local):
        _remove_kept_functions()
    return True


def rejoin_on_local_server(cluster_def, job_name: str, task_index: int) -> bool:
    """Moves a context that left its tasks onto a new cluster on its own server.

    TensorFlow's `connect_to_cluster` updates the server def when the cluster
    is unchanged and otherwise sets a new one, which starts a second server
    for the local task: it cannot bind the local task's port while the first
    server (which never shuts down) holds it ("Could not start gRPC server").
    After `disconnect_from_tasks` the context's cluster holds the local task
    only, so a new cluster on the same local address (a `LocalCluster` started
    again on fixed ports) is always "changed". Here the context is updated to
    the new cluster on the server it has, as a task joining a cluster is;
    `connect_to_cluster` then finds the cluster unchanged and updates it in
    turn (with its device filters). Only a context connected to no remote
    task is moved: a live connection's coordinator keeps its cluster.

    Public route checked: `tf.config.experimental_connect_to_cluster` has no
    option to keep the local server; `context.update_server_def` is the
    internal it calls when the cluster is unchanged.

    Args:
      cluster_def: the new cluster (`ClusterSpec.as_cluster_def()`).
      job_name: the local task's job in it (`"chief"`).
      task_index: the local task's index in that job.

    Returns:
      True if the context was moved onto `cluster_def`.
    """
    server_def = context.get_server_def()
    if server_def is None or _has_remote_tasks(server_def):
        return False
    if (server_def.job_name, server_def.task_index) != (job_name, task_index):
        return False
    if server_def.cluster == cluster_def:
        return False
    if _address(server_def.cluster, job_name, task_index) != _address(
        cluster_def, job_name, task_index
    ):
        return False
    joined = type(server_def)()
    joined.CopyFrom(server_def)
    joined.cluster.CopyFrom(cluster_def)
    joined.ClearField("cluster_device_filters")
    context.context().update_server_def(joined)
    return True


def _address(cluster_def, job_name: str, task_index: int) -> str | None:
    """The address of task `task_index` of `job_name` in `cluster_def`, or None."""
    for job in cluster_def.job:
        if job.name == job_name:
            return job.tasks.get(task_index)
    return None


def _names(server_def, addresses) -> bool:
    """Whether `server_def`'s cluster holds a task at one of `addresses`."""
    return any(
        address in addresses
        for job in server_def.cluster.job
        for address in job.tasks.values()
    )


def connected_to_no_remote_task() -> bool:
    """Whether this process's eager context has no task other than its own.

    Then a remote resource dropped is not deleted on any task (TensorFlow
    skips a target it no longer knows): `coordinator`'s kept per-worker
    resources are released then.
    """
    return not _has_remote_tasks(context.get_server_def())


# `Context.remove_function` as TensorFlow defines it, once replaced.
_REMOVE_FUNCTION = None
# Reentrant: a removal is put off inside `AtomicFunction.__del__`, which a
# garbage collection can run in a thread that already holds the lock.
_KEPT_LOCK = threading.RLock()
# (context, function name) pairs whose removal was put off while connected.
_KEPT: list[tuple[object, str]] = []
# The server defs (by identity) that `keep_remote_functions` was called with:
# while the eager context holds one of them, removals are put off. A
# coordinator's failure handler reconnects a worker with the very object it
# was made with, and any other connection (another strategy, a disconnect)
# sets a new one.
_CONNECTIONS: list = []


def keep_remote_functions() -> None:
    """Keeps dropped tf.functions registered while this connection lasts.

    When Python drops a traced function (`AtomicFunction.__del__`, often in a
    garbage collection at an arbitrary point of `fit`), TensorFlow's eager
    context removes it from every remote task it was registered on, one
    blocking gRPC call per task, with the GIL held
    (`EagerContext::MaybeRemoveFunctionRemotely`). On a busy cluster a worker
    answers after seconds, during which the whole chief is frozen (no Python
    thread runs), and a liveness probe may take it for hung. After this call,
    a removal called from `AtomicFunction.__del__` while the eager context's
    server def is the one it holds now (the connection `DistBeliefStrategy`
    just made) is put off: the function stays registered here and on the tasks, with its
    cached kernels (a training job drops a handful per `fit`). The removals
    put off are made once `disconnect_from_tasks` has left every remote
    task, when they are local and immediate.

    Process-wide by nature: the eager context is one per process, and
    `Context.remove_function` is replaced once (what `AtomicFunction.__del__`
    calls). Every other connection of the process (TensorFlow's own
    `ParameterServerStrategy`, a later cluster) gets TensorFlow's removal, as
    does a caller that removes a function by name to add another (graph
    conversions).

    Public route checked: none. `tf.config.experimental_connect_to_cluster`
    has no option for it, and `tf.function` objects have no way to outlive
    their Python owner.
    """
    global _REMOVE_FUNCTION
    server_def = context.get_server_def()
    with _KEPT_LOCK:
        if server_def is not None:
            _CONNECTIONS.append(server_def)
        if _REMOVE_FUNCTION is not None:
            return
        _REMOVE_FUNCTION = context.Context.remove_function
    dropped = _atomic_del().__code__

    def remove_function(ctx, name):
        caller = sys._getframe(1).f_code  # noqa: SLF001 - the caller's code.
        if caller is dropped and _kept_connection(ctx.get_server_def()):
            kept = (ctx, name)
            with _KEPT_LOCK:
                _KEPT.append(kept)
            return
        _REMOVE_FUNCTION(ctx, name)

    remove_function.__doc__ = _REMOVE_FUNCTION.__doc__
    context.Context.remove_function = remove_function


def _kept_connection(server_def) -> bool:
    """Whether `server_def` is one that `keep_remote_functions` was called with."""
    with _KEPT_LOCK:
        return server_def is not None and any(
            server_def is kept for kept in _CONNECTIONS
        )


def kept_function_names() -> list[str]:
    """The functions whose removal is put off now (see `keep_remote_functions`)."""
    with _KEPT_LOCK:
        return [name for _, name in _KEPT]


def _has_remote_tasks(server_def) -> bool:
    """Whether `server_def` (or None: not connected) names a task not its own."""
    if server_def is None:
        return False
    for job in server_def.cluster.job:
        for index in job.tasks:
            if (job.name, index) != (server_def.job_name, server_def.task_index):
                return True
    return False


def _remove_kept_functions() -> None:
    """Makes the removals put off, now that no remote task is connected."""
    with _KEPT_LOCK:
        kept = list(_KEPT)
        del _KEPT[:]
    for ctx, name in kept:
        try:
            _REMOVE_FUNCTION(ctx, name)
        except Exception as e:  # noqa: BLE001 - the others are still removed.
            logging.warning("Could not remove function %s: %s", name, e)


def check() -> None:
    """Fails if an internal above no longer has the shape tf_distbelief needs.

    Raises:
      AssertionError: naming the internal and the TensorFlow and tf_keras
        versions.
    """
    _shapes.expect(
        "eager_context",
        [
            ("eager context.get_server_def", callable(context.get_server_def)),
            (
                "eager Context.update_server_def",
                callable(getattr(context.Context, "update_server_def", None)),
            ),
            (
                "connect_to_cluster updates the server def when the cluster is "
                "unchanged (rejoin_on_local_server)",
                {"update_server_def", "set_server_def"}
                <= _shapes.code_names(_connect_to_cluster()),
            ),
            (
                "eager Context.remove_function(name), called by AtomicFunction.__del__",
                callable(getattr(context.Context, "remove_function", None))
                and "remove_function" in _shapes.code_names(_atomic_del()),
            ),
        ],
    )


def _connect_to_cluster():
    from tensorflow.python.eager import remote

    return remote.connect_to_cluster


def _atomic_del():
    from tensorflow.python.eager.polymorphic_function import atomic_function

    return atomic_function.AtomicFunction.__del__
