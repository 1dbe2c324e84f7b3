"""What every Kubernetes manifest of a training job shares, whatever runs it.

`tfjob` (a Kubeflow `TFJob`) and `jobset` (a `JobSet` of kubernetes-sigs)
describe the same pods: one container that runs `python launch/train.py
<flags>` from the image's working directory (the repository, see the
`Dockerfile`), a chief, workers, ps shards and an optional evaluator, the
`--model_dir` volume on the chief and the evaluator, GPUs on the workers, and a
`NetworkPolicy` that admits ingress to the job's pods only from its own pods.
This module holds those parts: the settings both kinds take (`PodsConfig`) with
their checks, the container and pod spec of one role, the policy, and YAML.

Roles are TensorFlow's job names (`ROLES`); each kind names them its own way
(`TFJob`: `Chief`, `Worker`...; `JobSet`: replicated jobs `chief`, `worker`...).
"""

from __future__ import annotations

import dataclasses
import math
import re

from tf_distbelief import checks
from tf_distbelief.cluster import announce
from tf_distbelief.cluster import connect as connect_lib
from tf_distbelief.faults import settings as fault_settings

__all__ = [
    "CONTAINER_NAME",
    "DEFAULT_MODEL_DIR",
    "DEFAULT_TRAIN_ARGS",
    "PORT",
    "ROLES",
    "PodsConfig",
    "check_name",
    "check_longest_name",
    "network_policy",
    "pod_spec",
    "termination_grace_secs",
    "to_yaml",
    "train_args",
]

# The roles in the order the manifests list them.
ROLES = ("chief", "worker", "ps", "evaluator")
# The container of every pod; its task port. The Kubeflow training operator
# reads the port from the container named `tensorflow` (its default
# `TFJobDefaultContainerName`, port 2222, `TFJobDefaultPort`).
CONTAINER_NAME = "tensorflow"
PORT = 2222
# Where the chief listens for its ps and worker tasks' word that they are
# stopping (`cluster.announce`): set on every pod (`announce.PORT_ENV`), so
# that a pod deleted or drained tells the chief before it goes.
ANNOUNCE_PORT = 2223
ANNOUNCE_PORT_NAME = "announce"
# The status probe of a pod's task: `python -m tf_distbelief.cluster.health`,
# a gRPC call to its port with a 3 s deadline (exit 0: it answers).
_PROBE_COMMAND = {
    "command": [
        "python",
        "-m",
        "tf_distbelief.cluster.health",
        f"127.0.0.1:{PORT}",
        "3",
    ]
}
# A pod whose task accepts connections but does not answer the probe three
# times in a row, 10 s apart, is hung (SIGSTOP, a swap storm): the kubelet
# restarts it. A ps or worker's restart is a lost task to the chief; a
# chief's, a new chief that resumes from `--model_dir`. 60 s after start:
# TensorFlow loads first.
_LIVENESS_PROBE = {
    "exec": _PROBE_COMMAND,
    "initialDelaySeconds": 60,
    "periodSeconds": 10,
    "timeoutSeconds": 10,
    "failureThreshold": 3,
}
# The chief's port serves once it has connected to every task, which it
# waits for for up to `--connect_timeout_secs` after TensorFlow loads: its
# liveness probe starts once this startup probe has passed, for which it has
# that long and 120 s more.
_STARTUP_PROBE_PERIOD_SECS = 10
_STARTUP_MARGIN_SECS = 120.0
# After the chief's save at SIGTERM (`--preemption_grace_secs`), the time to
# end its tasks and exit, before the kubelet's SIGKILL.
_STOP_MARGIN_SECS = 5.0
# The mount path of `--pvc` when `model_dir` is not given.
DEFAULT_MODEL_DIR = "/mnt/model_dir"
# The main job of the README: its flags of `launch/train.py` besides the
# cluster's size, which the replica counts give.
DEFAULT_TRAIN_ARGS = ("--model=digits", "--optimizer=adagrad")
# Flags of `launch/train.py` that the manifest sets: the cluster comes from the
# pod's identity, `--model_dir` from `model_dir`/`pvc`.
_OWNED_FLAGS = {
    "model_dir": "model_dir (and pvc)",
    "num_workers": "num_workers",
    "num_ps": "num_ps",
    "cluster_from": "the kind of manifest",
}
# Flags of `launch/train.py` that need `--model_dir` and only the chief reads:
# dropped from the pods without `--model_dir` (workers, ps), whose flag checks
# would refuse them.
_CHIEF_FLAGS = ("checkpoint_every_steps",)
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(
    r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
)
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?")
MAX_LABEL_CHARS = 63


