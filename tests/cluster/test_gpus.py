"""GPU hosts (issue 12): which GPUs each local task sees, tested with injected
GPU lists on a CPU machine (`tf_distbelief.cluster.local.gpus`, `LocalCluster`)."""

from __future__ import annotations

import os

import pytest

import tf_distbelief as tfdb
from tf_distbelief import cluster, job
from tf_distbelief.cluster.local import gpus

SMI = """\
GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-11111111-2222-3333-4444-555555555555)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-66666666-7777-8888-9999-000000000000)
GPU 2: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee)
"""


@pytest.mark.parametrize(
    "value, ids",
    [
        ("0,1", ["0", "1"]),
        (" 2, 3 ", ["2", "3"]),
        ("", []),
        ("-1", []),
        ("1,-1,2", ["1"]),  # CUDA stops at the first invalid entry.
        ("GPU-8f6c,GPU-1a2b", ["GPU-8f6c", "GPU-1a2b"]),
    ],
)
def test_parse_cuda_visible_devices(value, ids):
    assert gpus.parse_cuda_visible_devices(value) == ids


def test_visible_gpus_prefers_the_parents_cuda_visible_devices():
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "3,5"}, SMI) == ["3", "5"]
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, SMI) == []
    assert gpus.visible_gpus({}, SMI) == ["0", "1", "2"]
    assert gpus.visible_gpus({}, "") == []
    assert gpus.visible_gpus({}, "NVIDIA-SMI has failed") == []


_W, _P = "worker", "ps"


@pytest.mark.parametrize(
    "num_gpus, num_workers, num_ps, per_worker, expected",
    [
        # G >= W: G // W each, in blocks; ps none.
        (4, 2, 1, None, {(_W, 0): "0,1", (_W, 1): "2,3", (_P, 0): ""}),
        (8, 4, 2, None, {(_W, 0): "0,1", (_W, 1): "2,3", (_W, 2): "4,5",
                         (_W, 3): "6,7", (_P, 0): "", (_P, 1): ""}),
        # G % W left over: GPU 2 unused (equal counts per worker).
        (3, 2, 1, None, {(_W, 0): "0", (_W, 1): "1", (_P, 0): ""}),
        # G < W: one shared GPU each, round-robin.
        (2, 5, 1, None, {(_W, 0): "0", (_W, 1): "1", (_W, 2): "0", (_W, 3): "1",
                         (_W, 4): "0", (_P, 0): ""}),
        # Explicit counts.
        (4, 2, 1, 1, {(_W, 0): "0", (_W, 1): "1", (_P, 0): ""}),
        (8, 2, 1, 4, {(_W, 0): "0,1,2,3", (_W, 1): "4,5,6,7", (_P, 0): ""}),
        (4, 2, 2, 0, {(_W, 0): "", (_W, 1): "", (_P, 0): "", (_P, 1): ""}),
        # No GPU: nothing to set, or every task hidden with 0.
        (0, 2, 2, None, {}),
        (0, 1, 1, 0, {(_W, 0): "", (_P, 0): ""}),
    ],
)  # fmt: skip
def test_assign_gpus_exact_maps(num_gpus, num_workers, num_ps, per_worker, expected):
    ids = [str(i) for i in range(num_gpus)]
    assert gpus.assign_gpus(ids, num_workers, num_ps, per_worker) == expected


def test_assign_gpus_keeps_the_parents_ids():
    assignment = gpus.assign_gpus(["4", "6", "7", "GPU-x"], 2, 1)
    assert assignment == {("worker", 0): "4,6", ("worker", 1): "7,GPU-x", ("ps", 0): ""}


def test_too_many_gpus_per_worker_is_an_error_naming_the_counts():
    with pytest.raises(
        tfdb.GpuAssignmentError,
        match=r"`gpus_per_worker` asks for 2 GPUs for each of 3 workers \(6 in all\)"
        r", but this host shows 4 \(0, 1, 2, 3: .*Use 0\.\.1, fewer workers, or "
        r"leave it unset",
    ):
        gpus.assign_gpus(["0", "1", "2", "3"], 3, 1, 2)
    with pytest.raises(tfdb.GpuAssignmentError, match=r"shows 0 \(none"):
        gpus.assign_gpus([], 2, 1, 1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_gpus_per_worker_must_be_none_or_a_count(bad):
    with pytest.raises(ValueError, match=r"`gpus_per_worker` must be None .* >= 0"):
        gpus.assign_gpus(["0"], 1, 1, bad)


def test_task_env_sets_growth_only_where_a_gpu_is_seen():
    assignment = gpus.assign_gpus(["0", "1"], 2, 1)
    assert gpus.task_env(assignment, "worker", 1, {}) == {
        "CUDA_VISIBLE_DEVICES": "1",
        "TF_FORCE_GPU_ALLOW_GROWTH": "true",
    }
    assert gpus.task_env(assignment, "ps", 0, {}) == {"CUDA_VISIBLE_DEVICES": ""}
    # A user's own setting is kept.
    env = gpus.task_env(assignment, "worker", 0, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"})
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "false"
    assert gpus.task_env({}, "worker", 0, {}) == {}


def test_local_cluster_refuses_before_any_process_starts():
    with pytest.raises(tfdb.GpuAssignmentError, match=r"2 in all"):
        cluster.LocalCluster(num_workers=2, gpus_per_worker=1, visible_gpus=["0"])
    local = cluster.LocalCluster(num_workers=2, num_ps=1, visible_gpus=["0", "1"])
    assert local.processes == {}
    assert local.gpu_assignment == {
        ("worker", 0): "0",
        ("worker", 1): "1",
        ("ps", 0): "",
    }


def test_job_config_checks_gpus_per_worker():
    with pytest.raises(ValueError, match=r"`gpus_per_worker` must be >= 0 .* -1"):
        job.JobConfig(gpus_per_worker=-1).validate()
    assert job.JobConfig(gpus_per_worker=0).validate().gpus_per_worker == 0


@pytest.mark.slow
def test_local_cluster_tasks_get_their_gpus_and_start_on_a_cpu_host(monkeypatch):
    """Real child processes: each task's environment holds its assignment, and
    servers start even when the named GPUs do not exist (CPU fallback)."""
    psutil = pytest.importorskip("psutil")
    # Restored at teardown: the cluster sets it for this (chief) process.
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "unset")
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH")
    with cluster.LocalCluster(
        num_workers=2, num_ps=1, visible_gpus=["0", "1", "2", "3"]
    ) as local:
        seen = {
            task: psutil.Process(proc.pid).environ()
            for task, proc in local.processes.items()
        }
    assert {task: env["CUDA_VISIBLE_DEVICES"] for task, env in seen.items()} == {
        ("worker", 0): "0,1",
        ("worker", 1): "2,3",
        ("ps", 0): "",
    }
    assert seen[("worker", 0)]["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert seen[("worker", 1)]["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert os.environ["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"  # The chief's.


def test_the_jobs_gpu_line():
    from tf_distbelief.job import runner

    assignment = gpus.assign_gpus(["0", "1", "2", "3"], 2, 2)
    assert runner.gpu_summary(assignment) == "worker 0: 0,1; worker 1: 2,3; ps: none"
