"""Devices for model parallelism: listing, server set-up, placement.

DistBelief splits one model replica over several machines: each partition owns a
slice of every layer's units and only activations on edges that cross a partition
boundary travel between partitions (Dean et al. 2012, section 3). This module holds
the parts that need no layer: which devices a replica can be split over and how to
keep a partition's forward and backward ops on its device. A `tf.distribute.Server`
exposes several CPU devices when started with `tf_distbelief.cluster.server_config`
(`LocalCluster(..., cpu_devices_per_worker=k)`). How sizes split and how many
bytes cross partitions is pure arithmetic, in `model_parallel.partition_math`. The
layers are in `model_parallel.dense` and `model_parallel.locally_connected`
(their weights: `model_parallel.base.PartitionedWeights`).

Example, in a plain process before TensorFlow initialises:

```python
from tf_distbelief.model_parallel import devices as model_parallel

model_parallel.configure_logical_cpus(4)
model_parallel.replica_devices()
# ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3']
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tf_distbelief import checks

__all__ = [
    "assign_devices",
    "call_on_device",
    "configure_logical_cpus",
    "cpu_device_names",
    "replica_devices",
    "worker_device_names",
]


def replica_devices(device_type: str | None = None) -> list[str]:
    """Lists the local devices one model replica can be split over.

    GPUs are preferred when present; otherwise the logical CPU devices
    `/device:CPU:0..k-1` (made by `configure_logical_cpus` in a plain process, or by
    `tf_distbelief.cluster.server_config(cpu_devices=k)` in a server process). Names
    carry no job or task, so that a `tf.device` scope made from them resolves to the
    devices of whichever task runs the function (a worker, under
    `ClusterCoordinator.schedule`).

    Args:
      device_type: `"GPU"`, `"CPU"` or `None`. `None` means GPUs if any, else CPUs.

    Returns:
      Device names such as `"/device:CPU:1"`, sorted by index, without duplicates.

    Raises:
      ValueError: if `device_type` is not `"GPU"`, `"CPU"` or `None`.
    """
    if device_type not in (None, "GPU", "CPU"):
        raise checks.argument_error("device_type", '"GPU", "CPU" or None', device_type)
    types = [device_type] if device_type else ["GPU", "CPU"]
    for kind in types:
        specs = [
            tf.DeviceSpec.from_string(d.name)
            for d in tf.config.list_logical_devices(kind)
        ]
        # A process connected to a cluster also lists other tasks' devices; keep the
        # local ones (no job, or `localhost`) when there are any.
        local = [s for s in specs if s.job in (None, "localhost")] or specs
        indices = sorted({s.device_index for s in local})
        if indices:
            return [f"/device:{kind}:{i}" for i in indices]
    return []


def cpu_device_names(num_devices: int) -> list[str]:
    """Names the CPU devices `/device:CPU:0..num_devices-1` of one replica.

    Unlike `replica_devices`, it does not list this process's devices: on the
    coordinator, which has one CPU, it names the devices of the worker that will run
    the function (`ClusterCoordinator.schedule` resolves names without job or task
    to that worker's devices; start workers with
    `cluster.server_config(cpu_devices=num_devices)`).

    Args:
      num_devices: devices per replica, at least 1.

    Returns:
      `["/device:CPU:0", ..., f"/device:CPU:{num_devices - 1}"]`.

    Raises:
      ValueError: if `num_devices` is below 1.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise checks.argument_error("num_devices", ">= 1", num_devices)
    return [f"/device:CPU:{i}" for i in range(num_devices)]


def worker_device_names(num_devices: int) -> list[str]:
    """The devices of one replica on the workers of the connected cluster.

    Called on the coordinator once its strategy has connected (so that
    `tf.config.list_logical_devices` lists the workers' devices): GPUs
    `/device:GPU:0..num_devices-1` when every worker task has that many,
    otherwise `cpu_device_names(num_devices)` (workers started with
    `cluster.server_config(cpu_devices=num_devices)`). Like `cpu_device_names`,
    the names carry no job or task.

    Args:
      num_devices: devices per replica, at least 1.

    Returns:
      `num_devices` device names, all GPUs or all CPUs.

    Raises:
      ValueError: if `num_devices` is below 1.
    """
    cpus = cpu_device_names(num_devices)  # Checks `num_devices`.
    gpus = {}
    for d in tf.config.list_logical_devices("GPU"):
        spec = tf.DeviceSpec.from_string(d.name)
        if spec.job == "worker":
            gpus.setdefault(spec.task, set()).add(spec.device_index)
    workers = {
        tf.DeviceSpec.from_string(d.name).task
        for d in tf.config.list_logical_devices("CPU")
        if tf.DeviceSpec.from_string(d.name).job == "worker"
    }
    wanted = set(range(num_devices))
    if workers and all(wanted <= gpus.get(task, set()) for task in workers):
        return [f"/device:GPU:{i}" for i in range(num_devices)]
    return cpus


