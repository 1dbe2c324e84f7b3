"""Validation of `TF_CONFIG` and cluster resolvers: one test per error, text pinned."""

import json
import os
import re
import socket
import threading
import time

import pytest
import tensorflow as tf

import tf_distbelief as tfdb
from tf_distbelief import cluster
from tf_distbelief.cluster import addresses

CLUSTER = {
    "chief": ["127.0.0.1:2220"],
    "worker": ["127.0.0.1:2221", "127.0.0.1:2222"],
    "ps": ["127.0.0.1:2223", "127.0.0.1:2224"],
}


def _set(monkeypatch, config):
    text = config if isinstance(config, str) else json.dumps(config)
    monkeypatch.setenv("TF_CONFIG", text)


def test_no_tf_config_means_local_cluster(clean_tf_config):
    assert cluster.resolve_cluster() is None


def test_valid_tf_config_resolves(monkeypatch):
    _set(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 1}})
    resolver = cluster.resolve_cluster()
    assert resolver.task_type == "worker"
    assert resolver.task_id == 1
    assert resolver.cluster_spec().as_dict() == CLUSTER


def test_malformed_json(monkeypatch):
    _set(monkeypatch, '{"cluster": {"worker": ["127.0.0.1:1"],}')
    with pytest.raises(tfdb.ClusterConfigError, match=r"`TF_CONFIG` is not valid JSON"):
        cluster.resolve_cluster()


def test_unknown_job_names(monkeypatch):
    _set(
        monkeypatch,
        {
            "cluster": {"ps_hosts": ["127.0.0.1:1"], "worker_hosts": ["127.0.0.1:2"]},
            "task": {"type": "worker", "index": 0},
        },
    )
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Unknown job name\(s\) \['ps_hosts', 'worker_hosts'\].*allowed job "
        r"names are chief, worker, ps, evaluator",
    ):
        cluster.resolve_cluster()


def test_task_type_not_in_cluster(monkeypatch):
    config = {
        "cluster": {k: v for k, v in CLUSTER.items() if k != "chief"},
        "task": {"type": "chief", "index": 0},
    }
    _set(monkeypatch, config)
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Task type `chief` is not in the cluster, whose jobs are "
        r"\['ps', 'worker'\]",
    ):
        cluster.resolve_cluster()


def test_task_index_out_of_range(monkeypatch):
    _set(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 2}})
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Task index 2 is out of range for job `worker`, whose task indices "
        r"are \[0, 1\]",
    ):
        cluster.resolve_cluster()


def test_negative_task_index_is_a_python_error(monkeypatch):
    _set(monkeypatch, {"cluster": CLUSTER, "task": {"type": "ps", "index": -1}})
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Task index -1 is out of range for job `ps`",
    ):
        cluster.resolve_cluster()


def test_negative_task_index_of_explicit_resolver():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(CLUSTER), task_type="worker", task_id=-1
    )
    with pytest.raises(tfdb.ClusterConfigError, match=r"Task index -1 is out of range"):
        cluster.resolve_cluster(resolver)


@pytest.mark.parametrize("missing", ["ps", "worker"])
def test_no_ps_or_no_worker(monkeypatch, missing):
    config = {k: v for k, v in CLUSTER.items() if k != missing}
    _set(monkeypatch, {"cluster": config, "task": {"type": "chief", "index": 0}})
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=rf"The cluster has no `{missing}` task; parameter-server training "
        r"needs at least one `ps` and one `worker`",
    ):
        cluster.resolve_cluster()


def test_same_address_twice(monkeypatch):
    config = dict(CLUSTER, ps=["127.0.0.1:2223", "127.0.0.1:2221"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "chief", "index": 0}})
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Address 127.0.0.1:2221 is used twice: by worker:0 and by ps:1",
    ):
        cluster.resolve_cluster()


def test_two_chiefs(monkeypatch):
    config = dict(CLUSTER, chief=["127.0.0.1:2220", "127.0.0.1:2229"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "worker", "index": 0}})
    with pytest.raises(
        tfdb.ClusterConfigError, match=r"The cluster has 2 `chief` tasks; at most 1"
    ):
        cluster.resolve_cluster()


