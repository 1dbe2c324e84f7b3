"""Prints a Kubernetes manifest (and its NetworkPolicy) for a training job.

  python launch/k8s.py --image=registry.example.com/tf-distbelief:0.1 > job.yaml
  kubectl apply -f job.yaml

--kind=jobset (the default) writes a JobSet (kubernetes-sigs/jobset), whose
pods build their TF_CONFIG from their own identity; --kind=tfjob a Kubeflow
TFJob (the v1 training operator). Training flags for every pod come from
--train_args or after `--`:

  python launch/k8s.py --image=IMAGE --pvc=runs --evaluator -- --model=digits --epochs=5

The manifests are built by `tf_distbelief.cluster.k8s.jobset` and
`tf_distbelief.cluster.k8s.tfjob`; see their docstrings.
"""

import dataclasses
import os
import shlex
import sys

# Run from a checkout, as launch/train.py is.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from tf_distbelief.cluster.k8s import jobset, manifest, tfjob  # noqa: E402

FLAGS = flags.FLAGS
# --kind -> (its configuration class, the function writing its documents).
KINDS = {
    "jobset": (jobset.JobSetConfig, jobset.manifests),
    "tfjob": (tfjob.TFJobConfig, tfjob.manifests),
}


def define_flags() -> None:
    """Defines the flags; defaults from `manifest.PodsConfig`."""
    d = manifest.PodsConfig()
    flags.DEFINE_enum(
        "kind",
        "jobset",
        list(KINDS),
        "jobset: a JobSet (jobset.x-k8s.io/v1alpha2; pods compute their own "
        "TF_CONFIG); tfjob: a Kubeflow TFJob (kubeflow.org/v1).",
    )
    flags.DEFINE_string(
        "image", None, "Container image built from the repository's Dockerfile."
    )
    flags.DEFINE_string(
        "job_name", d.job_name, "JobSet or TFJob name (a DNS-1035 label)."
    )
    flags.DEFINE_string("namespace", d.namespace, "Kubernetes namespace.")
    flags.DEFINE_integer(
        "num_workers", d.num_workers, "Worker replicas.", lower_bound=1
    )
    flags.DEFINE_integer("num_ps", d.num_ps, "PS replicas.", lower_bound=1)
    flags.DEFINE_bool(
        "evaluator",
        d.evaluator,
        "Add an Evaluator replica (needs --pvc or a shared --model_dir).",
    )
    flags.DEFINE_integer(
        "gpus_per_worker",
        d.gpus_per_worker,
        "nvidia.com/gpu limit of each Worker pod.",
        lower_bound=0,
    )
    flags.DEFINE_string(
        "pvc",
        d.pvc,
        "PersistentVolumeClaim mounted at --model_dir on the Chief and Evaluator.",
    )
    flags.DEFINE_string(
        "model_dir",
        d.model_dir,
        f"--model_dir of the Chief and Evaluator (default {manifest.DEFAULT_MODEL_DIR} "
        "with --pvc).",
    )
    flags.DEFINE_string(
        "train_args",
        shlex.join(d.train_args),
        "Flags of launch/train.py for every pod, one string (or give them after `--`).",
    )
    flags.DEFINE_string("cpu", d.cpu, "CPU request of each pod.")
    flags.DEFINE_string("memory", d.memory, "Memory request of each pod.")
    flags.DEFINE_integer(
        "backoff_limit",
        d.backoff_limit,
        "Container restarts before the job fails (TFJob: all pods together; "
        "JobSet: each role's Job).",
        lower_bound=0,
    )


def main(argv):
    after_dashes = argv[1:]
    if after_dashes and FLAGS["train_args"].present:
        sys.exit(
            "Give the training flags either in --train_args or after `--`, not "
            f"both. Received --train_args={FLAGS.train_args!r} and {after_dashes}."
        )
    config_class, build = KINDS[FLAGS.kind]
    fields = {f.name for f in dataclasses.fields(config_class)}
    config = config_class(
        **{name: FLAGS[name].value for name in fields - {"train_args"}},
        train_args=tuple(after_dashes or shlex.split(FLAGS.train_args)),
    )
    try:
        documents = build(config)
    except ValueError as e:
        sys.exit(f"launch/k8s.py: {e}")
    if config.effective_model_dir is None:
        # On stderr: stdout is the manifest, often piped to kubectl.
        sys.stderr.write(
            "launch/k8s.py: no --model_dir or --pvc: a restarted chief or a lost "
            "ps starts the job over (nothing is checkpointed).\n"
        )
    sys.stdout.write(manifest.to_yaml(documents))


if __name__ == "__main__":
    define_flags()
    flags.mark_flag_as_required("image")
    app.run(main)