def assign_devices(
    num_partitions: int, devices: Sequence[str] | None = None
) -> list[str]:
    """Chooses the device of each partition, round-robin over `devices`.

    Outside a `tf.distribute` strategy scope each device is checked against this
    process's logical devices, because TensorFlow's soft placement would otherwise
    run ops meant for a missing device silently on `CPU:0`. Under a strategy (e.g.
    the layer is built by a coordinator for its workers) the names are taken as they
    are: they resolve on the task that runs the function.

    Args:
      num_partitions: number of partitions, at least 1.
      devices: device names; `None` means `replica_devices()`. Fewer devices than
        partitions is allowed (partitions then share devices round-robin).

    Returns:
      `num_partitions` device names; partition `k` runs on `devices[k % len]`.

    Raises:
      ValueError: if `devices` is empty or names a device this process lacks.
    """
    if devices is None:
        devices = replica_devices()
    devices = list(devices)
    if not devices:
        raise ValueError(
            "Argument `devices` must name at least one device. Received: []"
        )
    if not tf.distribute.has_strategy():
        have = {
            (s.device_type, s.device_index)
            for s in (
                tf.DeviceSpec.from_string(d.name)
                for d in tf.config.list_logical_devices()
            )
        }
        for name in devices:
            spec = tf.DeviceSpec.from_string(name)
            if (
                spec.job in (None, "localhost")
                and (
                    spec.device_type,
                    spec.device_index or 0,
                )
                not in have
            ):
                raise ValueError(
                    f"Argument `devices` names {name!r}, which this process does "
                    f"not have (it has {replica_devices()}); its ops would run "
                    "silently on another device. Call `configure_logical_cpus` "
                    "first, or start servers with "
                    "`cluster.server_config(cpu_devices=k)`."
                )
    return [devices[k % len(devices)] for k in range(num_partitions)]


def call_on_device(
    device: str, fn: Callable[..., tf.Tensor | list[tf.Tensor]], *args
) -> tf.Tensor | list[tf.Tensor]:
    """Calls `fn(*args)` on `device`, in the forward and in the backward pass.

    A `tf.device` scope places the forward ops only: `tf.GradientTape` creates the
    gradient ops outside it, so the backward pass of every partition would run on
    one device (`CPU:0`). Here the gradient of `fn`, with respect to `args` and to
    the variables it reads, is computed under `tf.device(device)` too.

    `fn` may return a list of tensors. Several outputs made from one input by one
    call (pieces of a block cut for different consumers) also have their gradients
    summed on `device`: cut by separate calls, the input would have several
    consumers, and the tape would add up their gradients in an op outside any
    device scope, placed wherever TensorFlow chooses.

    Args:
      device: device name, e.g. `"/device:CPU:1"`.
      fn: function of tensors returning one tensor or a list of tensors; it may
        read variables.
      *args: tensors.

    Returns:
      `fn(*args)`.
    """

    @tf.custom_gradient
    def on_device(*args):
        with tf.device(device), tf.GradientTape(persistent=True) as tape:
            tape.watch(args)
            outputs = fn(*args)

        def grad(*upstream, variables=None):
            variables = list(variables or [])
            several = isinstance(outputs, (list, tuple))
            with tf.device(device):
                grads = tape.gradient(
                    outputs,
                    [*args, *variables],
                    output_gradients=list(upstream) if several else upstream[0],
                )
            return grads[: len(args)], grads[len(args) :]

        return outputs, grad

    # The decorator's own identity ops, too, belong on `device`: elsewhere, a tensor
    # passed from one partition to another would take a detour through `CPU:0`.
    with tf.device(device):
        return on_device(*args)


def configure_logical_cpus(num_cpu_devices: int) -> None:
    """Splits this process's CPU into `num_cpu_devices` logical devices.

    Works only in a plain process before TensorFlow initialises its runtime (before
    the first op or device listing). It does not add devices to a
    `tf.distribute.Server`: ops there asked for `/device:CPU:1` silently run on
    `CPU:0`; start servers with `tf_distbelief.cluster.server_config`.

    Args:
      num_cpu_devices: number of logical CPU devices, at least 1.

    Raises:
      ValueError: if `num_cpu_devices` is below 1.
      RuntimeError: if TensorFlow has already initialised with another number of
        CPU devices.
    """
    if num_cpu_devices < 1:
        raise checks.argument_error("num_cpu_devices", ">= 1", num_cpu_devices)
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices
        )
    except RuntimeError as e:
        have = len(tf.config.list_logical_devices("CPU"))
        if have != num_cpu_devices:
            raise RuntimeError(
                f"Cannot make {num_cpu_devices} logical CPU devices: TensorFlow has "
                f"already initialised with {have}. Call `configure_logical_cpus` "
                "before any TensorFlow op runs, or run in a child process."
            ) from e
