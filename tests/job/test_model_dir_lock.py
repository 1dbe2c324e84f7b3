"""One job per `--model_dir`, through the launch script (the slow tier)."""

import os
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.fixtures.launch import ROOT, TRAIN, _env, _wait_no_marked
from tf_distbelief import paths

# One worker and one ps: the lock is the chief's; a smaller cluster starts sooner.
ARGS = [
    "--model=digits",
    "--epochs=2",
    "--checkpoint_every_steps=20",
    "--num_workers=1",
    "--num_ps=1",
]


def _start(model_dir, marker):
    return subprocess.Popen(
        [sys.executable, TRAIN, *ARGS, f"--model_dir={model_dir}"],
        env=_env(marker),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _checkpoint_steps(model_dir):
    folder = paths.checkpoint_dir(model_dir)
    return sorted(
        paths.checkpoint_number(name[: -len(".index")])
        for name in os.listdir(folder)
        if name.endswith(".index")
    )


@pytest.mark.slow
def test_two_jobs_on_one_model_dir_one_is_refused_before_any_server(tmp_path):
    model_dir = str(tmp_path / "model")
    marker = uuid.uuid4().hex
    jobs = [_start(model_dir, marker), _start(model_dir, marker)]
    try:
        outputs = [job.communicate(timeout=900) for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    codes = sorted(job.returncode for job in jobs)
    assert codes == [0, 1], [err[-2000:] for _, err in outputs]
    (won_out, _), (lost_out, lost_err) = sorted(
        outputs, key=lambda o: "test accuracy" not in o[0]
    )
    # Refused by name, before any server started.
    assert "local cluster:" not in lost_out
    assert re.search(
        rf"train.py: error: --model_dir={re.escape(model_dir)} is in use by "
        r"another job \(host \S+, pid \d+, since \S+; lock file ",
        lost_err,
    ), lost_err[-2000:]
    # The winner trained from scratch to the end, alone: its checkpoints only
    # (the last three of every 20 steps to 200), one TensorBoard event file.
    assert "local cluster:" in won_out and "Resumed from" not in won_out
    assert _checkpoint_steps(model_dir) == [160, 180, 200]
    assert len(os.listdir(paths.tensorboard_dir(model_dir))) == 1
    assert not os.path.exists(os.path.join(model_dir, paths.LOCK_FILE))
    assert _wait_no_marked(marker) == []


@pytest.mark.slow
def test_the_lock_of_a_killed_job_is_taken_over(tmp_path):
    model_dir = str(tmp_path / "model")
    marker = uuid.uuid4().hex
    first = _start(model_dir, marker)
    try:
        # Killed once it has written a checkpoint.
        deadline = time.monotonic() + 600
        while not paths.latest_checkpoint(model_dir):
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    finally:
        first.kill()
    assert _wait_no_marked(marker, 60) == []
    assert os.path.exists(os.path.join(model_dir, paths.LOCK_FILE))
    rerun = _start(model_dir, marker)
    out, err = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, err[-3000:]
    took_over = re.findall(r"^model_dir: took over .*$", out, re.M)
    assert len(took_over) == 1, out[-3000:]
    assert f"pid {first.pid}," in took_over[0]
    assert out.index(took_over[0]) < out.index("local cluster:")
    assert "Resumed from" in out
    assert _checkpoint_steps(model_dir)[-1] == 200
    assert _wait_no_marked(marker) == []
