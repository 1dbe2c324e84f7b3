"""Kubernetes manifests for a training job: a Kubeflow `TFJob` and its `NetworkPolicy`.

The Kubeflow training operator (`kubeflow.org/v1`, kind `TFJob`) runs one pod per
replica and gives each the `TF_CONFIG` that `tf_distbelief.cluster.source`
reads::

    {"cluster": {"chief": ["<job>-chief-0.<namespace>.svc:2222"],
                 "worker": ["<job>-worker-0.<namespace>.svc:2222", ...],
                 "ps": [...], "evaluator": [...]},
     "task": {"type": "worker", "index": 0}, "environment": "cloud"}

Job names are the replica types lower-cased; each host is the headless service
`<job>-<type>-<index>` the operator creates in the job's namespace, at the port
named `tfjob-port` of the container named `tensorflow` (2222 by default). The
training operator (release 1.9) lists the evaluator too; older tf-operator
releases left it out of the cluster (both forms are accepted). The pods
themselves (one command for every role) are `manifest`'s, as in a `jobset`.

Restart policies follow what each role can survive (`RESTART_POLICIES`). The
job succeeds when the chief does; the operator then deletes the pods still
running (`cleanPodPolicy: Running`): ps and worker servers never exit by
themselves, and an evaluator still at work is stopped too (the chief prints the
final test accuracy itself).

Example::

    config = tfjob.TFJobConfig(image="registry.example.com/tf-distbelief:0.1")
    print(manifest.to_yaml(tfjob.manifests(config.validate())))
"""

from __future__ import annotations

import dataclasses

from tf_distbelief.cluster.k8s import manifest

__all__ = [
    "JOB_NAME_LABEL",
    "REPLICA_TYPES",
    "RESTART_POLICIES",
    "TFJobConfig",
    "manifests",
    "network_policy",
    "pod_template",
    "service_name",
    "tfjob",
]

# Replica types in the order the manifest lists them.
REPLICA_TYPES = ("Chief", "Worker", "PS", "Evaluator")
# The operator reads the task port from the port of this name of the container
# named `manifest.CONTAINER_NAME` (`TFJobDefaultPortName`).
PORT_NAME = "tfjob-port"
# The label the operator puts on every pod of a job, valued the job's name.
JOB_NAME_LABEL = "training.kubeflow.org/job-name"
# Worker and ps pods restart in place (same pod, same service name), and a
# restarted worker rejoins the coordinator. The chief fails the job on a Python
# error (exit 1-127: a bad flag will not fix itself) and is recreated on a
# signal or an out-of-memory kill (exit 128-255), resuming from `--model_dir`.
# A failing evaluator must not fail the training job.
RESTART_POLICIES = {
    "Chief": "ExitCode",
    "Worker": "OnFailure",
    "PS": "OnFailure",
    "Evaluator": "OnFailure",
}


@dataclasses.dataclass
class TFJobConfig(manifest.PodsConfig):
    """A TFJob to generate: `manifest.PodsConfig`'s fields, named for a TFJob.

    `job_name` is the TFJob's name; the services `<job_name>-<type>-<index>`
    must fit in 63 characters. `backoff_limit` counts container restarts, all
    pods together, before the operator fails the job.
    """

    def replica_counts(self) -> dict[str, int]:
        """`{replica type: replicas}` in `REPLICA_TYPES` order."""
        return {_TYPES[role]: n for role, n in self.role_counts().items()}

    def check_derived_names(self) -> None:
        manifest.check_longest_name(
            self.job_name,
            [
                service_name(self.job_name, rtype, count - 1)
                for rtype, count in self.replica_counts().items()
            ],
            "service names",
        )


_TYPES = dict(zip(manifest.ROLES, REPLICA_TYPES))


def service_name(job_name: str, replica_type: str, index: int) -> str:
    """The operator's name of a replica's pod and headless service."""
    return f"{job_name}-{replica_type.lower()}-{index}"


def pod_template(config: TFJobConfig, replica_type: str) -> dict:
    """The pod template (a `V1PodTemplateSpec` as a dict) of one replica type."""
    return {"spec": manifest.pod_spec(config, replica_type.lower(), PORT_NAME)}


def tfjob(config: TFJobConfig) -> dict:
    """The `TFJob` (`kubeflow.org/v1`) document."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": config.job_name, "namespace": config.namespace},
        "spec": {
            "runPolicy": {
                "cleanPodPolicy": "Running",
                "backoffLimit": config.backoff_limit,
            },
            "tfReplicaSpecs": {
                rtype: {
                    "replicas": count,
                    "restartPolicy": RESTART_POLICIES[rtype],
                    "template": pod_template(config, rtype),
                }
                for rtype, count in config.replica_counts().items()
            },
        },
    }


def network_policy(config: TFJobConfig) -> dict:
    """`manifest.network_policy` for the TFJob's pods (`JOB_NAME_LABEL`)."""
    return manifest.network_policy(config, JOB_NAME_LABEL)


def manifests(config: TFJobConfig) -> list[dict]:
    """`[tfjob(config), network_policy(config)]`, `config` validated first."""
    config.validate()
    return [tfjob(config), network_policy(config)]