def test_sparse_job_with_string_keys_resolves_index(monkeypatch):
    config = dict(CLUSTER, worker={"1": "127.0.0.1:2223"}, ps=["127.0.0.1:2224"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "worker", "index": 1}})
    resolver = cluster.resolve_cluster()
    assert resolver.task_id == 1
    assert resolver.cluster_spec().task_address("worker", 1) == "127.0.0.1:2223"
    assert resolver.cluster_spec().task_indices("worker") == [1]


def test_sparse_job_with_bad_key(monkeypatch):
    config = dict(CLUSTER, worker={"one": "127.0.0.1:2223"})
    _set(monkeypatch, {"cluster": config, "task": {"type": "chief", "index": 0}})
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Task index 'one' of job `worker` is not an integer",
    ):
        cluster.resolve_cluster()


def test_explicit_resolver_wins_over_tf_config(monkeypatch):
    _set(monkeypatch, "this is not json")
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(CLUSTER), task_type="chief", task_id=0
    )
    resolved = cluster.resolve_cluster(resolver)
    assert resolved.task_type == "chief"
    assert resolved.cluster_spec().as_dict() == CLUSTER


def test_evaluator_left_out_of_training_cluster(monkeypatch):
    config = dict(CLUSTER, evaluator=["127.0.0.1:2230"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "chief", "index": 0}})
    resolver = cluster.training_cluster_resolver(cluster.resolve_cluster())
    assert "evaluator" not in resolver.cluster_spec().as_dict()
    assert resolver.cluster_spec().as_dict() == CLUSTER


def test_missing_task_field_is_an_error(monkeypatch):
    _set(monkeypatch, {"cluster": CLUSTER, "task": "worker"})
    with pytest.raises(tfdb.ClusterConfigError, match=r"field `task` must be"):
        cluster.resolve_cluster()


@pytest.mark.parametrize("name,value", [("num_workers", 0), ("num_ps", -1)])
def test_local_cluster_rejects_bad_counts(name, value):
    kwargs = {"num_workers": 1, "num_ps": 1, name: value}
    with pytest.raises(
        ValueError,
        match=rf"Argument `{name}` must be a positive integer. Received: {value}",
    ):
        cluster.LocalCluster(**kwargs)


@pytest.mark.parametrize("value", [-1, True, 1.0])
def test_local_cluster_rejects_bad_intra_op_threads(value):
    with pytest.raises(
        ValueError,
        match=rf"`intra_op_threads` must be an integer >= 0. Received: {value}",
    ):
        cluster.LocalCluster(num_workers=1, num_ps=1, intra_op_threads=value)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [0, 1])
def test_local_cluster_sets_each_tasks_intra_op_threads(monkeypatch, threads):
    psutil = pytest.importorskip("psutil")
    monkeypatch.delenv("TF_NUM_INTRAOP_THREADS", raising=False)
    with cluster.LocalCluster(
        num_workers=1, num_ps=1, intra_op_threads=threads
    ) as local:
        seen = {
            task: psutil.Process(proc.pid).environ().get("TF_NUM_INTRAOP_THREADS")
            for task, proc in local.processes.items()
        }
    expected = str(threads) if threads else None  # 0: TensorFlow's default.
    assert seen == {("worker", 0): expected, ("ps", 0): expected}
    assert "TF_NUM_INTRAOP_THREADS" not in os.environ  # Not the chief's.


@pytest.mark.slow
def test_local_cluster_removes_its_temporary_log_folder_at_stop():
    local = cluster.LocalCluster(num_workers=1, num_ps=1).start()
    log_dir = local._log_dir
    try:
        assert sorted(os.listdir(log_dir))[:2] == ["ps_0.log", "ps_0.ready"]
    finally:
        local.stop()
    assert not os.path.exists(log_dir)


# TF_CONFIG forms in use elsewhere (issue 12).


def test_tutorial_evaluator_tf_config_without_a_training_cluster(monkeypatch):
    # TensorFlow's parameter-server tutorial gives the evaluator only itself.
    _set(
        monkeypatch,
        {
            "cluster": {"evaluator": ["127.0.0.1:2230"]},
            "task": {"type": "evaluator", "index": 0},
        },
    )
    resolver = cluster.resolve_cluster()
    assert resolver.task_type == "evaluator"
    assert resolver.task_id == 0
    assert resolver.cluster_spec().as_dict() == {"evaluator": ["127.0.0.1:2230"]}