@dataclasses.dataclass
class PodsConfig:
    """The pods of a training job; `launch/k8s.py`'s flags derive from these.

    Attributes:
      image: the container image (built from the repository's `Dockerfile`).
      job_name: the job's name, a DNS-1035 label; the names the kind derives
        from it (pods, services, hostnames) must fit in 63 characters.
      namespace: the Kubernetes namespace.
      num_workers: workers (model replicas), >= 1.
      num_ps: ps tasks (parameter-server shards), >= 1.
      evaluator: add an evaluator that evaluates each checkpoint; needs a
        `model_dir` all pods share (`pvc`, or a `scheme://` path).
      gpus_per_worker: `nvidia.com/gpu` limit of each worker pod, >= 0.
      pvc: a PersistentVolumeClaim mounted at `model_dir` on the chief and the
        evaluator (ReadWriteMany when both run), or None.
      model_dir: `--model_dir` of the chief and the evaluator; default
        `DEFAULT_MODEL_DIR` with `pvc`, else none.
      train_args: flags of `launch/train.py` for every pod (the model, the
        optimizer, epochs...), except those the manifest sets (`--model_dir`,
        `--num_workers`, `--num_ps`, `--cluster_from`).
      cpu: CPU request of each pod, a Kubernetes quantity (`"1"`, `"500m"`).
      memory: memory request of each pod, a Kubernetes quantity (`"2Gi"`).
      backoff_limit: container restarts before the job fails, >= 0 (what
        counts them is the kind's: see `tfjob` and `jobset`).
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

    def role_counts(self) -> dict[str, int]:
        """`{role: replicas}` in `ROLES` order."""
        counts = {"chief": 1, "worker": self.num_workers, "ps": self.num_ps}
        if self.evaluator:
            counts["evaluator"] = 1
        return counts

    def validate(self):
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
        check_name(
            "job_name",
            self.job_name,
            DNS_1035_LABEL,
            "a DNS-1035 label: lower-case letters, digits and '-', starting with "
            "a letter",
        )
        self.check_derived_names()
        check_name(
            "namespace",
            self.namespace,
            DNS_LABEL,
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
                raise checks.argument_error(
                    name, f"an integer >= {low}", value, setting=True
                )
        for name in ("cpu", "memory"):
            if not _QUANTITY.fullmatch(str(getattr(self, name))):
                raise checks.argument_error(
                    name,
                    "a Kubernetes quantity such as '1', '500m' or '2Gi'",
                    getattr(self, name),
                    setting=True,
                )
        self._check_model_dir()
        for arg in self.train_args:
            flag = arg.lstrip("-").partition("=")[0]
            if arg.startswith("-") and flag in _OWNED_FLAGS:
                raise ValueError(
                    f"Training flag --{flag} is set by the manifest: use "
                    f"`{_OWNED_FLAGS[flag]}` of {type(self).__name__} (the same "
                    "flags of launch/k8s.py) instead. Received train_args: "
                    f"{list(self.train_args)}"
                )
        return self

    def check_derived_names(self) -> None:
        """Raises ValueError where a name the kind derives is too long."""

    def _check_model_dir(self) -> None:
        if self.pvc is not None:
            check_name(
                "pvc",
                self.pvc,
                _DNS_SUBDOMAIN,
                "a PersistentVolumeClaim name: lower-case letters, digits, '-' and '.'",
                max_chars=253,
            )
            if not self.effective_model_dir.startswith("/"):
                raise checks.argument_error(
                    "model_dir",
                    "an absolute path",
                    self.model_dir,
                    setting=True,
                    clause="is where `pvc` is mounted and",
                )
        model_dir = self.effective_model_dir
        if self.evaluator and not (self.pvc or (model_dir and "://" in model_dir)):
            raise ValueError(
                "`evaluator` reads the chief's checkpoints: it needs a `model_dir` "
                "both pods share. Give `pvc` (a ReadWriteMany claim), or a "
                f"`model_dir` such as gs://bucket/run. Received: pvc={self.pvc!r}, "
                f"model_dir={self.model_dir!r}"
            )


def check_name(
    field: str, value, pattern: re.Pattern, rule: str, max_chars=MAX_LABEL_CHARS
) -> None:
    """Raises ValueError naming `field` unless `value` matches `pattern`."""
    if (
        not isinstance(value, str)
        or not pattern.fullmatch(value)
        or len(value) > max_chars
    ):
        raise checks.argument_error(
            field, f"{rule}, at most {max_chars} characters", value, setting=True
        )


def check_longest_name(job_name: str, names, what: str) -> None:
    """Raises ValueError naming `job_name` when the longest of `names` (what the
    kind derives from it, `what`: "service names"...) exceeds 63 characters."""
    longest = max(names, key=len)
    if len(longest) > MAX_LABEL_CHARS:
        raise ValueError(
            f"`job_name` makes {what} too long: {longest!r} has "
            f"{len(longest)} characters, at most {MAX_LABEL_CHARS} are "
            f"allowed. Received: {job_name!r}; use a shorter name."
        )


def train_args(config: PodsConfig, role: str) -> list[str]:
    """The flags of `launch/train.py` in `role`'s pods.

    Every pod gets `config.train_args`; the chief (which writes checkpoints)
    and the evaluator (which reads them) also get `--model_dir`, and the
    flags that need it (`--checkpoint_every_steps`) go to them only.
    """
    args = list(config.train_args)
    model_dir = config.effective_model_dir
    if model_dir and role in ("chief", "evaluator"):
        args.append(f"--model_dir={model_dir}")
    else:
        args = [
            arg
            for arg in args
            if not (
                arg.startswith("-")
                and arg.lstrip("-").partition("=")[0] in _CHIEF_FLAGS
            )
        ]
    return args


def chief_startup_probe(config: PodsConfig) -> dict:
    """The chief pod's startup probe: the status probe every 10 s, for up to
    the chief's `--connect_timeout_secs` (from `config.train_args`, else the
    default) and 120 s more, after which a chief whose port never served is
    restarted (it would have failed by itself)."""
    timeout_secs = connect_lib.DEFAULT_CONNECT_TIMEOUT_SECS
    for arg in config.train_args:
        name, _, value = arg.lstrip("-").partition("=")
        if name == "connect_timeout_secs":
            try:
                timeout_secs = float(value)
            except ValueError:
                pass  # `launch/train.py` refuses it, naming the value.
    return {
        "exec": _PROBE_COMMAND,
        "periodSeconds": _STARTUP_PROBE_PERIOD_SECS,
        "timeoutSeconds": 10,
        "failureThreshold": math.ceil(
            (timeout_secs + _STARTUP_MARGIN_SECS) / _STARTUP_PROBE_PERIOD_SECS
        ),
    }


def termination_grace_secs(config: PodsConfig) -> int:
    """The pods' `terminationGracePeriodSeconds`: the chief's save at SIGTERM
    (`--preemption_grace_secs` from `config.train_args`, else the default)
    and `_STOP_MARGIN_SECS` more for ending its tasks, before the kubelet's
    SIGKILL."""
    grace_secs = fault_settings.DEFAULT_PREEMPTION_GRACE_SECS
    for arg in config.train_args:
        name, _, value = arg.lstrip("-").partition("=")
        if name == "preemption_grace_secs":
            try:
                grace_secs = float(value)
            except ValueError:
                pass  # `launch/train.py` refuses it, naming the value.
    if not 0 <= grace_secs < float("inf"):
        grace_secs = fault_settings.DEFAULT_PREEMPTION_GRACE_SECS
    return math.ceil(grace_secs + _STOP_MARGIN_SECS)


def pod_spec(config: PodsConfig, role: str, port_name: str, env=()) -> dict:
    """The pod spec (a `V1PodSpec` as a dict) of one role: its one container,
    listening on `PORT` named `port_name` (the chief also on `ANNOUNCE_PORT`,
    for its tasks' announcements), with environment `env` (a list of
    `V1EnvVar` dicts) and `announce.PORT_ENV`, the `--model_dir` volume where
    the role uses it, and,
    on chief, ps and worker pods, a liveness probe that restarts a hung task
    (the chief's after a startup probe that allows for its connecting). The
    grace period between SIGTERM and SIGKILL is the chief's save's
    (`termination_grace_secs`)."""
    resources = {"requests": {"cpu": str(config.cpu), "memory": str(config.memory)}}
    if role == "worker" and config.gpus_per_worker > 0:
        resources["limits"] = {"nvidia.com/gpu": str(config.gpus_per_worker)}
    container = {
        "name": CONTAINER_NAME,
        "image": config.image,
        "command": ["python", "launch/train.py"],
        "args": train_args(config, role),
        "ports": [{"name": port_name, "containerPort": PORT, "protocol": "TCP"}],
        "resources": resources,
        "env": [*env, {"name": announce.PORT_ENV, "value": str(ANNOUNCE_PORT)}],
    }
    if role == "chief":
        container["ports"].append(
            {
                "name": ANNOUNCE_PORT_NAME,
                "containerPort": ANNOUNCE_PORT,
                "protocol": "TCP",
            }
        )
    if role in ("ps", "worker", "chief"):
        container["livenessProbe"] = dict(_LIVENESS_PROBE)
    if role == "chief":
        container["startupProbe"] = chief_startup_probe(config)
    spec = {
        "containers": [container],
        "terminationGracePeriodSeconds": termination_grace_secs(config),
    }
    if config.pvc and role in ("chief", "evaluator"):
        container["volumeMounts"] = [
            {"name": "model-dir", "mountPath": config.effective_model_dir}
        ]
        spec["volumes"] = [
            {"name": "model-dir", "persistentVolumeClaim": {"claimName": config.pvc}}
        ]
    return spec


def network_policy(config: PodsConfig, job_label: str) -> dict:
    """A `NetworkPolicy` admitting ingress to the job's pods only from its own,
    the pods that carry label `job_label` valued the job's name.

    The gRPC servers of TensorFlow have no authentication: anything that reaches
    a ps port can read or overwrite the parameters.
    """

    def selector():
        # A fresh dict each time: YAML would write a shared one as an alias.
        return {"matchLabels": {job_label: config.job_name}}

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


def to_yaml(documents: list[dict]) -> str:
    """The documents as one multi-document YAML text, for `kubectl apply -f -`.

    Plain YAML for a person to read: no anchors and aliases where a value
    repeats (the probes), and a list of numbers (a failure policy's exit
    codes) on one line.
    """
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data):
            return True

    def sequence(dumper, data):
        numbers = bool(data) and all(isinstance(v, int) for v in data)
        return dumper.represent_sequence(
            "tag:yaml.org,2002:seq", data, flow_style=numbers
        )

    Dumper.add_representer(list, sequence)
    return yaml.dump_all(
        documents, Dumper=Dumper, sort_keys=False, default_flow_style=False, width=4096
    )
