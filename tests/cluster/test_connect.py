"""Bounded start-up: the chief names the tasks it cannot reach (issue 10)."""

import json
import os
import socket
import subprocess
import sys
import time

import portpicker
import pytest

from tests.fixtures.launch import ROOT
from tf_distbelief.cluster import connect

TRAIN = os.path.join(ROOT, "launch", "train.py")


def test_wait_for_tasks_names_every_unreachable_task():
    closed = [portpicker.pick_unused_port() for _ in range(2)]
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_port = listening.getsockname()[1]
        jobs = {
            "chief": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
            "worker": [f"127.0.0.1:{open_port}"],
            "ps": [f"127.0.0.1:{closed[0]}", f"127.0.0.1:{closed[1]}"],
        }
        start = time.monotonic()
        with pytest.raises(connect.ClusterConnectError) as raised:
            connect.wait_for_tasks(jobs, timeout_secs=1.0)
        assert time.monotonic() - start < 5.0
    message = str(raised.value)
    assert (
        f"/job:ps/task:0 at 127.0.0.1:{closed[0]} (does not accept connections)"
        in message
    )
    assert f"/job:ps/task:1 at 127.0.0.1:{closed[1]}" in message
    # A port that accepts connections but is not a TensorFlow server (or is a
    # hung one): TensorFlow would wait on it for ever.
    assert (
        f"/job:worker/task:0 at 127.0.0.1:{open_port} (accepts connections but "
        "does not answer" in message
    )
    assert "/job:chief" not in message
    assert "--connect_timeout_secs=1 s" in message


def test_connect_timeout_must_be_positive():
    with pytest.raises(ValueError, match=r"`connect_timeout_secs` must be > 0"):
        connect.wait_for_tasks({}, timeout_secs=0)


@pytest.mark.slow
@pytest.mark.parametrize("ps_is", ["down", "a plain TCP listener"])
def test_tf_config_chief_whose_ps_does_not_answer_fails_in_time(ps_is):
    chief, worker, ps = (portpicker.pick_unused_port() for _ in range(3))
    listener = socket.socket()
    if ps_is == "a plain TCP listener":  # Accepts, and never says a word.
        listener.bind(("127.0.0.1", ps))
        listener.listen()
    cluster = {
        "chief": [f"127.0.0.1:{chief}"],
        "worker": [f"127.0.0.1:{worker}"],
        "ps": [f"127.0.0.1:{ps}"],
    }
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    worker_proc = subprocess.Popen(
        [sys.executable, "-m", "tf_distbelief.cluster.server_main"],
        env=dict(
            env,
            TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": 0}}
            ),
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # The worker is up (as a live cluster's would be) before the chief starts.
        connect.wait_for_tasks({"worker": cluster["worker"]}, timeout_secs=120)
        timeout_secs = 5

        def chief(timeout_secs):
            start = time.monotonic()
            proc = subprocess.run(
                [sys.executable, TRAIN, f"--connect_timeout_secs={timeout_secs}"],
                env=dict(
                    env,
                    TF_CONFIG=json.dumps(
                        {"cluster": cluster, "task": {"type": "chief", "index": 0}}
                    ),
                ),
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=120,
            )
            return proc, time.monotonic() - start

        # The same chief with a wait of 0.1 s: its start-up and exit, here and now.
        _, overhead = chief(0.1)
        proc, elapsed = chief(timeout_secs)
    finally:
        worker_proc.kill()
        worker_proc.wait()
        listener.close()
    assert proc.returncode != 0
    assert f"/job:ps/task:0 at 127.0.0.1:{ps}" in proc.stderr
    assert "/job:worker/task:0" not in proc.stderr.split("Could not reach")[-1]
    # Within --connect_timeout_secs + 10 s of the chief's start (10.6 s here on
    # an idle machine): the 10 s hold the chief's start-up and exit (TensorFlow's
    # import, 4-5 s idle). On a loaded machine those alone took longer, so the
    # bound is on what the wait adds to a chief that waits 0.1 s.
    assert elapsed - overhead < timeout_secs + 10, (elapsed, overhead)
