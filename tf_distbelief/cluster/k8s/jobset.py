"""Kubernetes: a `JobSet` (kubernetes-sigs/jobset) that runs a training job.

The JobSet (`jobset.x-k8s.io/v1alpha2`) has one replicated job per role
(`manifest.ROLES`: `chief` 1, `worker` N, `ps` P, optional `evaluator` 1), each
Job one pod. With `network.enableDNSHostnames` JobSet's headless service (named
`subdomain`, the job's name) gives each pod its hostname
(`cluster.jobset_pod.hostname`). The manifest sets on every pod the variables
(`jobset_pod.ENV_*`) from which the pod builds its `TF_CONFIG` itself
(`jobset_pod.tf_config`).

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

from tf_distbelief.cluster import jobset_pod
from tf_distbelief.cluster.k8s import manifest

__all__ = [
    "API_VERSION",
    "JOBSET_NAME_LABEL",
    "JOB_INDEX_LABEL",
    "REPLICATED_JOB_LABEL",
    "JobSetConfig",
    "jobset",
    "manifests",
    "network_policy",
    "pod_template",
]

API_VERSION = "jobset.x-k8s.io/v1alpha2"
# Labels (and annotations) JobSet puts on every pod it creates.
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
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
                jobset_pod.hostname(self.job_name, role, count - 1) + _POD_NAME_SUFFIX
                for role, count in self.role_counts().items()
            ],
            "pod names",
        )


def _label_env(name: str, label: str) -> dict:
    return {
        "name": name,
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{label}']"}},
    }


def _env(config: JobSetConfig) -> list[dict]:
    replicas = ",".join(f"{r}:{n}" for r, n in config.role_counts().items())
    return [
        _label_env(jobset_pod.ENV_NAME, JOBSET_NAME_LABEL),
        _label_env(jobset_pod.ENV_REPLICATED_JOB, REPLICATED_JOB_LABEL),
        _label_env(jobset_pod.ENV_JOB_INDEX, JOB_INDEX_LABEL),
        {"name": jobset_pod.ENV_REPLICAS, "value": replicas},
        {"name": jobset_pod.ENV_PORT, "value": str(manifest.PORT)},
        {"name": jobset_pod.ENV_SUBDOMAIN, "value": config.job_name},
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
