"""Kubernetes: the JobSet of `launch/k8s.py` (`--kind=jobset`, the default), and
the `TF_CONFIG` its pods build from their identity (`--cluster_from=jobset`).

The JobSet is validated against the OpenAPI schema of the CRD of JobSet
v0.12.0 (tests/data/, as released), its pod and Job templates against the
`kubernetes` client's models. The slow tests run every pod of a generated
JobSet as a local process in a network namespace of its own, on the same port,
with the environment and hostnames JobSet gives it (`tests.fixtures.jobset_pods`).
"""

import copy
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from tests.fixtures import jobset_pods
from tests.fixtures.k8s import (
    FULL_SETTINGS,
    IMAGE,
    README_COMMAND,
    manifest,
    round_trip,
    run_k8s,
)
from tests.fixtures.launch import ROOT, TRAIN, _accuracy, _env, _wait_no_marked
from tests.fixtures.ps_kill import checkpoint_written
from tf_distbelief import console
from tf_distbelief.cluster import config as config_lib
from tf_distbelief.cluster import jobset_pod, source
from tf_distbelief.cluster.k8s import jobset

pytest.importorskip("kubernetes.client")
jsonschema = pytest.importorskip("jsonschema")

CRD = os.path.join(ROOT, "tests", "data", "jobset.x-k8s.io_jobsets-v0.12.0.yaml")


