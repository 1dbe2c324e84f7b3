"""Cluster configuration: `TF_CONFIG`, validation and the resolver.

What a cluster is and the checks it passes, whoever gives it (`source`
reads `TF_CONFIG`, or builds the same dict from a JobSet pod's identity,
`jobset_pod`). It follows TensorFlow's layout for parameter-server training
(`tf.distribute.experimental.ParameterServerStrategy`):

* `chief`: the coordinator (Dean et al. 2012, section 4: it schedules work; in
  Sandblaster it also drives the optimizer). It runs the training program.
* `worker`: a model replica. It runs `tf.distribute.Server` and executes the
  functions the coordinator schedules on it.
* `ps`: a parameter-server shard. It runs `tf.distribute.Server` and holds a slice
  of every sharded variable.
* `evaluator` (optional): a side-car that reads checkpoints; training never
  contacts it, so it is removed from the cluster the strategy connects to.

`TF_CONFIG` forms in use elsewhere are accepted as they are:

* Kubeflow's legacy job name `master` is the chief: it is renamed `chief` here,
  so the resolver, the strategy and the servers only ever see `chief`.
* The evaluator needs no training cluster: its `TF_CONFIG` may list only itself
  (TensorFlow's parameter-server tutorial: `{"cluster": {"evaluator": [...]}}`)
  or leave itself out (older Kubeflow TFJob operators: the evaluator is not part
  of the training cluster).

Addresses are checked before any server starts (`addresses`): ports in 1-65535,
and no machine and port used by two tasks.

With no cluster and no explicit resolver, the local cluster
(`cluster.local`) starts the ps and worker tasks as child processes on free
127.0.0.1 ports.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from tf_distbelief import checks, console, errors
from tf_distbelief.cluster import addresses

ALLOWED_JOBS = ("chief", "worker", "ps", "evaluator")
SERVER_JOBS = ("worker", "ps")
# Other names of a job, accepted in `TF_CONFIG` and renamed: Kubeflow's TFJob
# calls the chief `master` in its older examples (replica type `Master`).
JOB_ALIASES = {"master": "chief"}


class ClusterConfigError(checks.ArgumentError):
    """A cluster configuration (`TF_CONFIG` or a resolver) is invalid.

    An `ArgumentError` (so a `ConfigError` and a `ValueError`), so that
    `checks.argument_error` writes its "must be" messages.
    """


class ClusterStartError(errors.DistBeliefError, RuntimeError):
    """A ps or worker task failed to start or died."""


def _normalize_job(job: str, tasks: Any) -> dict[int, str]:
    """Returns `{task_index: "host:port"}` for a job given as a list or a dict."""
    if isinstance(tasks, (list, tuple)):
        items = enumerate(tasks)
    elif isinstance(tasks, Mapping):
        items = []
        for key, address in tasks.items():
            try:
                index = int(key)
            except (TypeError, ValueError):
                raise ClusterConfigError(
                    f"Task index {key!r} of job `{job}` is not an integer. A sparse "
                    'job is a JSON object with integer keys, e.g. {"1": '
                    '"127.0.0.1:2223"}.'
                ) from None
            if index < 0:
                raise ClusterConfigError(
                    f"Task index {index} of job `{job}` is negative; task indices "
                    "are >= 0."
                )
            items.append((index, address))
    else:
        raise checks.argument_error(
            job,
            "a list of 'host:port' strings or an object mapping task index to "
            "'host:port'",
            tasks,
            prefix="Job",
            error=ClusterConfigError,
        )
    result = {}
    for index, address in items:
        if not isinstance(address, str) or address.rpartition(":")[2] == "":
            raise ClusterConfigError(
                f"Address of task {job}:{index} must be a 'host:port' string. "
                f"Received: {address!r}"
            )
        result[index] = address
    return result


def canonical_job(job: Any) -> Any:
    """Returns `job` with an alias (`JOB_ALIASES`: `master`) renamed."""
    return JOB_ALIASES.get(job, job) if isinstance(job, str) else job


def validate_cluster(
    cluster: Any, task_type: str | None, task_id: int | None
) -> dict[str, dict[int, str]]:
    """Validates a cluster description and the current task.

    Args:
      cluster: `{job: ["host:port", ...]}` or `{job: {"index": "host:port"}}`,
        as in the `cluster` field of `TF_CONFIG`. A `master` job is the chief.
      task_type: this process's job (`chief` or `master`, `worker`, `ps`,
        `evaluator`), or None for a process outside the cluster.
      task_id: this process's index within its job, or None.

    Returns:
      The cluster as `{job: {task_index: "host:port"}}`, jobs without tasks
      dropped, `master` renamed `chief`.

    Raises:
      ClusterConfigError: an unknown job name, both `master` and `chief`, a task
        type not in the cluster, a task index out of range (negative included),
        no `ps` or no `worker` task (allowed for an `evaluator` task only), more
        than one `chief`, a port outside 1-65535, or the same machine and port
        used twice (`addresses.find_address_used_twice`).
    """
    if not isinstance(cluster, Mapping) or not cluster:
        raise ClusterConfigError(
            "The cluster must be a non-empty object mapping job names "
            f"({', '.join(ALLOWED_JOBS)}) to task addresses. Received: {cluster!r}"
        )
    unknown = sorted(
        job for job in cluster if job not in ALLOWED_JOBS and job not in JOB_ALIASES
    )
    if unknown:
        raise ClusterConfigError(
            f"Unknown job name(s) {unknown} in the cluster; allowed job names are "
            f"{', '.join(ALLOWED_JOBS)} (and `master`, Kubeflow's legacy name of "
            "the chief). For example use `worker` and `ps`, not `worker_hosts` "
            "and `ps_hosts`."
        )
    for alias, job in JOB_ALIASES.items():
        if alias in cluster and job in cluster:
            raise ClusterConfigError(
                f"The cluster has both `{alias}` and `{job}` jobs; `{alias}` is "
                f"another name of `{job}`. Keep one of them."
            )
    jobs = {
        canonical_job(job): _normalize_job(job, tasks) for job, tasks in cluster.items()
    }
    jobs = {job: tasks for job, tasks in jobs.items() if tasks}
    task_type = canonical_job(task_type)
    for job in SERVER_JOBS:
        if job not in jobs and task_type != "evaluator":
            raise ClusterConfigError(
                f"The cluster has no `{job}` task; parameter-server training needs "
                f"at least one `ps` and one `worker` (only an `evaluator` task may "
                f"run without them). Jobs received: {sorted(jobs)}"
            )
    for job in ("chief", "evaluator"):
        if len(jobs.get(job, {})) > 1:
            raise ClusterConfigError(
                f"The cluster has {len(jobs[job])} `{job}` tasks; at most 1 is allowed."
            )
    try:
        addresses.find_address_used_twice(
            {
                f"{job}:{index}": address
                for job, tasks in jobs.items()
                for index, address in sorted(tasks.items())
            }
        )
    except addresses.AddressError as e:
        raise ClusterConfigError(str(e)) from None
    if task_type is not None:
        if task_type not in ALLOWED_JOBS:
            raise ClusterConfigError(
                f"Task type {task_type!r} is not a known job; allowed are "
                f"{', '.join(ALLOWED_JOBS)}."
            )
        if not checks.is_int(task_id):
            raise checks.argument_error(
                task_type,
                "an integer",
                task_id,
                prefix="Task index of",
                error=ClusterConfigError,
            )
        if task_type == "evaluator" and task_type not in jobs:
            # Older TFJob operators leave the evaluator out of the cluster.
            return jobs
        if task_type not in jobs:
            raise ClusterConfigError(
                f"Task type `{task_type}` is not in the cluster, whose jobs are "
                f"{sorted(jobs)}."
            )
        if task_id not in jobs[task_type]:
            raise ClusterConfigError(
                f"Task index {task_id} is out of range for job `{task_type}`, "
                f"whose task indices are {sorted(jobs[task_type])}."
            )
    return jobs


class ClusterTask(NamedTuple):
    """One task's validated cluster, as plain values (no TensorFlow).

    Attributes:
      jobs: job name -> {task index: "host:port"} (`validate_cluster`).
      task_type: this task's job (`chief`, `worker`, `ps`, `evaluator`), or
        None.
      task_id: this task's index in its job, or None.
      rpc_layer: the protocol, `"grpc"` unless `TF_CONFIG` names another.
    """

    jobs: dict
    task_type: str | None
    task_id: int | None
    rpc_layer: str


def make_resolver(jobs, task_type, task_id, rpc_layer="grpc"):
    """Returns a `SimpleClusterResolver` of validated `jobs` for one task."""
    import tensorflow as tf

    cluster_spec = tf.train.ClusterSpec(jobs)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster_spec, task_type=task_type, task_id=task_id, rpc_layer=rpc_layer
    )


def resolve_tf_config(config: Any, text: str | None = None):
    """The resolver of a parsed `TF_CONFIG` (`text`: as given, for errors)."""
    return make_resolver(*tf_config_task(config, text))


def tf_config_task(config: Any, text: str | None = None) -> ClusterTask:
    """The validated `ClusterTask` of a parsed `TF_CONFIG` (`text`: as given,
    for errors); raises `ClusterConfigError` as `resolve_cluster`."""
    text = json.dumps(config) if text is None else text
    if not isinstance(config, dict) or "cluster" not in config:
        raise checks.argument_error(
            "TF_CONFIG",
            "a JSON object with a `cluster` field and a `task` field",
            console.shorten(text, 200),
            setting=True,
            error=ClusterConfigError,
        )
    task = config.get("task", {})
    if not isinstance(task, dict):
        raise checks.argument_error(
            "TF_CONFIG",
            '{"type": ..., "index": ...}',
            task,
            setting=True,
            clause="field `task`",
            error=ClusterConfigError,
        )
    task_type = canonical_job(task.get("type"))
    task_id = task.get("index", 0 if task_type else None)
    jobs = validate_cluster(config["cluster"], task_type, task_id)
    return ClusterTask(jobs, task_type, task_id, config.get("rpc_layer", "grpc"))


def training_cluster_resolver(cluster_resolver):
    """Returns `cluster_resolver` without the `evaluator` job (never contacted)."""
    jobs = cluster_resolver.cluster_spec().as_dict()
    jobs.pop("evaluator", None)
    task_type = cluster_resolver.task_type
    if task_type == "evaluator":
        task_type = None
    return make_resolver(
        jobs, task_type, cluster_resolver.task_id, cluster_resolver.rpc_layer
    )