def test_evaluator_left_out_of_its_own_cluster(monkeypatch):
    # Older TFJob operators: "evaluator is not part of training cluster".
    _set(monkeypatch, {"cluster": CLUSTER, "task": {"type": "evaluator", "index": 0}})
    resolver = cluster.resolve_cluster()
    assert resolver.task_type == "evaluator"
    assert resolver.cluster_spec().as_dict() == CLUSTER


def test_only_the_evaluator_may_run_without_ps_and_workers(monkeypatch):
    _set(
        monkeypatch,
        {
            "cluster": {"evaluator": ["127.0.0.1:2230"], "chief": ["127.0.0.1:2220"]},
            "task": {"type": "chief", "index": 0},
        },
    )
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"The cluster has no `worker` task; .* \(only an `evaluator` task may "
        r"run without them\)",
    ):
        cluster.resolve_cluster()


MASTER_CLUSTER = {
    "master": ["127.0.0.1:2220"],
    "worker": ["127.0.0.1:2221", "127.0.0.1:2222"],
    "ps": ["127.0.0.1:2223", "127.0.0.1:2224"],
}


def test_kubeflow_master_is_the_chief():
    jobs = cluster.validate_cluster(MASTER_CLUSTER, "master", 0)
    assert sorted(jobs) == ["chief", "ps", "worker"]
    assert jobs["chief"] == {0: "127.0.0.1:2220"}


@pytest.mark.parametrize("task_type", ["master", "worker"])
def test_kubeflow_master_resolves_as_chief(monkeypatch, task_type):
    _set(monkeypatch, {"cluster": MASTER_CLUSTER, "task": {"type": task_type}})
    resolver = cluster.resolve_cluster()
    assert resolver.task_type == {"master": "chief"}.get(task_type, task_type)
    assert resolver.cluster_spec().as_dict() == CLUSTER
    # What `DistBeliefStrategy` and the servers connect to.
    training = cluster.training_cluster_resolver(resolver)
    assert training.cluster_spec().as_dict() == CLUSTER


def test_explicit_resolver_with_master_resolves_as_chief():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(MASTER_CLUSTER), task_type="master", task_id=0
    )
    resolved = cluster.resolve_cluster(resolver)
    assert resolved.task_type == "chief"
    assert resolved.cluster_spec().as_dict() == CLUSTER


def test_master_and_chief_together(monkeypatch):
    config = dict(MASTER_CLUSTER, chief=["127.0.0.1:2229"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "worker", "index": 0}})
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"The cluster has both `master` and `chief` jobs; `master` is another "
        r"name of `chief`\. Keep one of them\.",
    ):
        cluster.resolve_cluster()


# Addresses (issue 10 item 6): rejected before any server starts.


@pytest.mark.parametrize("port", ["0", "65536", "-1", "http", "2222.5"])
def test_port_outside_1_to_65535(port):
    config = dict(CLUSTER, ps=["127.0.0.1:2223", f"127.0.0.1:{port}"])
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Port of task ps:1 must be an integer in 1-65535\. Received: "
        rf"'127\.0\.0\.1:{port}'\. Port 0 would let the server bind a random port "
        r"that no other task learns .*; give every task a fixed free port, e\.g\. "
        r"'host:2222'\.",
    ):
        cluster.validate_cluster(config, "chief", 0)


def test_port_0_in_tf_config_fails_before_any_server(monkeypatch):
    _set(
        monkeypatch,
        {
            "cluster": dict(CLUSTER, ps=["127.0.0.1:0"]),
            "task": {"type": "ps", "index": 0},
        },
    )
    with pytest.raises(tfdb.ClusterConfigError, match=r"Port of task ps:0"):
        cluster.resolve_cluster()


def test_address_without_host():
    config = dict(CLUSTER, worker=[":2221"])
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Address of task worker:0 must be 'host:port' with a host\. "
        r"Received: ':2221'\. Give the machine's name or IP, e\.g\. "
        r"'127\.0\.0\.1:2221'\.",
    ):
        cluster.validate_cluster(config, "chief", 0)


