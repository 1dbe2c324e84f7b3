"""Kubernetes: the TFJob manifest of `launch/k8s.py --kind=tfjob`.

The pod templates are checked against the official `kubernetes` client's models
(field names and types); the slow test runs every replica the manifest
describes as a local process with the `TF_CONFIG` the Kubeflow training
operator would give its pod.
"""

import json
import re
import signal
import subprocess
import sys
import uuid

import portpicker
import pytest

from tests.fixtures.k8s import FULL_SETTINGS, IMAGE, README_COMMAND, manifest, run_k8s
from tests.fixtures.k8s import round_trip as _round_trip
from tests.fixtures.launch import ROOT, _accuracy, _env, _wait_no_marked
from tf_distbelief.cluster.k8s import tfjob

pytest.importorskip("kubernetes.client")


def _k8s(*args):
    return run_k8s("--kind=tfjob", *args)


def _manifest(*args):
    return manifest("--kind=tfjob", *args)


def _replicas(job):
    return job["spec"]["tfReplicaSpecs"]


def _container(replica):
    (container,) = replica["template"]["spec"]["containers"]
    return container


def test_only_image_gives_the_readme_default_job():
    job, policy = _manifest(f"--image={IMAGE}")
    assert job["apiVersion"] == "kubeflow.org/v1"
    assert job["kind"] == "TFJob"
    assert job["metadata"] == {"name": "tf-distbelief", "namespace": "default"}
    assert job["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 10}
    replicas = _replicas(job)
    assert {rtype: r["replicas"] for rtype, r in replicas.items()} == {
        "Chief": 1,
        "Worker": 2,
        "PS": 2,
    }
    assert {rtype: r["restartPolicy"] for rtype, r in replicas.items()} == {
        "Chief": "ExitCode",
        "Worker": "OnFailure",
        "PS": "OnFailure",
    }
    for rtype, replica in replicas.items():
        container = _container(replica)
        assert container["name"] == "tensorflow"
        assert container["image"] == IMAGE
        assert container["command"] + container["args"] == README_COMMAND
        # The chief also listens for its tasks' word that they are stopping
        # (SIGTERM: a pod deleted or drained), at the port every pod is given.
        announce_port = [{"name": "announce", "containerPort": 2223, "protocol": "TCP"}]
        assert container["ports"] == [
            {"name": "tfjob-port", "containerPort": 2222, "protocol": "TCP"},
            *(announce_port if rtype == "Chief" else []),
        ]
        assert container["env"] == [
            {"name": "TF_DISTBELIEF_ANNOUNCE_PORT", "value": "2223"}
        ]
        assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    assert policy["kind"] == "NetworkPolicy"
    selector = {"matchLabels": {"training.kubeflow.org/job-name": "tf-distbelief"}}
    assert policy["spec"] == {
        "podSelector": selector,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": selector}]}],
    }


def test_every_pod_template_and_the_policy_fit_the_kubernetes_models():
    config = tfjob.TFJobConfig(**FULL_SETTINGS)
    job, policy = tfjob.manifests(config)
    assert list(_replicas(job)) == ["Chief", "Worker", "PS", "Evaluator"]
    for replica in _replicas(job).values():
        template = replica["template"]
        assert _round_trip(template, "V1PodTemplateSpec") == template
    assert _round_trip(policy, "V1NetworkPolicy") == policy


@pytest.mark.parametrize(
    "args, secs",
    [((), 30), (("--model=digits", "--preemption_grace_secs=50"), 55)],
)
def test_every_pod_waits_for_the_chiefs_save_at_sigterm(args, secs):
    # The kubelet's SIGKILL comes after the chief's save at SIGTERM
    # (`--preemption_grace_secs`, 25 s by default) and 5 s to end its tasks.
    config = tfjob.TFJobConfig(image=IMAGE, **({"train_args": args} if args else {}))
    job, _ = tfjob.manifests(config)
    for replica in _replicas(job).values():
        assert replica["template"]["spec"]["terminationGracePeriodSeconds"] == secs


def test_the_model_check_catches_a_misspelled_field_and_a_wrong_type():
    template = tfjob.pod_template(tfjob.TFJobConfig(image=IMAGE), "Worker")
    template["spec"]["containers"][0]["volumeMount"] = []
    assert _round_trip(template, "V1PodTemplateSpec") != template
    template = tfjob.pod_template(tfjob.TFJobConfig(image=IMAGE), "Worker")
    template["spec"]["containers"][0]["ports"][0]["containerPort"] = "2222"
    with pytest.raises(ValueError, match=r"containerPort"):
        _round_trip(template, "V1PodTemplateSpec")


def test_gpus_volume_and_model_dir_go_where_they_are_used():
    job, _ = _manifest(
        f"--image={IMAGE}",
        "--evaluator",
        "--pvc=runs",
        "--gpus_per_worker=1",
        "--job_name=mnist",
        "--namespace=ml",
        "--",
        "--model=digits",
        "--epochs=3",
    )
    replicas = _replicas(job)
    assert replicas["Evaluator"]["replicas"] == 1
    assert replicas["Evaluator"]["restartPolicy"] == "OnFailure"
    for rtype, replica in replicas.items():
        container = _container(replica)
        spec = replica["template"]["spec"]
        if rtype == "Worker":
            assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
        else:
            assert "limits" not in container["resources"]
        if rtype in ("Chief", "Evaluator"):
            assert container["args"] == [
                "--model=digits",
                "--epochs=3",
                "--model_dir=/mnt/model_dir",
            ]
            assert container["volumeMounts"] == [
                {"name": "model-dir", "mountPath": "/mnt/model_dir"}
            ]
            assert spec["volumes"] == [
                {"name": "model-dir", "persistentVolumeClaim": {"claimName": "runs"}}
            ]
        else:
            assert container["args"] == ["--model=digits", "--epochs=3"]
            assert "volumes" not in spec


@pytest.mark.parametrize(
    "args,message",
    [
        ([], r"Flag --image must have a value other than None"),
        (
            ["--evaluator"],
            r"`evaluator` reads the chief's checkpoints: it needs a `model_dir` both "
            r"pods share\. Give `pvc` \(a ReadWriteMany claim\), or a `model_dir` "
            r"such as gs://bucket/run\. Received: pvc=None, model_dir=None",
        ),
        (
            ["--train_args=--model=digits --num_workers=4"],
            r"Training flag --num_workers is set by the manifest: use `num_workers` "
            r"of TFJobConfig \(the same flags of launch/k8s.py\) instead",
        ),
        (
            ["--", "--model_dir=/tmp/x"],
            r"Training flag --model_dir is set by the manifest: use `model_dir "
            r"\(and pvc\)`",
        ),
        (
            ["--job_name=MNIST"],
            r"`job_name` must be a DNS-1035 label: lower-case letters, digits and "
            r"'-', starting with a letter, at most 63 characters\. Received: 'MNIST'",
        ),
        (
            ["--job_name=" + "a" * 55],
            r"`job_name` makes service names too long: 'a{55}-worker-1' has 64 "
            r"characters, at most 63 are allowed",
        ),
        (
            ["--memory=2GB"],
            r"`memory` must be a Kubernetes quantity such as '1', '500m' or '2Gi'\. "
            r"Received: '2GB'",
        ),
        (
            ["--pvc=runs", "--model_dir=runs"],
            r"`model_dir` is where `pvc` is mounted and must be an absolute path\. "
            r"Received: 'runs'",
        ),
        (
            ["--train_args=--model=digits", "--", "--epochs=2"],
            r"either in --train_args or after `--`, not both",
        ),
    ],
)
def test_bad_flags_are_named(args, message):
    image = [] if not args else [f"--image={IMAGE}"]
    proc = _k8s(*image, *args)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert re.search(message, proc.stderr), proc.stderr[-2000:]


def test_too_long_job_name_counts_the_longest_service():
    config = tfjob.TFJobConfig(image=IMAGE, job_name="a" * 55, num_workers=1)
    with pytest.raises(ValueError, match=r"'a{55}-worker-0' has 64 characters"):
        config.validate()
    config.job_name = "a" * 54
    assert config.validate() is config
    config.evaluator, config.pvc = True, "runs"
    with pytest.raises(ValueError, match=r"'a{54}-evaluator-0' has 66 characters"):
        config.validate()


def _operator_tf_config(job, replica_type, index):
    """The `TF_CONFIG` the training operator (release 1.9, `genClusterSpec` and
    `genTFConfigJSONStr`) gives pod `index` of `replica_type`.

    Every replica type is a job, its name lower-cased (the evaluator included);
    a host is the service `<job>-<type>-<index>.<namespace>.svc` at the port
    named `tfjob-port` of the container named `tensorflow` (default 2222).
    """
    name, namespace = job["metadata"]["name"], job["metadata"]["namespace"]
    cluster = {}
    for rtype, replica in _replicas(job).items():
        port = 2222
        for container in replica["template"]["spec"]["containers"]:
            if container["name"] == "tensorflow":
                for p in container.get("ports", []):
                    if p["name"] == "tfjob-port":
                        port = p["containerPort"]
        rt = rtype.lower()
        cluster[rt] = [
            f"{name}-{rt}-{i}.{namespace}.svc:{port}"
            for i in range(replica["replicas"])
        ]
    return {
        "cluster": cluster,
        "task": {"type": replica_type.lower(), "index": index},
        "environment": "cloud",
    }


@pytest.mark.slow
def test_tfjob_replicas_run_as_local_processes(tmp_path):
    """Chief, 2 workers, 2 ps and an evaluator, each run as its pod would be."""
    model_dir = tmp_path / "model_dir"
    job, _ = _manifest(
        f"--image={IMAGE}",
        "--job_name=tfdb-test",
        "--evaluator",
        "--pvc=test-runs",
        f"--model_dir={model_dir}",
        "--train_args=--model=digits --epochs=3 --steps_per_epoch=100",
    )
    # Service host names -> free 127.0.0.1 ports (what the cluster DNS does).
    services = {
        address: f"127.0.0.1:{portpicker.pick_unused_port()}"
        for rtype in _replicas(job)
        for address in _operator_tf_config(job, rtype, 0)["cluster"][rtype.lower()]
    }
    assert sorted(services)[0] == "tfdb-test-chief-0.default.svc:2222"
    marker = uuid.uuid4().hex
    procs = {}
    try:
        for rtype in ("PS", "Worker", "Chief", "Evaluator"):
            replica = _replicas(job)[rtype]
            container = _container(replica)
            assert container["command"][0] == "python"
            command = [sys.executable, *container["command"][1:], *container["args"]]
            for index in range(replica["replicas"]):
                tf_config = _operator_tf_config(job, rtype, index)
                for hosts in tf_config["cluster"].values():
                    hosts[:] = [services[h] for h in hosts]
                key = f"{rtype.lower()}{index}"
                procs[key] = subprocess.Popen(
                    command,
                    env=_env(marker, TF_CONFIG=json.dumps(tf_config)),
                    cwd=ROOT,
                    stdout=open(tmp_path / f"{key}.out", "w"),
                    stderr=subprocess.STDOUT,
                )
        assert procs["chief0"].wait(300) == 0, (tmp_path / "chief0.out").read_text()[
            -3000:
        ]
        assert _accuracy((tmp_path / "chief0.out").read_text()) >= 0.95
        # The evaluator stops after the last epoch's checkpoint.
        assert procs["evaluator0"].wait(120) == 0
        evaluator = (tmp_path / "evaluator0.out").read_text()
        assert "evaluator: done" in evaluator, evaluator[-2000:]
        # Once the chief has succeeded the operator deletes the pods still
        # running (cleanPodPolicy: Running): SIGTERM, as the kubelet sends.
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for key, proc in procs.items():
            assert proc.wait(60) == 0, key
        assert _wait_no_marked(marker) == []
    finally:
        for proc in procs.values():
            proc.kill()
