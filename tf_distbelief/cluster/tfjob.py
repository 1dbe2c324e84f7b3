"""Kubernetes manifests for a training job: a Kubeflow `TFJob` and its `NetworkPolicy`.

The Kubeflow training operator (`kubeflow.org/v1`, kind `TFJob`) runs one pod per
replica and gives each the `TF_CONFIG` that `tf_distbelief.cluster.config`
reads::

    {"cluster": {"chief": ["<job>-chief-0.<namespace>.svc:2222"],
                 "worker": ["<job>-worker-0.<namespace>.svc:2222", ...],
                 "ps": [...], "evaluator": [...]},
     "task": {"type": "worker", "index": 0}, "environment": "cloud"}

Job names are the replica types lower-cased; each host is the headless service
`<job>-<type>-<index>` the operator creates in the job's namespace, at the port
named `tfjob-port` of the container named `tensorflow` (2222 by default). The
training operator (release 1.9) lists the evaluator too; older tf-operator
releases left it out of the cluster (both forms are accepted). Every pod runs
`python launch/train.py <flags>` from the image's working directory (the
repository, see the `Dockerfile`), so one command serves every role.

Restart policies follow what each role can survive (`RESTART_POLICIES`). The
job succeeds when the chief does; the operator then deletes the pods still
running (`cleanPodPolicy: Running`): ps and worker servers never exit by
themselves, and an evaluator still at work is stopped too (the chief prints the
final test accuracy itself).

Example::

    config = tfjob.TFJobConfig(image="registry.example.com/tf-distbelief:0.1")
    print(tfjob.to_yaml(tfjob.manifests(config.validate())))
"""

from __future__ import annotations

import dataclasses
import re

from tf_distbelief import checks

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
    "to_yaml",
    "train_args",
]

# Replica types in the order the manifest lists them.
REPLICA_TYPES = ("Chief", "Worker", "PS", "Evaluator")
# The operator reads the task port from this container and port name; 2222 is
# its default (`TFJobDefaultContainerName`, `TFJobDefaultPortName`,
# `TFJobDefaultPort`).
CONTAINER_NAME = "tensorflow"
PORT_NAME = "tfjob-port"
PORT = 2222
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
# The mount path of `--pvc` when `model_dir` is not given.
DEFAULT_MODEL_DIR = "/mnt/model_dir"
# The main job of the README: its flags of `launch/train.py` besides the
# cluster's size, which the replica counts give.
DEFAULT_TRAIN_ARGS = ("--model=digits", "--optimizer=adagrad")
# Flags of `launch/train.py` that the manifest sets: the cluster comes from
# TF_CONFIG, `--model_dir` from `model_dir`/`pvc`.
_OWNED_FLAGS = {
    "model_dir": "model_dir (and pvc)",
    "num_workers": "num_workers",
    "num_ps": "num_ps",
}
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
_MAX_LABEL_CHARS = 63