@pytest.mark.parametrize(
    "first,second",
    [
        ("localhost", "127.0.0.1"),
        ("127.0.0.1", "127.0.0.2"),
        ("127.0.0.1", "[::1]"),
        ("LOCALHOST", "127.255.0.9"),
    ],
)
def test_loopback_spellings_are_one_address(first, second):
    config = dict(CLUSTER, worker=[f"{first}:2221", "127.0.0.1:2222"])
    config["ps"] = ["127.0.0.1:2223", f"{second}:2221"]
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=rf"Address {re.escape(second)}:2221 of ps:1 and {first}:2221 of "
        r"worker:0 are an address used twice: both are this machine's loopback "
        r"\(localhost, ::1 and 127\.0\.0\.0/8 reach the same servers\), port 2221\. "
        r"Every task needs its own host:port; give one of them another port\.",
    ):
        cluster.validate_cluster(config, "chief", 0)


def test_same_ip_spelled_twice():
    config = dict(CLUSTER, worker=["10.0.0.7:2221", "[::ffff:10.0.0.7]:2221"])
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Address \[::ffff:10\.0\.0\.7\]:2221 of worker:1 and 10\.0\.0\.7:2221 "
        r"of worker:0 are an address used twice: both are 10\.0\.0\.7, port 2221",
    ):
        cluster.validate_cluster(config, "chief", 0)


def test_loopback_with_other_ports_is_fine():
    config = dict(CLUSTER, worker=["localhost:2221", "127.0.0.2:2222"])
    assert cluster.validate_cluster(config, "chief", 0)["worker"] == {
        0: "localhost:2221",
        1: "127.0.0.2:2222",
    }


def test_host_name_resolving_to_a_listed_ip(monkeypatch):
    def fake_getaddrinfo(host, port, *args, **kwargs):
        if host == "ps-host.example":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.2.3", 0))]
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(addresses.socket, "getaddrinfo", fake_getaddrinfo)
    config = dict(CLUSTER, ps=["10.1.2.3:2223", "ps-host.example:2223"])
    with pytest.raises(
        tfdb.ClusterConfigError,
        match=r"Address ps-host\.example:2223 of ps:1 and 10\.1\.2\.3:2223 of ps:0 "
        r"are an address used twice: both are 10\.1\.2\.3, port 2223",
    ):
        cluster.validate_cluster(config, "chief", 0)


def test_host_names_that_do_not_resolve_are_compared_by_text(monkeypatch):
    # Kubernetes service names resolve only once their pods exist; a lookup
    # that hangs must not hold up validation either.
    release = threading.Event()

    def hanging_getaddrinfo(*args, **kwargs):
        release.wait(30)
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure")

    monkeypatch.setattr(addresses.socket, "getaddrinfo", hanging_getaddrinfo)
    services = {
        "chief": ["tfdb-chief-0.default.svc:2222"],
        "worker": ["tfdb-worker-0.default.svc:2222", "tfdb-worker-1.default.svc:2222"],
        "ps": ["tfdb-ps-0.default.svc:2222"],
    }
    try:
        start = time.monotonic()
        jobs = cluster.validate_cluster(services, "worker", 1)
        assert time.monotonic() - start < 3.0
        assert jobs["worker"][1] == "tfdb-worker-1.default.svc:2222"
        services["ps"] = ["TFDB-worker-1.default.svc.:2222"]
        with pytest.raises(
            tfdb.ClusterConfigError,
            match=r"are an address used twice: both are tfdb-worker-1\.default\.svc, "
            r"port 2222",
        ):
            cluster.validate_cluster(services, "worker", 1)
    finally:
        release.set()


def test_a_real_lookup_of_a_name_that_cannot_exist_passes():
    # RFC 2606: `.invalid` never resolves, online or offline.
    config = dict(CLUSTER, ps=["tfdb-ps-0.invalid:2223", "tfdb-ps-1.invalid:2223"])
    start = time.monotonic()
    assert cluster.validate_cluster(config, "chief", 0)["ps"][1] == (
        "tfdb-ps-1.invalid:2223"
    )
    assert time.monotonic() - start < 3.0
