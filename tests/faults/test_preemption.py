"""The save at a preemption signal (`faults.preemption`), in this process.

The launch script's SIGTERM and SIGUSR1 end to end are in
tests/job/test_launch.py; here the request, the trainer's save, and a save
abandoned at the end of the grace period, with real checkpoint writes.
"""

import os
import re
import time

import pytest
import tensorflow as tf

from tf_distbelief import job
from tf_distbelief.faults import preemption, resume


@pytest.fixture
def stopped():
    """The lines the armed preemption's `stop` got; disarmed after the test."""
    lines = []
    yield lines
    preemption.disarm()


def _wait_for(lines, secs=10.0):
    deadline = time.monotonic() + secs
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    return lines


def test_a_request_is_answered_by_the_trainers_save_in_one_line(stopped):
    armed = preemption.arm(30.0, stopped.append)
    calls = []

    def save():
        calls.append("save")
        return 346, True

    with preemption.saving(save, lambda: calls.append("cancel")):
        assert preemption.can_save()
        preemption.save_and_stop(save)  # Nothing requested: nothing done.
        assert calls == [] and stopped == []
        armed.request("SIGTERM")
        assert preemption.requested()
        preemption.save_and_stop(save)  # The trainer's step boundary.
    # The steps not started were cancelled first (from the watch thread).
    assert calls == ["cancel", "save"]
    assert len(stopped) == 1
    assert re.fullmatch(
        r"SIGTERM: job stopped at step 346, saved at the signal in \d+\.\d s",
        stopped[0],
    )
    assert not preemption.requested() and not preemption.can_save()


def test_a_signal_before_the_first_step_says_so(stopped):
    armed = preemption.arm(30.0, stopped.append)
    with preemption.saving(lambda: (0, False), None):
        armed.request("SIGTERM")
        preemption.save_and_stop(lambda: (0, False))
    assert stopped == ["SIGTERM: job stopped before its first step ended"]


def test_a_cancelled_wait_still_saves_and_any_other_error_stops_unsaved(stopped):
    armed = preemption.arm(30.0, stopped.append)
    with preemption.saving(lambda: (120, False), None, (tf.errors.CancelledError,)):
        armed.request("SIGUSR1")
        raise tf.errors.CancelledError(None, None, "the step was cancelled")
    assert stopped == [
        "SIGUSR1: job stopped at step 120, its checkpoint already written"
    ]
    stopped.clear()
    armed = preemption.arm(30.0, stopped.append)
    with pytest.raises(ValueError, match="bad"):
        with preemption.saving(lambda: (0, True)):
            armed.request("SIGTERM")
            raise ValueError("bad")
    assert stopped == [
        "SIGTERM: job stopped, not saved at the signal (training raised ValueError)"
    ]


def test_a_save_past_the_grace_period_is_abandoned_whole(stopped, tmp_path):
    variable = tf.Variable([1.0, 2.0])
    manager = tf.train.CheckpointManager(
        tf.train.Checkpoint(v=variable), str(tmp_path), max_to_keep=5
    )
    first = resume.save_whole(manager, 1)
    armed = preemption.arm(0.05, stopped.append)
    armed.request("SIGTERM")
    assert _wait_for(stopped) == [
        "SIGTERM: job stopped; the save at the signal did not finish within "
        "--preemption_grace_secs=0.05 and was abandoned, nothing of it kept"
    ]
    # A write that comes to its commit after that never becomes the latest,
    # and nothing of it stays.
    variable.assign([3.0, 4.0])
    with pytest.raises(resume.CheckpointWriteError, match="grace period after SIGTERM"):
        resume.save_whole(manager, 2)
    assert tf.train.latest_checkpoint(str(tmp_path)) == first
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint",
        "ckpt-1.data-00000-of-00001",
        "ckpt-1.index",
    ]


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("preemption_grace_secs", -1.0, r"`preemption_grace_secs` must be a finite"),
        ("preemption_grace_secs", float("inf"), r"`preemption_grace_secs` must be"),
        ("preemption_signal", "SIGKILL", r"`preemption_signal` must be None or one"),
    ],
)
def test_preemption_settings_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        job.JobConfig(**{field: value}).validate()
