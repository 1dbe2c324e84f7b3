"""A user's own ModelSpec and a flag file through the launch script (slow)."""

import os
import re
import subprocess
import sys

import pytest

from tests.fixtures.launch import ROOT
from tf_distbelief import job

TRAIN = os.path.join(ROOT, "launch", "train.py")


def _run(args, cwd):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, TRAIN, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _accuracy(stdout):
    found = re.findall(r"^test accuracy: ([0-9.]+)$", stdout, re.MULTILINE)
    assert found, stdout[-3000:]
    return float(found[-1])


@pytest.mark.slow
def test_a_user_spec_module_trains_by_name():
    proc = _run(
        [
            "--model=tf_distbelief.demos.blobs:spec",
            "--epochs=2",
            "--steps_per_epoch=50",
        ],
        ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _accuracy(proc.stdout) >= 0.95


@pytest.mark.slow
def test_flags_from_a_flagfile(tmp_path):
    flagfile = tmp_path / "digits.flags"
    flagfile.write_text(
        "--model=digits\n--num_workers=1\n--num_ps=1\n--epochs=2\n"
        "--steps_per_epoch=100\n"
    )
    proc = _run([f"--flagfile={flagfile}"], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "local cluster: 1 workers, 1 ps" in proc.stdout
    assert _accuracy(proc.stdout) >= 0.9


def test_load_spec_errors_name_the_reference(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_a_spec.py").write_text("spec = 3\n")
    with pytest.raises(ValueError, match=r"`package.module:function`.*'nocolon'"):
        job.load_spec("nocolon")
    with pytest.raises(ValueError, match=r"Cannot import module `no_such_module`"):
        job.load_spec("no_such_module:spec")
    with pytest.raises(ValueError, match=r"has no attribute `missing`"):
        job.load_spec("not_a_spec:missing")
    with pytest.raises(TypeError, match=r"Received: int"):
        job.load_spec("not_a_spec:spec")


def test_a_model_without_model_parallel_version_is_refused_before_any_cluster():
    spec = job.ModelSpec("m", build_model=lambda devices: None, load_data=lambda: None)
    with pytest.raises(ValueError, match=r"`devices_per_replica` > 1 needs a model"):
        job.check_spec(job.JobConfig(devices_per_replica=2), spec)
