"""A task that gets SIGTERM tells the chief first (`cluster.announce`).

Real gRPC listeners and real task processes: the listener and the call in
this process, a `server_main` task told where the listener is, and (slow) a
launched job whose worker is SIGTERMed mid-fit.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid

import portpicker
import pytest

from tests.fixtures.launch import ROOT
from tests.fixtures.ps_kill import _pids, _task_pid, checkpoint_written, start_job
from tf_distbelief import paths
from tf_distbelief.cluster import announce
from tf_distbelief.faults import goodput


@pytest.fixture
def listener():
    lines = []
    heard = announce.Listener("127.0.0.1", report=lines.append)
    heard.lines = lines
    yield heard
    heard.stop()


def test_an_announcement_is_heard_named_and_remembered(listener):
    assert listener.address.startswith("127.0.0.1:")
    assert announce.announce(
        listener.address, "/job:worker/task:3", "10.0.0.7:2222", "SIGTERM"
    )
    assert listener.lines == [
        "worker 3 at 10.0.0.7:2222 announced it is stopping (SIGTERM): an "
        "announced loss, not a failure; its steps go to the other workers until "
        "it serves again"
    ]
    (said,) = listener.received
    assert (said.task, said.address, said.signal) == (
        "/job:worker/task:3",
        "10.0.0.7:2222",
        "SIGTERM",
    )
    assert announce.announced("/job:worker/task:3") == said
    assert announce.announced("/job:worker/task:3", within_secs=-1.0) is None
    assert announce.announced("/job:worker/task:4") is None
    # A word that is not an announcement gets no answer and no line.
    port = int(listener.address.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert c.recv(16) == b""
    assert len(listener.received) == 1
    odd = announce.Announcement("chief", "h:1", "SIGTERM", 0.0)
    assert odd.describe() == "chief at h:1 announced it is stopping (SIGTERM)"
    assert announce.announce(listener.address, "/job:ps/task:0", "h:1", "SIGTERM")
    assert listener.lines[-1] == (
        "ps 0 at h:1 announced it is stopping (SIGTERM): an announced loss, not "
        "a failure; its variables are restored from the last checkpoint once it "
        "serves again (ps recovery)"
    )


def test_an_announcement_nobody_hears_is_refused_at_once(listener):
    address = listener.address
    listener.stop()
    start = time.monotonic()
    assert not announce.announce(address, "/job:worker/task:0", "h:1", "SIGTERM")
    # Refused, not waited out (the deadline is 3 s).
    assert time.monotonic() - start < announce.ANNOUNCE_TIMEOUT_SECS


def test_where_a_task_announces():
    jobs = {"chief": ["chief-0.svc:2222"], "worker": ["w:2222"]}
    assert announce.address_for(jobs, {}) is None
    assert announce.address_for(jobs, {announce.PORT_ENV: "2300"}) == (
        "chief-0.svc:2300"
    )
    assert announce.address_for({"chief": {0: "[::1]:2222"}}, {announce.PORT_ENV: "9"})
    assert (
        announce.address_for(
            jobs, {announce.ADDRESS_ENV: "127.0.0.1:5", announce.PORT_ENV: "9"}
        )
        == "127.0.0.1:5"
    )
    assert announce.address_for({"worker": ["w:1"]}, {announce.PORT_ENV: "9"}) is None
    with pytest.raises(ValueError, match=r"Argument `port` must be an integer in"):
        announce.Listener("127.0.0.1", 70000)
    with pytest.raises(ValueError, match=r"Argument `timeout_secs` must be > 0"):
        announce.announce("127.0.0.1:1", "/job:ps/task:0", "h:1", "SIGTERM", 0.0)


def test_a_tf_config_chief_listens_where_the_environment_says(monkeypatch):
    from tf_distbelief.job import runner

    monkeypatch.delenv(announce.PORT_ENV, raising=False)
    assert runner._listen_for_announcements(print) is None
    monkeypatch.setenv(announce.PORT_ENV, "22x3")
    with pytest.raises(
        ValueError,
        match=r"^Environment variable `TF_DISTBELIEF_ANNOUNCE_PORT` must be a port "
        r"in 1\.\.65535\. Received: '22x3' \(where the chief hears",
    ):
        runner._listen_for_announcements(print)
    port = portpicker.pick_unused_port()
    monkeypatch.setenv(announce.PORT_ENV, str(port))
    lines = []
    listener = runner._listen_for_announcements(lines.append)
    try:
        # On every interface: the tasks call the chief's host at that port.
        jobs = {"chief": [f"127.0.0.1:{portpicker.pick_unused_port()}"]}
        to = announce.address_for(jobs)
        assert to == f"127.0.0.1:{port}"
        assert announce.announce(to, "/job:worker/task:0", "w:1", "SIGTERM")
        assert lines[0].startswith("worker 0 at w:1 announced it is stopping")
    finally:
        listener.stop()


def test_announced_losses_follow_the_goodput_line():
    now = [0.0]
    g = goodput.Goodput(0.0, clock=lambda: now[0])
    assert g.losses_line() is None
    now[0] = 52.25
    g.announced_loss("worker 1 at h:1 announced it is stopping (SIGTERM)")
    now[0] = 60.0
    g.announced_loss("ps 0 at h:2 announced it is stopping (SIGTERM)")
    assert g.losses_line() == (
        "announced losses: 2 (worker 1 at h:1 announced it is stopping (SIGTERM) "
        "at 52.2 s; ps 0 at h:2 announced it is stopping (SIGTERM) at 60.0 s)"
    )


def test_a_task_announces_sigterm_before_it_leaves(listener):
    """A `server_main` ps task told the listener's address (as a local cluster
    tells its tasks): at SIGTERM the chief's line comes first, then the
    task's leaving line names the listener; it still exits 0 at once."""
    address = f"127.0.0.1:{portpicker.pick_unused_port()}"
    cluster = {
        "chief": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
        "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
        "ps": [address],
    }
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "ps", "index": 0}})
    env = dict(os.environ, TF_CONFIG=tf_config)
    env[announce.ADDRESS_ENV] = listener.address
    proc = subprocess.Popen(
        [sys.executable, "-m", "tf_distbelief.cluster.server_main"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == f"ps 0 serving at {address}\n"
        assert listener.received == []
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert (
        out == f"ps 0 leaving: SIGTERM (announced to the chief at {listener.address})\n"
    )
    assert [a.task for a in listener.received] == ["/job:ps/task:0"]
    assert listener.lines[0].startswith(
        f"ps 0 at {address} announced it is stopping (SIGTERM): "
    )


@pytest.mark.slow
def test_a_worker_sigtermed_mid_fit_is_an_announced_loss(tmp_path):
    """`launch/train.py --model=digits` (2 workers, 2 ps, 1,000 steps):
    worker 1 SIGTERMed after the first epoch. The chief hears it from the
    worker before the worker exits (the chief's line, then the worker's
    leaving line naming the chief, then the local cluster's restart line
    saying it was announced), and the job trains to its end."""
    marker = uuid.uuid4().hex
    model_dir = tmp_path / "model"
    proc = start_job(
        [
            "--model=digits",
            "--num_workers=2",
            "--num_ps=2",
            "--epochs=10",
            "--steps_per_epoch=100",
            "--log_every_steps=10",
            f"--model_dir={model_dir}",
            "--checkpoint_every_steps=100",
        ],
        marker,
        tmp_path,
    )
    out_file = tmp_path / "out"
    deadline = time.monotonic() + 600
    try:
        while not re.search(r"^epoch 1/10: ", out_file.read_text(), re.M):
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the first epoch never ended"
            time.sleep(0.05)
        os.kill(_task_pid(marker, "worker", 1), signal.SIGTERM)
        proc.wait(timeout=900)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while _pids(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pids(marker) == [], "processes left behind"
    out = out_file.read_text()
    assert proc.returncode == 0, (tmp_path / "err").read_text()[-3000:]
    lines = out.splitlines()
    heard = [
        i
        for i, line in enumerate(lines)
        if re.fullmatch(
            r"worker 1 at 127\.0\.0\.1:\d+ announced it is stopping \(SIGTERM\): an "
            r"announced loss, not a failure; its steps go to the other workers "
            r"until it serves again",
            line,
        )
    ]
    assert len(heard) == 1, out
    worker = lines[heard[0]].split()[3]
    restarted = [
        i
        for i, line in enumerate(lines)
        if line.startswith(
            f"local cluster: worker:1 at {worker} exited (code 0, after announcing "
            "it was stopping (SIGTERM)); restarted on the same address, serving "
            "after "
        )
    ]
    # Heard before the worker exited: its restart comes after the line.
    assert len(restarted) == 1 and restarted[0] > heard[0], out
    log_dir = paths.cluster_log_dir(str(model_dir))
    with open(os.path.join(log_dir, "worker_1.log")) as f:
        log = f.read()
    assert re.search(
        r"^worker 1 leaving: SIGTERM \(announced to the chief at "
        r"127\.0\.0\.1:\d+\)$",
        log,
        re.M,
    ), log
    assert re.search(r"^epoch 10/10: steps 1000/1000 ", out, re.M), out
    accuracy = float(re.findall(r"^test accuracy: ([0-9.]+)$", out, re.M)[-1])
    assert accuracy >= 0.9
    goodput_at = next(i for i, line in enumerate(lines) if line.startswith("goodput: "))
    assert re.fullmatch(
        rf"announced losses: 1 \(worker 1 at {re.escape(worker)} announced it is "
        r"stopping \(SIGTERM\) at \d+\.\d s\)",
        lines[goodput_at + 1],
    ), out


@pytest.mark.slow
def test_a_ps_sigtermed_mid_fit_is_recovered_as_an_announced_loss(tmp_path):
    """`launch/train.py --model=digits` (2 workers, 2 ps), a checkpoint every
    20 steps, ps 0 SIGTERMed once the second is written: the chief's line
    names the announcement before the ps recovery's, whose line names it as
    the cause, and the job restores the checkpoint and trains to its end."""
    marker = uuid.uuid4().hex
    model_dir = tmp_path / "model"
    proc = start_job(
        [
            "--model=digits",
            "--num_workers=2",
            "--num_ps=2",
            f"--model_dir={model_dir}",
            "--checkpoint_every_steps=20",
        ],
        marker,
        tmp_path,
    )
    ready = checkpoint_written(model_dir, 40)
    deadline = time.monotonic() + 600
    try:
        while not ready():
            assert proc.poll() is None, (tmp_path / "err").read_text()[-3000:]
            assert time.monotonic() < deadline, "the second checkpoint never came"
            time.sleep(0.05)
        os.kill(_task_pid(marker, "ps", 0), signal.SIGTERM)
        proc.wait(timeout=900)
    finally:
        proc.kill()
    deadline = time.monotonic() + 30
    while _pids(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pids(marker) == [], "processes left behind"
    out = (tmp_path / "out").read_text()
    assert proc.returncode == 0, (tmp_path / "err").read_text()[-3000:]
    lines = out.splitlines()
    heard = [
        i
        for i, line in enumerate(lines)
        if re.fullmatch(
            r"ps 0 at 127\.0\.0\.1:\d+ announced it is stopping \(SIGTERM\): an "
            r"announced loss, not a failure; its variables are restored from the "
            r"last checkpoint once it serves again \(ps recovery\)",
            line,
        )
    ]
    lost = [
        i
        for i, line in enumerate(lines)
        if re.match(
            r"ps task lost: (?:\S+ at \S+, )*/job:ps/task:0 at 127\.0\.0\.1:\d+.* "
            r"\(\w+Error; ps 0 announced it was stopping \(SIGTERM\)\)$",
            line,
        )
    ]
    assert len(heard) == 1 and len(lost) == 1 and heard[0] < lost[0], out
    assert re.search(r"^restored ckpt-\d+ \(step \d+\): \d+ values equal", out, re.M)
    assert re.search(r"^epoch 5/5: steps 500/500 ", out, re.M), out
    assert re.search(r"^announced losses: 1 \(ps 0 at ", out, re.M), out
