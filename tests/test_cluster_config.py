"""Validation of `TF_CONFIG` and cluster resolvers: one test per error, text pinned."""

import json

import pytest
import tensorflow as tf

from tf_distbelief import cluster

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
    with pytest.raises(
        cluster.ClusterConfigError, match=r"`TF_CONFIG` is not valid JSON"
    ):
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
        cluster.ClusterConfigError,
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
        cluster.ClusterConfigError,
        match=r"Task type `chief` is not in the cluster, whose jobs are "
        r"\['ps', 'worker'\]",
    ):
        cluster.resolve_cluster()


def test_task_index_out_of_range(monkeypatch):
    _set(monkeypatch, {"cluster": CLUSTER, "task": {"type": "worker", "index": 2}})
    with pytest.raises(
        cluster.ClusterConfigError,
        match=r"Task index 2 is out of range for job `worker`, whose task indices "
        r"are \[0, 1\]",
    ):
        cluster.resolve_cluster()


def test_negative_task_index_is_a_python_error(monkeypatch):
    _set(monkeypatch, {"cluster": CLUSTER, "task": {"type": "ps", "index": -1}})
    with pytest.raises(
        cluster.ClusterConfigError,
        match=r"Task index -1 is out of range for job `ps`",
    ):
        cluster.resolve_cluster()


def test_negative_task_index_of_explicit_resolver():
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        tf.train.ClusterSpec(CLUSTER), task_type="worker", task_id=-1
    )
    with pytest.raises(
        cluster.ClusterConfigError, match=r"Task index -1 is out of range"
    ):
        cluster.resolve_cluster(resolver)


@pytest.mark.parametrize("missing", ["ps", "worker"])
def test_no_ps_or_no_worker(monkeypatch, missing):
    config = {k: v for k, v in CLUSTER.items() if k != missing}
    _set(monkeypatch, {"cluster": config, "task": {"type": "chief", "index": 0}})
    with pytest.raises(
        cluster.ClusterConfigError,
        match=rf"The cluster has no `{missing}` task; parameter-server training "
        r"needs at least one `ps` and one `worker`",
    ):
        cluster.resolve_cluster()


def test_same_address_twice(monkeypatch):
    config = dict(CLUSTER, ps=["127.0.0.1:2223", "127.0.0.1:2221"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "chief", "index": 0}})
    with pytest.raises(
        cluster.ClusterConfigError,
        match=r"Address 127.0.0.1:2221 is used twice: by worker:0 and by ps:1",
    ):
        cluster.resolve_cluster()


def test_two_chiefs(monkeypatch):
    config = dict(CLUSTER, chief=["127.0.0.1:2220", "127.0.0.1:2229"])
    _set(monkeypatch, {"cluster": config, "task": {"type": "worker", "index": 0}})
    with pytest.raises(
        cluster.ClusterConfigError, match=r"The cluster has 2 `chief` tasks; at most 1"
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
        cluster.ClusterConfigError,
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
    with pytest.raises(cluster.ClusterConfigError, match=r"field `task` must be"):
        cluster.resolve_cluster()


@pytest.mark.parametrize("name,value", [("num_workers", 0), ("num_ps", -1)])
def test_local_cluster_rejects_bad_counts(name, value):
    kwargs = {"num_workers": 1, "num_ps": 1, name: value}
    with pytest.raises(
        ValueError,
        match=rf"Argument `{name}` must be a positive integer. Received: {value}",
    ):
        cluster.LocalCluster(**kwargs)
