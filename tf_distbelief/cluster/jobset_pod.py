"""A pod of a JobSet this package generated: its `TF_CONFIG`, from its identity.

Nothing hands a JobSet's pod a `TF_CONFIG`: it builds one (`tf_config`) from
what the manifest (`k8s.jobset`) sets on every pod (`ENV_*`): the JobSet's
name, its replicated job and job index (from the labels JobSet puts on the
pod, through the downward API), every replicated job's size, the port and
the subdomain; and from `JOB_COMPLETION_INDEX`, the pod's index in its Job
(Kubernetes sets it in Indexed Jobs). With `network.enableDNSHostnames`
JobSet's headless service (named `subdomain`, the job's name) gives each pod
the hostname

    <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>

(`hostname`). `source.resolve_cluster` then checks that dict as it checks a
hand-written `TF_CONFIG`. No TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping

from tf_distbelief import checks
from tf_distbelief.cluster import config as config_lib

__all__ = [
    "ENV_JOB_INDEX",
    "ENV_NAME",
    "ENV_POD_INDEX",
    "ENV_PORT",
    "ENV_REPLICAS",
    "ENV_REPLICATED_JOB",
    "ENV_SUBDOMAIN",
    "hostname",
    "in_jobset",
    "tf_config",
]

# What the manifest sets on every pod, read by `tf_config`.
ENV_NAME = "TFDB_JOBSET_NAME"
ENV_REPLICATED_JOB = "TFDB_JOBSET_REPLICATED_JOB"
ENV_JOB_INDEX = "TFDB_JOBSET_JOB_INDEX"
ENV_REPLICAS = "TFDB_JOBSET_REPLICAS"  # e.g. chief:1,worker:2,ps:2
ENV_PORT = "TFDB_JOBSET_PORT"
ENV_SUBDOMAIN = "TFDB_JOBSET_SUBDOMAIN"
# Set by Kubernetes in the pods of an Indexed Job (JobSet's default mode).
ENV_POD_INDEX = "JOB_COMPLETION_INDEX"


def hostname(name: str, replicated_job: str, job_index: int, pod_index=0) -> str:
    """A JobSet pod's hostname, without the subdomain."""
    return f"{name}-{replicated_job}-{job_index}-{pod_index}"


def in_jobset(environ: Mapping[str, str]) -> bool:
    """Whether `environ` is a pod's of a JobSet this package generated."""
    return ENV_REPLICAS in environ


def _get(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name, "").strip()
    if not value:
        raise config_lib.ClusterConfigError(
            f"`{name}` is not set: a pod of the JobSet that launch/k8s.py writes "
            f"has it (--cluster_from=jobset builds TF_CONFIG from {ENV_NAME}, "
            f"{ENV_REPLICATED_JOB}, {ENV_JOB_INDEX}, {ENV_REPLICAS}, {ENV_PORT}, "
            f"{ENV_SUBDOMAIN} and {ENV_POD_INDEX})."
        )
    return value


def _index(environ: Mapping[str, str], name: str) -> int:
    value = _get(environ, name)
    if not value.isdigit():
        raise checks.argument_error(
            name,
            "an integer >= 0",
            value,
            setting=True,
            error=config_lib.ClusterConfigError,
        )
    return int(value)


def _replicas(environ: Mapping[str, str]) -> dict[str, int]:
    text = _get(environ, ENV_REPLICAS)
    replicas = {}
    for item in text.split(","):
        job, _, count = item.strip().partition(":")
        if not job or not count.strip().isdigit() or job in replicas:
            raise config_lib.ClusterConfigError(
                f"`{ENV_REPLICAS}` must list each replicated job once with its "
                f"size, e.g. chief:1,worker:2,ps:2. Received: {text!r}"
            )
        replicas[job] = int(count)
    return replicas


def tf_config(environ: Mapping[str, str]) -> dict:
    """The `TF_CONFIG` dict of a JobSet pod, from its environment (`ENV_*`).

    Raises:
      ClusterConfigError: naming a missing or malformed variable, or one that
        contradicts another (a replicated job or job index outside
        `ENV_REPLICAS`, a pod index other than 0).
    """
    name = _get(environ, ENV_NAME)
    replicated_job = _get(environ, ENV_REPLICATED_JOB)
    job_index = _index(environ, ENV_JOB_INDEX)
    pod_index = _index(environ, ENV_POD_INDEX)
    replicas = _replicas(environ)
    port = _index(environ, ENV_PORT)
    subdomain = environ.get(ENV_SUBDOMAIN, "").strip() or name
    if replicated_job not in replicas:
        raise config_lib.ClusterConfigError(
            f"`{ENV_REPLICATED_JOB}` is {replicated_job!r}, which "
            f"`{ENV_REPLICAS}` ({environ[ENV_REPLICAS]!r}) does not list."
        )
    if job_index >= replicas[replicated_job]:
        raise config_lib.ClusterConfigError(
            f"`{ENV_JOB_INDEX}` is {job_index}, but `{ENV_REPLICAS}` gives "
            f"replicated job `{replicated_job}` {replicas[replicated_job]} "
            "job(s)."
        )
    if pod_index != 0:
        raise config_lib.ClusterConfigError(
            f"`{ENV_POD_INDEX}` is {pod_index}: each Job of this JobSet runs one "
            "pod (index 0), one task."
        )
    cluster = {
        job: [
            f"{hostname(name, job, index)}.{subdomain}:{port}" for index in range(count)
        ]
        for job, count in replicas.items()
    }
    return {
        "cluster": cluster,
        "task": {"type": replicated_job, "index": job_index},
        "environment": "cloud",
    }