def _closed(schema):
    """`schema` with every object that lists its properties closed to others.

    The API server drops unknown fields of a structural schema rather than
    refusing them: closing the objects makes a misspelled field an error here.
    """
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    with open(CRD) as f:
        crd = yaml.load(f, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = crd["spec"]["versions"]
    assert version["name"] == "v1alpha2"
    schema = _closed(version["schema"]["openAPIV3Schema"])
    return jsonschema.Draft7Validator(schema)


def _errors(validator, document):
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def _rjobs(document):
    return {r["name"]: r for r in document["spec"]["replicatedJobs"]}


def _pod(rjob):
    return rjob["template"]["spec"]["template"]


def test_jobset_is_the_default_kind_with_the_readme_job():
    document, policy = manifest(f"--image={IMAGE}")
    assert document["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
    assert document["kind"] == "JobSet"
    assert document["metadata"] == {"name": "tf-distbelief", "namespace": "default"}
    spec = document["spec"]
    assert spec["network"] == {
        "enableDNSHostnames": True,
        "subdomain": "tf-distbelief",
        "publishNotReadyAddresses": True,
    }
    assert spec["successPolicy"] == {
        "operator": "All",
        "targetReplicatedJobs": ["chief"],
    }
    rjobs = _rjobs(document)
    assert {n: r["replicas"] for n, r in rjobs.items()} == {
        "chief": 1,
        "worker": 2,
        "ps": 2,
    }
    for name, rjob in rjobs.items():
        job = rjob["template"]["spec"]
        assert (job["parallelism"], job["completions"]) == (1, 1)
        assert job["completionMode"] == "Indexed"
        assert job["backoffLimit"] == 10
        pod = _pod(rjob)["spec"]
        assert pod["restartPolicy"] == ("Never" if name == "chief" else "OnFailure")
        (container,) = pod["containers"]
        assert container["command"] + container["args"] == README_COMMAND
        announce_port = [{"name": "announce", "containerPort": 2223, "protocol": "TCP"}]
        assert container["ports"] == [
            {"name": "grpc", "containerPort": 2222, "protocol": "TCP"},
            *(announce_port if name == "chief" else []),
        ]
        # A hung task (accepting connections, not answering) is restarted by
        # the kubelet: a ps or worker for the chief, which cannot, and the
        # chief itself, once its startup probe has allowed for connecting.
        probe = container["livenessProbe"]
        assert probe["exec"]["command"] == [
            "python", "-m", "tf_distbelief.cluster.health", "127.0.0.1:2222", "3"
        ]  # fmt: skip
        assert probe["periodSeconds"] * probe["failureThreshold"] == 30
        startup = container.get("startupProbe")
        if name == "chief":
            assert startup["exec"] == probe["exec"]
            # The default --connect_timeout_secs (300) and 120 s more.
            assert startup["periodSeconds"] * startup["failureThreshold"] == 420
        else:
            assert startup is None
        env = {v["name"]: v.get("value", v.get("valueFrom")) for v in container["env"]}
        assert env == {
            "TFDB_JOBSET_NAME": {
                "fieldRef": {
                    "fieldPath": "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
                }
            },
            "TFDB_JOBSET_REPLICATED_JOB": {
                "fieldRef": {
                    "fieldPath": "metadata.labels"
                    "['jobset.sigs.k8s.io/replicatedjob-name']"
                }
            },
            "TFDB_JOBSET_JOB_INDEX": {
                "fieldRef": {
                    "fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-index']"
                }
            },
            "TFDB_JOBSET_REPLICAS": "chief:1,worker:2,ps:2",
            "TFDB_JOBSET_PORT": "2222",
            "TFDB_JOBSET_SUBDOMAIN": "tf-distbelief",
            "TF_DISTBELIEF_ANNOUNCE_PORT": "2223",
        }
    # The chief: a Python error (exit 1-127) fails the Job (and the JobSet);
    # a signal or an out-of-memory kill gets a new chief pod.
    chief_job = rjobs["chief"]["template"]["spec"]
    ignore, fail = chief_job["podFailurePolicy"]["rules"]
    assert ignore == {
        "action": "Ignore",
        "onPodConditions": [{"type": "DisruptionTarget"}],
    }
    assert fail["action"] == "FailJob"
    assert fail["onExitCodes"]["values"] == list(range(1, 128))
    assert "podFailurePolicy" not in rjobs["worker"]["template"]["spec"]
    selector = {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": "tf-distbelief"}}
    assert policy["kind"] == "NetworkPolicy"
    assert policy["spec"] == {
        "podSelector": selector,
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": selector}]}],
    }


def _full_config():
    return jobset.JobSetConfig(**FULL_SETTINGS)


@pytest.mark.parametrize(
    "config",
    [jobset.JobSetConfig(image=IMAGE), _full_config()],
    ids=["default", "evaluator-pvc-gpus"],
)
def test_the_jobset_fits_the_crd_schema_and_its_templates_the_models(validator, config):
    document, policy = jobset.manifests(config)
    assert _errors(validator, document) == []
    for rjob in document["spec"]["replicatedJobs"]:
        template = rjob["template"]
        assert round_trip(template, "V1JobTemplateSpec") == template
        assert round_trip(_pod(rjob), "V1PodTemplateSpec") == _pod(rjob)
    assert round_trip(policy, "V1NetworkPolicy") == policy


def test_the_manifest_is_plain_yaml_and_says_when_restarts_start_over():
    # No anchors and aliases (the probes repeat), the exit codes on one line,
    # and without a model_dir one line on stderr (stdout is the manifest).
    proc = run_k8s(f"--image={IMAGE}")
    assert proc.returncode == 0, proc.stderr
    assert "&id" not in proc.stdout and "*id" not in proc.stdout
    (codes,) = [line for line in proc.stdout.splitlines() if "values: [1, 2," in line]
    assert codes.strip() == f"values: [{', '.join(map(str, range(1, 128)))}]"
    assert proc.stderr == (
        "launch/k8s.py: no --model_dir or --pvc: a restarted chief or a lost ps "
        "starts the job over (nothing is checkpointed).\n"
    )
    assert run_k8s(f"--image={IMAGE}", "--pvc=runs").stderr == ""


def test_the_schema_check_catches_a_misspelled_field_and_a_wrong_type(validator):
    document = jobset.jobset(jobset.JobSetConfig(image=IMAGE))
    wrong = copy.deepcopy(document)
    wrong["spec"]["network"]["enableDnsHostnames"] = True
    assert any("enableDnsHostnames" in e for e in _errors(validator, wrong))
    wrong = copy.deepcopy(document)
    wrong["spec"]["replicatedJobs"][1]["replicas"] = "2"
    assert any("replicatedJobs/1/replicas" in e for e in _errors(validator, wrong))
    wrong = copy.deepcopy(document)
    wrong["spec"]["successPolicy"]["operator"] = "Every"
    assert any("successPolicy/operator" in e for e in _errors(validator, wrong))


def test_gpus_volume_and_model_dir_go_where_they_are_used():
    document, _ = jobset.manifests(_full_config())
    for name, rjob in _rjobs(document).items():
        spec = _pod(rjob)["spec"]
        (container,) = spec["containers"]
        if name == "worker":
            assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}
        else:
            assert "limits" not in container["resources"]
        if name in ("chief", "evaluator"):
            assert container["args"][-1] == "--model_dir=/mnt/model_dir"
            assert spec["volumes"] == [
                {"name": "model-dir", "persistentVolumeClaim": {"claimName": "runs"}}
            ]
        else:
            assert "volumes" not in spec
    # --checkpoint_every_steps needs --model_dir: only where it is.
    config = jobset.JobSetConfig(
        image=IMAGE, model_dir="gs://b/r", train_args=("--checkpoint_every_steps=9",)
    )
    for name, rjob in _rjobs(jobset.jobset(config)).items():
        (container,) = _pod(rjob)["spec"]["containers"]
        if name == "chief":
            assert container["args"] == [
                "--checkpoint_every_steps=9",
                "--model_dir=gs://b/r",
            ]
        else:
            assert container["args"] == []
    # An evaluator's failures never fail the JobSet.
    assert _rjobs(document)["evaluator"]["template"]["spec"]["backoffLimit"] == (
        2**31 - 1
    )


def test_the_chief_s_startup_probe_allows_for_its_connect_timeout():
    config = jobset.JobSetConfig(
        image=IMAGE, train_args=("--model=digits", "--connect_timeout_secs=45")
    )
    rjobs = _rjobs(jobset.jobset(config))
    (chief,) = _pod(rjobs["chief"])["spec"]["containers"]
    startup = chief["startupProbe"]
    # 45 s to connect and 120 s more, in 10 s periods, rounded up.
    assert (startup["periodSeconds"], startup["failureThreshold"]) == (10, 17)


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--job_name=" + "a" * 47],
            r"`job_name` makes pod names too long: 'a{47}-worker-1-0-abcde' has 64 "
            r"characters, at most 63 are allowed",
        ),
        (
            ["--", "--cluster_from=tf_config"],
            r"Training flag --cluster_from is set by the manifest: use `the kind of "
            r"manifest` of JobSetConfig",
        ),
        (
            ["--kind=trainjob"],
            r"flag --kind=trainjob: value should be one of <jobset\|tfjob>",
        ),
    ],
)
def test_bad_flags_are_named(args, message):
    proc = run_k8s(f"--image={IMAGE}", *args)
    assert proc.returncode != 0
    assert proc.stdout == ""
    assert re.search(message, proc.stderr), proc.stderr[-2000:]


