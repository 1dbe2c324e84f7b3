"""Where this task's cluster comes from: `TF_CONFIG`, a JobSet pod's identity,
or none (the local cluster).

This is the only module that reads `TF_CONFIG` from the environment. In a
pod of a JobSet (`k8s.jobset`) the cluster comes from the pod's identity
instead: `jobset_pod.tf_config` builds the same dict. Either goes through
`config`'s checks (`CLUSTER_SOURCES`, `resolve_cluster`'s `cluster_from`).
"""

from __future__ import annotations

import json
import os

from tf_distbelief import checks, console
from tf_distbelief.cluster import config as config_lib
from tf_distbelief.cluster import jobset_pod

__all__ = [
    "CLUSTER_SOURCES",
    "cluster_given",
    "cluster_source",
    "resolve_cluster",
    "resolve_task",
]

_TF_CONFIG = "TF_CONFIG"
# Where a task's cluster comes from (`--cluster_from`): `auto` is `TF_CONFIG`
# when set, else a JobSet's environment when present, else the local cluster.
CLUSTER_SOURCES = ("auto", "tf_config", "jobset")


def cluster_source(cluster_from: str = "auto", environ=None) -> str | None:
    """Where this task's cluster comes from: `"tf_config"`, `"jobset"`, or None
    (the local cluster), for `cluster_from` in `CLUSTER_SOURCES`.

    Raises:
      ClusterConfigError: `cluster_from` is unknown, or `jobset` while
        `TF_CONFIG` is set too (two clusters).
    """
    environ = os.environ if environ is None else environ
    given = bool(environ.get(_TF_CONFIG, "").strip())
    if cluster_from not in CLUSTER_SOURCES:
        raise checks.argument_error(
            "cluster_from",
            f"one of {', '.join(CLUSTER_SOURCES)}",
            cluster_from,
            setting=True,
            error=config_lib.ClusterConfigError,
        )
    if cluster_from == "jobset":
        if given:
            raise config_lib.ClusterConfigError(
                "--cluster_from=jobset builds the cluster from the pod's JobSet "
                "identity, but `TF_CONFIG` is set too: unset `TF_CONFIG`, or "
                "use --cluster_from=tf_config."
            )
        return "jobset"
    if given:
        return "tf_config"
    if cluster_from == "auto" and jobset_pod.in_jobset(environ):
        return "jobset"
    return None


def cluster_given() -> bool:
    """Whether this task is part of a cluster (`TF_CONFIG`, or a JobSet's
    environment), not the local one; for `cluster_from="auto"`."""
    return cluster_source() is not None


def resolve_cluster(cluster_resolver=None, cluster_from: str = "auto"):
    """Returns the validated cluster to train on, or None for a local cluster.

    An explicit `cluster_resolver` wins over `TF_CONFIG`. `TF_CONFIG` is parsed
    here, validated with `validate_cluster`, and turned into a TensorFlow
    `SimpleClusterResolver` (sparse jobs with string keys are normalised, which
    `TFConfigClusterResolver` does not do; a `master` job and task type become
    `chief`; other `TF_CONFIG` fields, such as Kubeflow's `environment`, are
    ignored). In a JobSet's pod (`cluster_source`) `jobset_pod.tf_config` builds
    the same dict from the pod's identity, and it is checked the same way.

    Args:
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`, or
        None to read `TF_CONFIG` (or the JobSet environment).
      cluster_from: one of `CLUSTER_SOURCES` (`--cluster_from`).

    Returns:
      A `tf.distribute.cluster_resolver.ClusterResolver`, or None when neither a
      resolver nor a cluster (`cluster_source`) is given.

    Raises:
      ClusterConfigError: `TF_CONFIG` is not valid JSON, lacks `cluster`, a
        JobSet variable is missing or inconsistent, or the cluster fails
        `validate_cluster`.
    """
    if cluster_resolver is not None:
        spec = cluster_resolver.cluster_spec().as_dict()
        task_type = config_lib.canonical_job(cluster_resolver.task_type)
        task_id = cluster_resolver.task_id
        jobs = config_lib.validate_cluster(spec, task_type, task_id)
        return config_lib.make_resolver(
            jobs, task_type, task_id, cluster_resolver.rpc_layer or "grpc"
        )
    task = resolve_task(cluster_from)
    return None if task is None else config_lib.make_resolver(*task)


def resolve_task(cluster_from: str = "auto") -> config_lib.ClusterTask | None:
    """This task's validated cluster from `TF_CONFIG` or the JobSet environment
    (as `resolve_cluster`), without TensorFlow; None for a local cluster.

    Args:
      cluster_from: one of `CLUSTER_SOURCES` (`--cluster_from`).

    Returns:
      A `ClusterTask`, or None when no cluster is given (`cluster_source`).

    Raises:
      ClusterConfigError: as `resolve_cluster`.
    """
    source = cluster_source(cluster_from)
    if source is None:
        return None
    if source == "jobset":
        config = jobset_pod.tf_config(os.environ)
        text = json.dumps(config)
    else:
        text = os.environ[_TF_CONFIG].strip()
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise config_lib.ClusterConfigError(
                f"`TF_CONFIG` is not valid JSON ({e.msg} at line {e.lineno} column "
                f"{e.colno}). Received: {console.shorten(text, 200)!r}"
            ) from None
    return config_lib.tf_config_task(config, text)