@dataclasses.dataclass
class TFJobConfig:
    """A TFJob to generate; `launch/k8s.py`'s flags derive from these fields.

    Attributes:
      image: the container image (built from the repository's `Dockerfile`).
      job_name: the TFJob's name, a DNS-1035 label; the services
        `<job_name>-<type>-<index>` must fit in 63 characters.
      namespace: the Kubernetes namespace.
      num_workers: Worker replicas (model replicas), >= 1.
      num_ps: PS replicas (parameter-server shards), >= 1.
      evaluator: add an Evaluator replica that evaluates each checkpoint;
        needs a `model_dir` all pods share (`pvc`, or a `scheme://` path).
      gpus_per_worker: `nvidia.com/gpu` limit of each Worker pod, >= 0.
      pvc: a PersistentVolumeClaim mounted at `model_dir` on the Chief and the
        Evaluator (ReadWriteMany when both run), or None.
      model_dir: `--model_dir` of the Chief and the Evaluator; default
        `DEFAULT_MODEL_DIR` with `pvc`, else none.
      train_args: flags of `launch/train.py` for every pod (the model, the
        optimizer, epochs...), except those the manifest sets (`--model_dir`,
        `--num_workers`, `--num_ps`).
      cpu: CPU request of each pod, a Kubernetes quantity (`"1"`, `"500m"`).
      memory: memory request of each pod, a Kubernetes quantity (`"2Gi"`).
      backoff_limit: container restarts, all pods together, before the
        operator fails the job, >= 0.
    """

    image: str = ""
    job_name: str = "tf-distbelief"
    namespace: str = "default"
    # As the README's main job (`--num_workers=2 --num_ps=2`).
    num_workers: int = 2
    num_ps: int = 2
    evaluator: bool = False
    gpus_per_worker: int = 0
    pvc: str | None = None
    model_dir: str | None = None
    train_args: tuple[str, ...] = DEFAULT_TRAIN_ARGS
    cpu: str = "1"
    memory: str = "2Gi"
    backoff_limit: int = 10

    @property
    def effective_model_dir(self) -> str | None:
        """`model_dir`, or `DEFAULT_MODEL_DIR` when only `pvc` is given."""
        if self.model_dir is None and self.pvc:
            return DEFAULT_MODEL_DIR
        return self.model_dir

    def replica_counts(self) -> dict[str, int]:
        """`{replica type: replicas}` in `REPLICA_TYPES` order."""
        counts = {"Chief": 1, "Worker": self.num_workers, "PS": self.num_ps}
        if self.evaluator:
            counts["Evaluator"] = 1
        return counts

    def validate(self) -> TFJobConfig:
        """Checks every field; returns self.

        Raises:
          ValueError: naming the first bad field, the rule, the value and the fix.
        """
        if not self.image:
            raise ValueError(
                "`image` must name a container image built from this repository's "
                "Dockerfile, e.g. registry.example.com/tf-distbelief:0.1. "
                f"Received: {self.image!r}"
            )
        _check_name(
            "job_name",
            self.job_name,
            _DNS_1035_LABEL,
            "a DNS-1035 label: lower-case letters, digits and '-', starting with "
            "a letter",
        )
        longest = max(
            (
                service_name(self.job_name, rtype, count - 1)
                for rtype, count in self.replica_counts().items()
            ),
            key=len,
        )
        if len(longest) > _MAX_LABEL_CHARS:
            raise ValueError(
                f"`job_name` makes service names too long: {longest!r} has "
                f"{len(longest)} characters, at most {_MAX_LABEL_CHARS} are "
                f"allowed. Received: {self.job_name!r}; use a shorter name."
            )
        _check_name(
            "namespace",
            self.namespace,
            _DNS_LABEL,
            "a DNS-1123 label: lower-case letters, digits and '-'",
        )
        for name, low in (
            ("num_workers", 1),
            ("num_ps", 1),
            ("gpus_per_worker", 0),
            ("backoff_limit", 0),
        ):
            value = getattr(self, name)
            if not checks.is_int(value) or value < low:
                raise ValueError(
                    f"`{name}` must be an integer >= {low}. Received: {value!r}"
                )
        for name in ("cpu", "memory"):
            if not _QUANTITY.fullmatch(str(getattr(self, name))):
                raise ValueError(
                    f"`{name}` must be a Kubernetes quantity such as '1', '500m' "
                    f"or '2Gi'. Received: {getattr(self, name)!r}"
                )
        if self.pvc is not None:
            _check_name(
                "pvc",
                self.pvc,
                _DNS_SUBDOMAIN,
                "a PersistentVolumeClaim name: lower-case letters, digits, '-' and '.'",
                max_chars=253,
            )
            if not self.effective_model_dir.startswith("/"):
                raise ValueError(
                    "`model_dir` is where `pvc` is mounted and must be an absolute "
                    f"path. Received: {self.model_dir!r}"
                )
        model_dir = self.effective_model_dir
        if self.evaluator and not (self.pvc or (model_dir and "://" in model_dir)):
            raise ValueError(
                "`evaluator` reads the chief's checkpoints: it needs a `model_dir` "
                "both pods share. Give `pvc` (a ReadWriteMany claim), or a "
                f"`model_dir` such as gs://bucket/run. Received: pvc={self.pvc!r}, "
                f"model_dir={self.model_dir!r}"
            )
        for arg in self.train_args:
            flag = arg.lstrip("-").partition("=")[0]
            if arg.startswith("-") and flag in _OWNED_FLAGS:
                raise ValueError(
                    f"Training flag --{flag} is set by the manifest: use "
                    f"`{_OWNED_FLAGS[flag]}` of TFJobConfig (the same flags of "
                    "launch/k8s.py) instead. Received train_args: "
                    f"{list(self.train_args)}"
                )
        return self


