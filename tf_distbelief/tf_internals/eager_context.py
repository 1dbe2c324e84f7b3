"""The eager context's server def: leaving a cluster's tasks before they end.

Used by `cluster.local` when it stops the tasks it started.
"""

from __future__ import annotations

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
    _shapes.expect(
        "eager_context",
        [
            ("eager context.get_server_def", callable(context.get_server_def)),
            (
                "eager Context.update_server_def",
                callable(getattr(context.Context, "update_server_def", None)),
            ),
        ],
    )
