"""The punisher's accounting from a job's lines: goodput and steps redone.

The lines are the job's own formats (`faults.goodput.Goodput.line`, the
progress lines, the recovery and resume lines); the long faulted run itself
is a benchmark (benchmarks/README.md, "The punisher").
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

from tests.fixtures.launch import ROOT

_PATH = os.path.join(ROOT, "benchmarks", "punisher.py")
_spec = importlib.util.spec_from_file_location("punisher", _PATH)
punisher = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("punisher", punisher)
_spec.loader.exec_module(punisher)


class _Output:
    """A chief's output as the punisher holds it: `(time, line)` pairs, line
    `i` read at `i` s and known to be written after `i - lag` s."""

    def __init__(self, *lines, lag=0.0):
        self.lines = [(float(i), line) for i, line in enumerate(lines)]
        self.written_after = [at - lag for at, _ in self.lines]

    def poll_lines(self):
        return self.lines


def _life(*lines):
    return types.SimpleNamespace(job=_Output(*lines))


def test_goodput_is_the_last_line_of_a_life():
    job = _Output(
        "goodput: 10.0% (train 4.0 s of 40.0 s; checkpointing 1.0 s, recovery "
        "0.0 s, start-up 35.0 s, redone 0.0 s, other 0.0 s)",
        "step 300/1000: 2000 examples/s, elapsed 5s, ETA 10s",
        "goodput: 50.5% (train 30.3 s of 60.0 s; checkpointing 2.0 s, recovery "
        "5.0 s, start-up 20.0 s, redone 2.5 s, other 0.2 s)",
    )
    assert punisher.goodput_of(job, started=-10.0) == (30.3, 2.5)
    assert punisher.goodput_of(_Output("test accuracy: 0.97"), 0.0) == (0.0, 0.0)


def test_a_killed_life_counts_its_last_epoch_lines_goodput():
    # No goodput line (the chief was killed): the last epoch line's percent
    # (less 0.05, its rounding) of the life's wall time when it was written
    # (line 2, read at 2 s; started at -8 s: 10 s).
    lines = (
        "epoch 1/10: steps 100/1000 loss=0.3000 accuracy=0.9000 2,000 "
        "examples/s, elapsed 5s, ETA 45s; goodput 20.0%",
        "step 150/1000: 2,000 examples/s, elapsed 7s, ETA 40s",
        "epoch 2/10: steps 200/1000 loss=0.2000 accuracy=0.9500 2,000 "
        "examples/s, elapsed 9s, ETA 40s; goodput 40.0%",
    )
    assert punisher.goodput_of(_Output(*lines), started=-8.0) == pytest.approx(
        (0.3995 * 10.0, 0.0)
    )
    # Read a poll after it was written: counted from the read before (1.5 s
    # earlier here), never from the later read.
    late = _Output(*lines, lag=1.5)
    assert punisher.goodput_of(late, started=-8.0) == pytest.approx((0.3995 * 8.5, 0.0))
    # The next life resumed from step 100 (the checkpoint of epoch 2 was
    # not written): epoch 2's training was lost, and redone by that life.
    assert punisher.goodput_of(
        _Output(*lines), started=-8.0, resumed_step=150
    ) == pytest.approx((0.1995 * 8.0, 0.0))
    assert punisher.goodput_of(_Output(*lines), -8.0, resumed_step=0) == (0.0, 0.0)
    assert punisher.goodput_of(_Output(*lines), -8.0, resumed_step=200) == (
        pytest.approx((0.3995 * 10.0, 0.0))
    )


def test_the_step_each_killed_life_was_resumed_from():
    killed = _life(
        "step 100/1000: 2000 examples/s, elapsed 5s, ETA 10s",
        "epoch 1/10: steps 150/1000 loss=0.3 accuracy=0.9; goodput 20.0%",
    )
    # Killed while starting: no step or restore line.
    starting = _life("loading TensorFlow (local job: 2 workers, 2 ps)")
    resumed = _life(
        "Resumed from /m/checkpoints/ckpt-150 at step 150 (epoch 1)",
        "restored ckpt-150 (step 150): 10 values equal the checkpoint bit for bit",
        # A ps recovery later in this life: not where it resumed.
        "restored ckpt-300 (step 300): 10 values equal the checkpoint bit for bit",
        "step 400/1000: 2000 examples/s, elapsed 9s, ETA 6s",
    )
    # No checkpoint yet when it started: trained from step 0.
    over = _life("step 50/1000: 2000 examples/s, elapsed 5s, ETA 10s")
    assert punisher.resumed_steps([killed, starting, resumed]) == [150, 150, None]
    assert punisher.resumed_steps([killed, over, resumed]) == [0, 150, None]


def test_steps_redone_counts_back_to_each_restore_across_lives():
    first = _life(
        "step 100/1000: 2000 examples/s, elapsed 5s, ETA 10s",
        "epoch 1/10: steps 150/1000 loss=0.3 accuracy=0.9 2000 examples/s",
        # A ps lost: restored at 120 after 150 was seen (30 redone).
        "restored ckpt-120 (step 120): 10 values equal the checkpoint bit for bit",
        "step 400/1000: 2000 examples/s, elapsed 9s, ETA 6s",
    )
    # The chief killed after 400; the next life resumes at 360 (40 redone).
    second = _life(
        "Resumed from /m/checkpoints/ckpt-360 at step 360 (epoch 3, 60 steps)",
        "restored ckpt-360 (step 360): 10 values equal the checkpoint bit for bit",
        "step 1000/1000: 2000 examples/s, elapsed 20s, ETA 0s",
    )
    assert punisher.steps_redone([first, second]) == 70


def test_a_lifes_wall_time_by_cause():
    # Lines read at 0, 1, 2, ... s; the life started at -8 s and its exit
    # was seen at 10 s (18 s in all).
    job = _Output(
        "epoch 9/10: steps 900/1000 loss=0.3 accuracy=0.9; goodput 50.0%",
        "epoch 10/10: steps 1000/1000 loss=0.3 accuracy=0.9; goodput 60.0%",
        "step 1000/1000: 2,000 examples/s, elapsed 9s, ETA 0s",
        "",
        "test accuracy: 0.9700",
        "goodput: 48.0% (train 7.2 s of 15.0 s; checkpointing 0.5 s, recovery "
        "1.0 s, start-up 2.0 s, redone 0.3 s, other 4.0 s)",
    )
    parts = punisher.parts_of(job, started=-8.0, ended=10.0)
    # The last epoch line at 1 s, the accuracy at 4 s: 3 s of `other` is the
    # end of the fit; the 3 s after the job's own 15 s are its exit.
    assert parts == {
        "train": 7.2,
        "start-up": 2.0,
        "recovery": 1.0,
        "redone": 0.3,
        "checkpointing": 0.5,
        "end-of-fit": 3.0,
        "chief lost": 0.0,
        "other": 1.0 + 3.0,
    }
    assert sum(parts.values()) == pytest.approx(18.0)
    # Killed before its goodput line: the last epoch line's share trained,
    # the rest lost with the chief.
    killed = _Output(
        "epoch 1/10: steps 100/1000 loss=0.3 accuracy=0.9; goodput 20.0%",
        "epoch 2/10: steps 200/1000 loss=0.2 accuracy=0.9; goodput 40.0%",
    )
    assert punisher.parts_of(killed, started=-9.0, ended=20.0) == pytest.approx(
        dict(
            dict.fromkeys(("train", *punisher.CAUSES), 0.0),
            train=0.3995 * 10.0,
            **{"chief lost": 29.0 - 0.3995 * 10.0},
        )
    )
    # The next life resumed at step 100: epoch 2 (to 200) is lost too.
    assert punisher.parts_of(
        killed, started=-9.0, ended=20.0, resumed_step=100
    ) == pytest.approx(
        dict(
            dict.fromkeys(("train", *punisher.CAUSES), 0.0),
            train=0.1995 * 9.0,
            **{"chief lost": 29.0 - 0.1995 * 9.0},
        )
    )
    # Killed after the job's last epoch line (at 1 s), before its goodput
    # line: from that line to the kill is the end of the fit.
    ended = _Output(
        "epoch 9/10: steps 900/1000 loss=0.3 accuracy=0.9; goodput 50.0%",
        "epoch 10/10: steps 1000/1000 loss=0.3 accuracy=0.9; goodput 60.0%",
        "test accuracy: 0.9700",
    )
    assert punisher.parts_of(ended, started=-9.0, ended=31.0) == pytest.approx(
        dict(
            dict.fromkeys(("train", *punisher.CAUSES), 0.0),
            train=0.5995 * 10.0,
            **{"end-of-fit": 30.0, "chief lost": 10.0 - 0.5995 * 10.0},
        )
    )


def test_the_by_cause_table():
    causes = dict.fromkeys(("train", *punisher.CAUSES), 0.0)
    causes.update({"train": 90.0, "start-up": 6.0, "end-of-fit": 4.0})
    table = punisher.by_cause_table(causes, 100.0).splitlines()
    assert table[0] == (
        "| train | start-up | recovery | redone | checkpointing | end-of-fit | "
        "chief lost | other | wall |"
    )
    assert table[2] == (
        "| 90.0 s (90.0%) | 6.0 s (6.0%) | 0.0 s (0.0%) | 0.0 s (0.0%) | 0.0 s "
        "(0.0%) | 4.0 s (4.0%) | 0.0 s (0.0%) | 0.0 s (0.0%) | 100.0 s |"
    )
