"""A ps or worker task's server process (`tf.distribute.Server`).

`run_server` serves this process's task until SIGTERM (or until the chief has
been gone `chief_gone_secs`), with a line when it serves and one when it
leaves, and why (at SIGTERM, once it has told the chief: `announce`);
`server_config` is the `ConfigProto` every server starts with (CPU devices
for model parallelism, inter-op threads).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time

from tf_distbelief import console
from tf_distbelief.cluster import announce
from tf_distbelief.cluster import config as config_lib
from tf_distbelief.tf_internals import server_runtime

_POLL_SECS = 0.1


def server_config(cpu_devices: int = 1, inter_op_threads: int = 0):
    """Returns the `tf.compat.v1.ConfigProto` a ps or worker server starts with.

    Args:
      cpu_devices: CPU devices the server exposes (`/device:CPU:0..n-1`). Model
        parallelism on CPUs needs more than 1; logical devices configured in the
        process are not seen by a `tf.distribute.Server`.
      inter_op_threads: the inter-op thread pool size, 0 for TensorFlow's default.

    Returns:
      A `tf.compat.v1.ConfigProto`.
    """
    return server_runtime.load().ConfigProto(
        device_count={"CPU": cpu_devices},
        inter_op_parallelism_threads=inter_op_threads,
    )


def _announced(jobs, task: str, address: str) -> str:
    """Tells the chief that `task` is stopping (`announce`); what the
    leaving line adds: the listener's address once the chief answered, else
    nothing (no listener configured, or none answered: the chief ending the
    job itself stops listening first).

    The call runs in a thread waited for at most the call's deadline and a
    second: whatever happens to it, the task exits within its grace.
    """
    to = announce.address_for(jobs)
    if to is None:
        return ""
    answered = []
    call = threading.Thread(
        target=lambda: answered.append(announce.announce(to, task, address, "SIGTERM")),
        name="announce",
        daemon=True,
    )
    call.start()
    call.join(announce.ANNOUNCE_TIMEOUT_SECS + 1.0)
    return f" (announced to the chief at {to})" if answered == [True] else ""


def port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def host_of(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def is_listening(address: str) -> bool:
    try:
        with socket.create_connection((host_of(address), port_of(address)), 0.5):
            return True
    except OSError:
        return False


def run_server(
    cluster_resolver,
    cpu_devices: int = 1,
    chief_gone_secs: float | None = None,
    ready_file: str | None = None,
) -> None:
    """Runs this process's ps or worker task until SIGTERM/SIGINT, then exits 0.

    It prints, flushed, `ps 0 serving at HOST:PORT` once the server listens
    and `ps 0 leaving: SIGTERM` (or `...: the job ended, the chief gone 3 s`)
    as it exits. At SIGTERM it first tells the chief it is stopping, if the
    chief listens for that (`announce`; the line then ends `(announced to the
    chief at HOST:PORT)`). TensorFlow servers never exit by themselves. Besides
    SIGTERM, a task can end when the coordinator is done: with
    `chief_gone_secs` set, the task exits once the chief's port, after having
    been seen listening, has refused connections for that many seconds (a
    restarted chief within that time keeps the cluster).

    Args:
      cluster_resolver: a resolver whose task type is `ps` or `worker`.
      cpu_devices: CPU devices this server exposes (see `server_config`).
      chief_gone_secs: seconds without a listening chief before exiting, or None
        to serve until a signal.
      ready_file: a path written once the server listens (how `LocalCluster`
        knows the task is up), or None.

    Raises:
      ClusterConfigError: the task type is not `ps` or `worker`.
      ClusterStartError: the server could not listen on its address.
    """
    task = config_lib.ClusterTask(
        cluster_resolver.cluster_spec().as_dict(),
        cluster_resolver.task_type,
        cluster_resolver.task_id,
        cluster_resolver.rpc_layer or "grpc",
    )
    serve_task(task, cpu_devices, chief_gone_secs, ready_file)


def serve_task(
    task,
    cpu_devices: int = 1,
    chief_gone_secs: float | None = None,
    ready_file: str | None = None,
    lean: bool = False,
) -> None:
    """`run_server` for a `config.ClusterTask` (`source.resolve_task`).

    Args:
      task: this ps or worker task's `config.ClusterTask`.
      cpu_devices, chief_gone_secs, ready_file: as for `run_server`.
      lean: load TensorFlow's runtime without its Python API
        (`tf_internals.server_runtime`); only for a process that runs nothing
        but this server and has not imported TensorFlow.

    Raises:
      ClusterConfigError: the task type is not `ps` or `worker`.
      ClusterStartError: the server could not listen on its address.
    """
    task_type, task_id = task.task_type, task.task_id
    if task_type not in config_lib.SERVER_JOBS:
        raise config_lib.ClusterConfigError(
            f"Only `ps` and `worker` tasks run a server. Received task type "
            f"{task_type!r}."
        )
    # The evaluator is never contacted (`config.training_cluster_resolver`).
    jobs = {job: tasks for job, tasks in task.jobs.items() if job != "evaluator"}
    with console.quiet_tensorflow_startup():
        runtime = server_runtime.load(lean=lean)
    spec = runtime.ClusterSpec(jobs)
    stop = threading.Event()
    stopped_by = []

    def _on_signal(signum, frame):
        del frame
        stopped_by.append(signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    address = spec.task_address(task_type, task_id)
    try:
        with console.quiet_tensorflow_startup():
            runtime.Server(
                spec,
                job_name=task_type,
                task_index=task_id,
                protocol=task.rpc_layer or "grpc",
                config=server_config(cpu_devices),
                start=True,
            )
    except runtime.UnknownError as e:
        raise config_lib.ClusterStartError(
            f"The {task_type}:{task_id} server could not listen on "
            f"{address}: port {port_of(address)} is already in use or the host is "
            f"not this machine ({e.message})."
        ) from None
    name = f"{task_type} {task_id}"
    console.echo(f"{name} serving at {address}")
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(address)
    chief = spec.as_dict().get("chief")
    chief_address = chief[0] if isinstance(chief, list) and chief else None
    seen_chief = False
    gone_since = None
    while not stop.wait(1.0):
        if chief_gone_secs is None or chief_address is None:
            continue
        if is_listening(chief_address):
            seen_chief, gone_since = True, None
        elif seen_chief:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= chief_gone_secs:
                break
    why = (
        stopped_by[0]
        if stopped_by
        else f"the job ended, the chief gone {chief_gone_secs:g} s"
    )
    if stopped_by and stopped_by[0] == "SIGTERM":
        why += _announced(jobs, f"/job:{task_type}/task:{task_id}", address)
    console.echo(f"{name} leaving: {why}")
    sys.stdout.flush()
    sys.stderr.flush()
    # The gRPC server has no clean shutdown in TF 2; ending the process is the
    # supported way to stop it.
    os._exit(0)
