"""Kubernetes: a `JobSet` (kubernetes-sigs/jobset) that runs a training job,
and the `TF_CONFIG` its pods compute from their own identity.

The JobSet (`jobset.x-k8s.io/v1alpha2`) has one replicated job per role
(`manifest.ROLES`: `chief` 1, `worker` N, `ps` P, optional `evaluator` 1), each
Job one pod. With `network.enableDNSHostnames` JobSet's headless service (named
`subdomain`, the job's name) gives each pod the hostname

    <jobset>-<replicatedJob>-<jobIndex>-<podIndex>.<subdomain>

Nothing hands a pod a `TF_CONFIG`: it builds one (`tf_config`) from what the
manifest sets on every pod (`ENV_*`): the JobSet's name, its replicated job
and job index (from the labels JobSet puts on the pod, through the downward
API), every replicated job's size, the port and the subdomain; and from
`JOB_COMPLETION_INDEX`, the pod's index in its Job (Kubernetes sets it in
Indexed Jobs). `config.resolve_cluster` then checks that dict as it checks a
hand-written `TF_CONFIG`.

Restarts follow what each role survives: a worker or ps pod restarts in place
(`restartPolicy: OnFailure`, up to the Job's `backoffLimit`; a deleted pod is
replaced under the same hostname) and a restarted worker rejoins, a restarted
ps is restored by the chief (`--ps_recovery_secs`, from `--model_dir`). The
chief's pod is never restarted in place: a Python error (exit 1-127) fails its
Job, and with it the JobSet (`podFailurePolicy`), while a signal or an
out-of-memory kill (exit 128-255) gets a new chief pod, resuming from
`--model_dir`. An evaluator's failures never fail the JobSet. The JobSet
succeeds when the chief's replicated job does (`successPolicy`); JobSet then
deletes the Jobs still running (ps and worker servers never exit by
themselves).

Example::

    config = jobset.JobSetConfig(image="registry.example.com/tf-distbelief:0.1")
    print(manifest.to_yaml(jobset.manifests(config)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from tf_distbelief.cluster import config as config_lib
from tf_distbelief.cluster import manifest

__all__ = [
    "API_VERSION",
    "ENV_JOB_INDEX",
    "ENV_NAME",
    "ENV_PORT",
    "ENV_REPLICAS",
    "ENV_REPLICATED_JOB",
    "ENV_SUBDOMAIN",
    "JOBSET_NAME_LABEL",
    "JOB_INDEX_LABEL",
    "REPLICATED_JOB_LABEL",
    "JobSetConfig",
    "hostname",
    "in_jobset",
    "jobset",
    "manifests",
    "network_policy",
    "pod_template",
    "tf_config",
]

API_VERSION = "jobset.x-k8s.io/v1alpha2"
# Labels (and annotations) JobSet puts on every pod it creates.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
# What the manifest sets on every pod, read by `tf_config`.
ENV_NAME = "TFDB_JOBSET_NAME"
ENV_REPLICATED_JOB = "TFDB_JOBSET_REPLICATED_JOB"
ENV_JOB_INDEX = "TFDB_JOBSET_JOB_INDEX"
ENV_REPLICAS = "TFDB_JOBSET_REPLICAS"  # e.g. chief:1,worker:2,ps:2
ENV_PORT = "TFDB_JOBSET_PORT"
ENV_SUBDOMAIN = "TFDB_JOBSET_SUBDOMAIN"
# Set by Kubernetes in the pods of an Indexed Job (JobSet's default mode).
ENV_POD_INDEX = "JOB_COMPLETION_INDEX"
PORT_NAME = "grpc"
# A container exit code in 1-127 is the program's own (a Python error, a bad
# flag): restarting will not fix it. 128-255 is a signal (137: the kernel's
# out-of-memory kill, or a node's shutdown).
_PROGRAM_EXIT_CODES = list(range(1, 128))
# An evaluator may fail as often as it likes (Kubernetes' largest value).
_NEVER = 2**31 - 1
# JobSet gives a pod the name `<job>-<podIndex>-<5 random characters>`.
_POD_NAME_SUFFIX = "-abcde"


@dataclasses.dataclass
class JobSetConfig(manifest.PodsConfig):
    """A JobSet to generate: `manifest.PodsConfig`'s fields, named for a JobSet.

    `job_name` is the JobSet's name and its subdomain; its pods' names
    (`<job_name>-<role>-<index>-0-` and 5 random characters) must fit in 63
    characters. `backoff_limit` is each Job's: the restarts of that one pod
    (a new pod for the chief) before its Job fails, and the JobSet with it.
    """

    def check_derived_names(self) -> None:
        manifest.check_longest_name(
            self.job_name,
            [
                hostname(self.job_name, role, count - 1) + _POD_NAME_SUFFIX
                for role, count in self.role_counts().items()
            ],
            "pod names",
        )


def hostname(name: str, replicated_job: str, job_index: int, pod_index=0) -> str:
    """A JobSet pod's hostname, without the subdomain."""
    return f"{name}-{replicated_job}-{job_index}-{pod_index}"