def _check_name(
    field: str, value, pattern: re.Pattern, rule: str, max_chars=_MAX_LABEL_CHARS
) -> None:
    if (
        not isinstance(value, str)
        or not pattern.fullmatch(value)
        or len(value) > max_chars
    ):
        raise ValueError(
            f"`{field}` must be {rule}, at most {max_chars} characters. "
            f"Received: {value!r}"
        )


def service_name(job_name: str, replica_type: str, index: int) -> str:
    """The operator's name of a replica's pod and headless service."""
    return f"{job_name}-{replica_type.lower()}-{index}"


def train_args(config: TFJobConfig, replica_type: str) -> list[str]:
    """The flags of `launch/train.py` in `replica_type`'s pods.

    Every pod gets `config.train_args`; the Chief (which writes checkpoints)
    and the Evaluator (which reads them) also get `--model_dir`.
    """
    args = list(config.train_args)
    model_dir = config.effective_model_dir
    if model_dir and replica_type in ("Chief", "Evaluator"):
        args.append(f"--model_dir={model_dir}")
    return args


def pod_template(config: TFJobConfig, replica_type: str) -> dict:
    """The pod template (a `V1PodTemplateSpec` as a dict) of one replica type."""
    resources = {"requests": {"cpu": str(config.cpu), "memory": str(config.memory)}}
    if replica_type == "Worker" and config.gpus_per_worker > 0:
        resources["limits"] = {"nvidia.com/gpu": str(config.gpus_per_worker)}
    container = {
        "name": CONTAINER_NAME,
        "image": config.image,
        "command": ["python", "launch/train.py"],
        "args": train_args(config, replica_type),
        "ports": [{"name": PORT_NAME, "containerPort": PORT, "protocol": "TCP"}],
        "resources": resources,
    }
    spec = {"containers": [container]}
    if config.pvc and replica_type in ("Chief", "Evaluator"):
        container["volumeMounts"] = [
            {"name": "model-dir", "mountPath": config.effective_model_dir}
        ]
        spec["volumes"] = [
            {"name": "model-dir", "persistentVolumeClaim": {"claimName": config.pvc}}
        ]
    return {"spec": spec}


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
    """A `NetworkPolicy` admitting ingress to the job's pods only from its own.

    The gRPC servers of TensorFlow have no authentication: anything that reaches
    a ps port can read or overwrite the parameters.
    """

    def selector():
        # A fresh dict each time: YAML would write a shared one as an alias.
        return {"matchLabels": {JOB_NAME_LABEL: config.job_name}}

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": f"{config.job_name}-internal",
            "namespace": config.namespace,
        },
        "spec": {
            "podSelector": selector(),
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": selector()}]}],
        },
    }


def manifests(config: TFJobConfig) -> list[dict]:
    """`[tfjob(config), network_policy(config)]`, `config` validated first."""
    config.validate()
    return [tfjob(config), network_policy(config)]


def to_yaml(documents: list[dict]) -> str:
    """The documents as one multi-document YAML text, for `kubectl apply -f -`."""
    import yaml

    return yaml.safe_dump_all(documents, sort_keys=False, default_flow_style=False)