# What JobSet and Kubernetes give worker 1 of JobSet `mnist`.
_ENVIRON = {
    "JOB_COMPLETION_INDEX": "0",
    "TFDB_JOBSET_NAME": "mnist",
    "TFDB_JOBSET_REPLICATED_JOB": "worker",
    "TFDB_JOBSET_JOB_INDEX": "1",
    "TFDB_JOBSET_REPLICAS": "chief:1,worker:2,ps:1",
    "TFDB_JOBSET_PORT": "2222",
    "TFDB_JOBSET_SUBDOMAIN": "mnist",
}


def _pod_environ(document, rjob, index):
    env = jobset_pods.pod_env(document, rjob, index, "unused")
    return {k: v for k, v in env.items() if k.startswith(("TFDB_JOBSET", "JOB_"))}


def test_a_pod_builds_the_tf_config_of_its_identity():
    document, _ = manifest(f"--image={IMAGE}", "--job_name=mnist", "--num_ps=1")
    environ = _pod_environ(document, "worker", 1)
    assert environ == _ENVIRON
    assert jobset_pod.tf_config(environ) == {
        "cluster": {
            "chief": ["mnist-chief-0-0.mnist:2222"],
            "worker": ["mnist-worker-0-0.mnist:2222", "mnist-worker-1-0.mnist:2222"],
            "ps": ["mnist-ps-0-0.mnist:2222"],
        },
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    # Every pod's address is its own hostname.
    hostnames = jobset_pods.pod_hostnames(document)
    for (rjob, index), host in hostnames.items():
        config = jobset_pod.tf_config(_pod_environ(document, rjob, index))
        assert config["cluster"][rjob][index] == f"{host}:2222"


def test_the_first_line_names_the_jobset_task():
    line = console.starting_line([TRAIN], _ENVIRON, 2, 2)
    assert line == "loading TensorFlow (JobSet task worker:1)"


def test_the_jobset_environment_is_used_when_tf_config_is_not(monkeypatch):
    document, _ = manifest(f"--image={IMAGE}", "--num_ps=1")
    for key, value in _pod_environ(document, "ps", 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert source.cluster_source() == "jobset"
    assert source.cluster_source("tf_config") is None
    resolver = source.resolve_cluster()
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)
    assert resolver.cluster_spec().as_dict()["ps"] == [
        "tf-distbelief-ps-0-0.tf-distbelief:2222"
    ]
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["h:1"], "ps": ["h:2"]}}')
    assert source.cluster_source() == "tf_config"
    with pytest.raises(
        config_lib.ClusterConfigError,
        match=r"--cluster_from=jobset builds the cluster from the pod's JobSet "
        r"identity, but `TF_CONFIG` is set too",
    ):
        source.resolve_cluster(cluster_from="jobset")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"TFDB_JOBSET_NAME": None}, r"`TFDB_JOBSET_NAME` is not set"),
        ({"JOB_COMPLETION_INDEX": None}, r"`JOB_COMPLETION_INDEX` is not set"),
        (
            {"TFDB_JOBSET_JOB_INDEX": "one"},
            r"`TFDB_JOBSET_JOB_INDEX` must be an integer >= 0\. Received: 'one'",
        ),
        (
            {"TFDB_JOBSET_REPLICAS": "chief=1,worker=2"},
            r"`TFDB_JOBSET_REPLICAS` must list each replicated job once with its "
            r"size, e\.g\. chief:1,worker:2,ps:2\. Received: 'chief=1,worker=2'",
        ),
        (
            {"TFDB_JOBSET_REPLICATED_JOB": "workers"},
            r"`TFDB_JOBSET_REPLICATED_JOB` is 'workers', which "
            r"`TFDB_JOBSET_REPLICAS` \('chief:1,worker:2,ps:1'\) does not list",
        ),
        (
            {"TFDB_JOBSET_JOB_INDEX": "2"},
            r"`TFDB_JOBSET_JOB_INDEX` is 2, but `TFDB_JOBSET_REPLICAS` gives "
            r"replicated job `worker` 2 job\(s\)",
        ),
        (
            {"JOB_COMPLETION_INDEX": "1"},
            r"`JOB_COMPLETION_INDEX` is 1: each Job of this JobSet runs one pod",
        ),
        # What a hand-written TF_CONFIG would get, word for word.
        (
            {"TFDB_JOBSET_REPLICAS": "chief:2,worker:2,ps:1"},
            r"^The cluster has 2 `chief` tasks; at most 1 is allowed\.$",
        ),
        (
            {"TFDB_JOBSET_REPLICAS": "chief:1,worker:2"},
            r"^The cluster has no `ps` task; parameter-server training needs",
        ),
        (
            {"TFDB_JOBSET_PORT": "70000"},
            r"^Port of task chief:0 must be an integer in 1-65535\. Received: "
            r"'mnist-chief-0-0\.mnist:70000'\.",
        ),
    ],
)
def test_a_missing_or_inconsistent_variable_is_named(monkeypatch, change, message):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for key in _ENVIRON:
        monkeypatch.delenv(key, raising=False)
    for key, value in {**_ENVIRON, **change}.items():
        if value is not None:
            monkeypatch.setenv(key, value)
    with pytest.raises(config_lib.ClusterConfigError, match=message):
        source.resolve_cluster(cluster_from="jobset")