def _label_env(name: str, label: str) -> dict:
    return {
        "name": name,
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}},
    }


def _env(config: JobSetConfig) -> list[dict]:
    replicas = ",".join(f"{r}:{n}" for r, n in config.role_counts().items())
    return [
        _label_env(ENV_NAME, JOBSET_NAME_LABEL),
        _label_env(ENV_REPLICATED_JOB, REPLICATED_JOB_LABEL),
        _label_env(ENV_JOB_INDEX, JOB_INDEX_LABEL),
        {"name": ENV_REPLICAS, "value": replicas},
        {"name": ENV_PORT, "value": str(manifest.PORT)},
        {"name": ENV_SUBDOMAIN, "value": config.job_name},
    ]


def pod_template(config: JobSetConfig, role: str) -> dict:
    """The pod template (a `V1PodTemplateSpec` as a dict) of one role."""
    spec = manifest.pod_spec(config, role, PORT_NAME, env=_env(config))
    spec["restartPolicy"] = "Never" if role == "chief" else "OnFailure"
    return {"spec": spec}


def _job_spec(config: JobSetConfig, role: str) -> dict:
    spec = {
        "parallelism": 1,
        "completions": 1,
        "completionMode": "Indexed",
        "backoffLimit": _NEVER if role == "evaluator" else config.backoff_limit,
        "template": pod_template(config, role),
    }
    if role == "chief":
        spec["podFailurePolicy"] = {
            "rules": [
                # Preemption, eviction, a drained node: not the chief's fault.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": manifest.CONTAINER_NAME,
                        "operator": "In",
                        "values": _PROGRAM_EXIT_CODES,
                    },
                },
            ]
        }
    return spec


def jobset(config: JobSetConfig) -> dict:
    """The `JobSet` (`jobset.x-k8s.io/v1alpha2`) document."""
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": {"name": config.job_name, "namespace": config.namespace},
        "spec": {
            "network": {
                "enableDNSHostnames": True,
                "subdomain": config.job_name,
                # Tasks connect while others still start.
                "publishNotReadyAddresses": True,
            },
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["chief"]},
            "replicatedJobs": [
                {
                    "name": role,
                    "replicas": count,
                    "template": {"spec": _job_spec(config, role)},
                }
                for role, count in config.role_counts().items()
            ],
        },
    }


def network_policy(config: JobSetConfig) -> dict:
    """`manifest.network_policy` for the JobSet's pods (`JOBSET_NAME_LABEL`)."""
    return manifest.network_policy(config, JOBSET_NAME_LABEL)


def manifests(config: JobSetConfig) -> list[dict]:
    """`[jobset(config), network_policy(config)]`, `config` validated first."""
    config.validate()
    return [jobset(config), network_policy(config)]


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
        raise config_lib.ClusterConfigError(
            f"`{name}` must be an integer >= 0. Received: {value!r}"
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
