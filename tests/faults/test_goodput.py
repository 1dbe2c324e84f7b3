"""Goodput: a job's wall time by part, on a fake clock and in real jobs."""

import re
import subprocess
import sys
import time
import uuid

import pytest

from tests.fixtures.helpers import tensorboard_scalars
from tests.fixtures.launch import ROOT, TRAIN, _env, _wait_no_marked
from tf_distbelief import paths
from tf_distbelief.faults import goodput

LINE = re.compile(
    r"^goodput: (?P<percent>[\d.]+)% \(train (?P<train>[\d.]+) s of "
    r"(?P<wall>[\d.]+) s; checkpointing (?P<checkpointing>[\d.]+) s, recovery "
    r"(?P<recovery>[\d.]+) s, start-up (?P<start_up>[\d.]+) s, redone "
    r"(?P<redone>[\d.]+) s, other (?P<other>[\d.]+) s\)$",
    re.M,
)
PARTS = ("train", "checkpointing", "recovery", "start_up", "redone", "other")


def _parse(line):
    match = LINE.fullmatch(line)
    assert match, line
    return {k: float(v) for k, v in match.groupdict().items()}


def test_parts_on_a_fake_clock_failure_recovery_and_redone_steps():
    now = [0.0]
    g = goodput.Goodput(0.0, clock=lambda: now[0])
    now[0] = 10.0
    g.begin_training(0)  # Start-up: 10 s.
    now[0] = 20.0
    g.step_done(50)
    now[0] = 22.0
    g.add("checkpointing", 2.0)  # Written from 20 to 22 s.
    now[0] = 30.0
    g.step_done(100)
    now[0] = 35.0
    g.end_training(100, failed=True)  # Nothing done after 30 s: detection.
    now[0] = 40.0
    g.begin_training(50)  # Restored at step 50: 50..100 are redone.
    now[0] = 60.0
    g.end_training(150)
    now[0] = 62.0
    assert g.totals() == pytest.approx(
        {
            "train": 18.0 + 10.0,
            "checkpointing": 2.0,
            "recovery": 5.0 + 5.0,
            "start-up": 10.0,
            "redone": 10.0,
            "other": 2.0,
            "wall": 62.0,
            "percent": 100 * 28.0 / 62.0,
        }
    )
    parts = _parse(g.line())
    assert parts["percent"] == 45.2 and parts["wall"] == 62.0
    assert sum(parts[p] for p in PARTS) == pytest.approx(parts["wall"])
    assert g.scalars()["start_up_secs"] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="Argument `part` must be one of"):
        g.add("train", 1.0)


def test_process_start_is_before_now():
    start = goodput.process_start_secs()
    assert 0.0 < time.monotonic() - start < 3600.0


def _parts_of(output):
    found = [_parse(m.group(0)) for m in LINE.finditer(output)]
    assert found, output[-3000:]
    return found


@pytest.mark.slow
def test_a_local_job_accounts_its_wall_time(tmp_path):
    model_dir = str(tmp_path / "model")
    marker = uuid.uuid4().hex
    start = time.monotonic()
    proc = subprocess.Popen(
        [
            sys.executable,
            TRAIN,
            "--model=digits",
            "--epochs=2",
            "--checkpoint_every_steps=20",
            "--log_every_steps=50",
            f"--model_dir={model_dir}",
        ],
        env=_env(marker),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if LINE.match(line):
                seen_secs = time.monotonic() - start  # The line's wall time.
        _, stderr = proc.communicate(timeout=900)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    output = "".join(lines)
    every = _parts_of(output)
    assert len(every) == 1  # The job's last line; each epoch's line ends with
    # the goodput so far, in percent.
    epochs = re.findall(r"^epoch \d/2: .*; goodput (\d+\.\d)%$", output, re.M)
    assert len(epochs) == 2, output[-3000:]
    last = every[-1]
    assert output.splitlines()[-1].startswith("goodput: ")
    # The parts sum to the wall time, which is the process's age then.
    assert sum(last[p] for p in PARTS) == pytest.approx(last["wall"], abs=0.4)
    assert last["wall"] == pytest.approx(seen_secs, abs=3.0)
    # The percent is train over wall; the line rounds all three to 0.1.
    low = 100 * (last["train"] - 0.05) / (last["wall"] + 0.05) - 0.05
    high = 100 * (last["train"] + 0.05) / (last["wall"] - 0.05) + 0.05
    assert low <= last["percent"] <= high, last
    assert last["checkpointing"] > 0 and last["start_up"] > 0 and last["train"] > 0
    assert last["recovery"] == 0 and last["redone"] == 0
    scalars = tensorboard_scalars(paths.tensorboard_dir(model_dir))
    assert [s for s, _ in scalars["goodput/percent"]][-1] == 200
    assert {f"goodput/{p}_secs" for p in PARTS} <= set(scalars)
    assert _wait_no_marked(marker) == []


@pytest.mark.slow
@pytest.mark.xdist_group("downpour_launch_ps0_killed")
def test_a_lost_ps_costs_recovery_time(downpour_launch_ps0_killed):
    returncode, stdout, stderr = downpour_launch_ps0_killed
    assert returncode == 0, stderr[-3000:]
    last = _parts_of(stdout)[-1]
    assert sum(last[p] for p in PARTS) == pytest.approx(last["wall"], abs=0.4)
    # Detecting the loss, the task's restart and the restore.
    assert last["recovery"] > 1.0
    assert last["checkpointing"] > 0 and last["train"] > 0