def test_train_py_refuses_a_broken_jobset_environment_before_any_server():
    environ = dict(_ENVIRON, TFDB_JOBSET_JOB_INDEX="7")
    proc = subprocess.run(
        [sys.executable, TRAIN, "--model=digits"],
        env=_env(uuid.uuid4().hex, **environ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert re.search(
        r"^train\.py: error: `TFDB_JOBSET_JOB_INDEX` is 7, but "
        r"`TFDB_JOBSET_REPLICAS` gives replicated job `worker` 2 job\(s\)",
        proc.stderr,
    ), proc.stderr[-2000:]
    assert "serving" not in proc.stdout, proc.stdout


def _skip_without_namespaces():
    reason = jobset_pods.unavailable_reason()
    if reason:
        pytest.skip(f"pods need their own network namespaces: {reason}")


def _start_all(net, document, folder, marker):
    procs = {}
    order = ("ps", "worker", "chief", "evaluator")
    for rjob in sorted(_rjobs(document), key=order.index):
        for index in range(_rjobs(document)[rjob]["replicas"]):
            procs[(rjob, index)] = net.start(
                (rjob, index),
                jobset_pods.pod_command(document, rjob),
                jobset_pods.pod_env(document, rjob, index, marker),
                folder / f"{rjob}{index}.out",
            )
    return procs


def _end_pods(procs):
    """What JobSet does once the chief's job succeeds: it deletes the other
    Jobs, and the kubelet sends their pods SIGTERM."""
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for key, proc in procs.items():
        assert proc.wait(60) == 0, key


@pytest.mark.slow
def test_jobset_pods_run_as_local_processes(tmp_path):
    """Chief, 2 workers, 1 ps and an evaluator, each in a network namespace of
    its own, all on port 2222, reached by their JobSet hostnames."""
    _skip_without_namespaces()
    model_dir = tmp_path / "model_dir"
    document, _ = manifest(
        f"--image={IMAGE}",
        "--job_name=tfdb-test",
        "--num_ps=1",
        "--evaluator",
        "--pvc=test-runs",
        f"--model_dir={model_dir}",
        "--train_args=--model=digits --epochs=3 --steps_per_epoch=100",
    )
    marker = uuid.uuid4().hex
    hostnames = jobset_pods.pod_hostnames(document)
    assert hostnames[("ps", 0)] == "tfdb-test-ps-0-0.tfdb-test"
    procs = {}
    with jobset_pods.PodNetwork(tmp_path, marker, hostnames) as net:
        try:
            procs = _start_all(net, document, tmp_path, marker)
            chief = tmp_path / "chief0.out"
            assert procs[("chief", 0)].wait(400) == 0, chief.read_text()[-3000:]
            assert _accuracy(chief.read_text()) >= 0.95
            assert procs[("evaluator", 0)].wait(120) == 0
            evaluator = (tmp_path / "evaluator0.out").read_text()
            assert "evaluator: done" in evaluator, evaluator[-2000:]
            _end_pods(procs)
        finally:
            for proc in procs.values():
                proc.kill()
    assert _wait_no_marked(marker) == []


@pytest.mark.slow
def test_a_ps_pod_killed_and_restarted_in_place_costs_the_job_nothing(tmp_path):
    """The ps container is SIGKILLed after the chief's second checkpoint and
    restarted in its pod (same hostname, same address: `restartPolicy:
    OnFailure`); the chief restores the ps from the checkpoint and finishes."""
    _skip_without_namespaces()
    model_dir = tmp_path / "model_dir"
    document, _ = manifest(
        f"--image={IMAGE}",
        "--job_name=tfdb-ps",
        "--num_ps=1",
        f"--model_dir={model_dir}",
        "--train_args=--model=digits --checkpoint_every_steps=20",
    )
    marker = uuid.uuid4().hex
    second = checkpoint_written(model_dir, 40)
    procs = {}
    with jobset_pods.PodNetwork(
        tmp_path, marker, jobset_pods.pod_hostnames(document)
    ) as net:
        try:
            procs = _start_all(net, document, tmp_path, marker)
            deadline = time.monotonic() + 600
            while not second():
                assert procs[("chief", 0)].poll() is None
                assert time.monotonic() < deadline, "no second checkpoint"
                time.sleep(0.05)
            ps = procs[("ps", 0)]
            ps.send_signal(signal.SIGKILL)
            assert ps.wait(30) == -signal.SIGKILL
            # The kubelet restarts the container in the same pod.
            procs[("ps", 0)] = net.start(
                ("ps", 0),
                jobset_pods.pod_command(document, "ps"),
                jobset_pods.pod_env(document, "ps", 0, marker),
                tmp_path / "ps0.out",
            )
            chief = tmp_path / "chief0.out"
            assert procs[("chief", 0)].wait(600) == 0, chief.read_text()[-3000:]
            out = chief.read_text()
            assert re.search(
                r"^ps task lost: /job:ps/task:0 at tfdb-ps-ps-0-0\.tfdb-ps:2222 ",
                out,
                re.M,
            ), out[-3000:]
            restored = re.search(r"^restored ckpt-(\d+) \(step \1\): ", out, re.M)
            assert restored and int(restored[1]) >= 40, out[-3000:]
            assert re.search(r"^epoch 5/5: steps 500/500 ", out, re.M), out[-3000:]
            assert _accuracy(out) >= 0.95
            _end_pods(procs)
        finally:
            for proc in procs.values():
                proc.kill()
    assert _wait_no_marked(marker) == []
