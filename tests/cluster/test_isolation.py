"""Network isolation of the local job (issue 16).

TensorFlow's servers bind every interface. The tests read the host's listening
sockets (psutil, from the kernel's tables) and never connect anywhere but
127.0.0.0/8.
"""

import ipaddress
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import psutil
import pytest
from absl import logging

from tests.fixtures.launch import (
    README_ARGS,
    ROOT,
    TRAIN,
    _accuracy,
    _env,
    _marked_pids,
    _wait_no_marked,
)
from tf_distbelief.cluster.network import isolation

WARNING = "tf_distbelief: the local cluster's TensorFlow servers listen on every"
_POLL_SECS = 0.05


def _unavailable():
    """Why isolation cannot work on this machine, or None."""
    unshare, ip = isolation.find_tool("unshare"), isolation.find_tool("ip")
    if not sys.platform.startswith("linux") or not unshare or not ip:
        return f"no Linux unshare/ip ({sys.platform}, {unshare}, {ip})"
    return isolation.probe(unshare, ip)


_UNAVAILABLE = _unavailable()
needs_namespaces = pytest.mark.skipif(
    _UNAVAILABLE is not None, reason=f"no namespaces here: {_UNAVAILABLE}"
)


def _default_sigint():
    # An ignored signal stays ignored across exec, and a shell without job
    # control starts a background command (`cmd &`) with SIGINT ignored: the
    # job would then never see the SIGINT sent to it. Python installs its
    # KeyboardInterrupt handler only where SIGINT is at its default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Watch:
    """`launch/train.py args` run to the end, its host sockets polled meanwhile.

    Attributes:
      returncode, stdout, stderr: of the job.
      listening: `{(pid, ip, port)}` of the job's listening inet sockets in the
        host's network namespace, over all polls.
      namespaces: the network namespaces the job's processes were seen in once
        the local cluster was up.
      most_processes: the most job processes one poll saw once the local
        cluster was up.
    """

    def __init__(self, args, signal_after=None, timeout_secs=900.0):
        marker = uuid.uuid4().hex
        self.marker = marker
        proc = subprocess.Popen(
            [sys.executable, TRAIN, *args],
            # Unbuffered: the "local cluster:" line is read while the job runs.
            env=_env(marker, PYTHONUNBUFFERED="1"),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=_default_sigint,
        )
        out, err = [], []
        started = threading.Event()

        def read(stream, lines, watch_for=None):
            for line in stream:
                lines.append(line)
                if watch_for and line.startswith(watch_for):
                    started.set()

        readers = [
            threading.Thread(target=read, args=(proc.stdout, out, "local cluster:")),
            threading.Thread(target=read, args=(proc.stderr, err)),
        ]
        for reader in readers:
            reader.start()
        self.listening, self.namespaces, self.most_processes = set(), set(), 0
        deadline = time.monotonic() + timeout_secs
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if started.is_set() and signal_after is not None:
                    proc.send_signal(signal_after)
                    signal_after = None
                self._poll(set(_marked_pids(marker)), started.is_set())
                time.sleep(_POLL_SECS)
            proc.wait(max(1.0, deadline - time.monotonic()))
        finally:
            proc.kill()
            for reader in readers:
                reader.join(30)
        self.returncode = proc.returncode
        self.stdout, self.stderr = "".join(out), "".join(err)

    def _poll(self, pids, cluster_up):
        # Before the cluster is up the launcher may not have re-executed yet,
        # and the probe and `ip` run as child processes.
        if cluster_up:
            self.most_processes = max(self.most_processes, len(pids))
        for pid in pids if cluster_up else ():
            try:
                self.namespaces.add(os.readlink(f"/proc/{pid}/ns/net"))
            except OSError:
                continue  # Ended meanwhile.
        for conn in psutil.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN and conn.pid in pids:
                self.listening.add((conn.pid, conn.laddr.ip, conn.laddr.port))

    def exposed(self):
        """The `(pid, ip, port)` listening on a non-loopback address."""
        return {s for s in self.listening if not ipaddress.ip_address(s[1]).is_loopback}

    def cluster_ports(self):
        """The worker and ps ports of the "local cluster: ..." line."""
        line = re.search(r"^local cluster: .*$", self.stdout, re.M)
        assert line, self.stdout[-3000:] + self.stderr[-3000:]
        return [int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", line.group())]


@pytest.mark.slow
@needs_namespaces
def test_readme_job_listens_on_no_host_interface(tmp_path):
    model_dir = tmp_path / "run"
    watch = _Watch([*README_ARGS, f"--model_dir={model_dir}"])
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert _accuracy(watch.stdout) >= 0.95
    assert _wait_no_marked(watch.marker) == []
    # Seen while the chief, its hung task watch (a process of its own:
    # `cluster.local.hung_tasks`), 2 workers and 2 ps ran: none in the host's
    # network namespace, none listening there.
    assert watch.most_processes == 6
    assert os.readlink("/proc/self/ns/net") not in watch.namespaces
    assert watch.exposed() == set()
    assert watch.listening == set()
    assert WARNING not in watch.stderr
    # Files on the host filesystem belong to the user who ran the job.
    written = [model_dir, *model_dir.rglob("*")]
    assert len(written) > 3
    assert {(p.stat().st_uid, p.stat().st_gid) for p in written} == {
        (os.getuid(), os.getgid())
    }


@pytest.mark.slow
def test_without_isolation_one_warning_names_the_open_ports():
    watch = _Watch(["--noisolate_network", "--epochs=2", "--num_ps=2"])
    assert watch.returncode == 0, watch.stderr[-3000:]
    assert _wait_no_marked(watch.marker) == []
    warnings = [line for line in watch.stderr.splitlines() if WARNING in line]
    assert len(warnings) == 1, watch.stderr[-3000:]
    reason = "Not isolated: network isolation is off (--noisolate_network)."
    assert reason in warnings[0]
    named = re.search(
        r"\(ports: chief (\d+), worker (\d+) (\d+), ps (\d+) (\d+)\)", warnings[0]
    )
    assert named, warnings[0]
    worker_and_ps = watch.cluster_ports()
    assert [int(p) for p in named.groups()[1:]] == worker_and_ps
    # What the warning says is so: the tasks listen beyond loopback.
    exposed_ports = {port for _, _, port in watch.exposed()}
    assert set(worker_and_ps) <= exposed_ports


@pytest.mark.slow
@needs_namespaces
@pytest.mark.parametrize(
    # The job's handler (`job.stopping`) ends the tasks, then exits with
    # 128 + the signal, as a shell reports a job a signal ended.
    "sig,returncode",
    [(signal.SIGTERM, 143), (signal.SIGINT, 130)],
)
def test_a_signal_to_the_launcher_ends_the_isolated_job(sig, returncode):
    """The launcher is the job (re-executed in place): the same pid, so the
    signal and the exit status need no forwarding."""
    watch = _Watch([*README_ARGS, "--epochs=200"], signal_after=sig)
    assert watch.returncode == returncode, watch.stderr[-3000:]
    assert "test accuracy" not in watch.stdout
    assert _wait_no_marked(watch.marker) == []
    assert os.readlink("/proc/self/ns/net") not in watch.namespaces


@pytest.mark.slow
def test_python_api_local_cluster_warns_once():
    marker = uuid.uuid4().hex
    script = textwrap.dedent("""
        from tf_distbelief import cluster
        with cluster.LocalCluster(num_workers=1, num_ps=1) as local:
            local.restart("worker", 0)
            print(local.jobs, flush=True)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", script],
        env=_env(marker),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if WARNING in line]
    assert len(warnings) == 1, proc.stderr[-3000:]
    assert "Not isolated: a LocalCluster started from Python runs in" in warnings[0]
    assert _wait_no_marked(marker) == []


# The decision, with no cluster and no namespace.

_ALLOWED = dict(
    requested=True,
    inside=False,
    tf_config_given=False,
    platform="linux",
    running=False,
    unshare="/usr/bin/unshare",
    ip="/usr/sbin/ip",
)


def _no_probe(unshare, ip):
    raise AssertionError("probed although another condition decides")


@pytest.mark.parametrize(
    "change,reason",
    [
        (dict(requested=False), r"network isolation is off \(--noisolate_network\)"),
        (dict(tf_config_given=True), r"TF_CONFIG names a cluster"),
        (dict(platform="darwin"), r"network namespaces need Linux \(darwin\)"),
        (dict(running=True), r"the program is already running \(TensorFlow"),
        (dict(unshare=None), r"no `unshare` program \(util-linux\) found"),
        (dict(ip=None), r"no `ip` program \(iproute2\) found"),
    ],
)
def test_decide_falls_back_with_a_reason(change, reason):
    decision = isolation.decide(**dict(_ALLOWED, **change), probe_fn=_no_probe)
    assert decision.action == "exposed"
    assert re.match(reason, decision.reason)


def test_decide_enters_only_when_the_probe_works():
    assert isolation.decide(**_ALLOWED, probe_fn=lambda u, i: None).action == "enter"
    failed = isolation.decide(
        **_ALLOWED, probe_fn=lambda u, i: "unshare: Operation not permitted"
    )
    assert failed == isolation.Decision(
        "exposed",
        "user/network namespaces unavailable: unshare: Operation not permitted",
    )


def test_decide_inside_wins_over_everything():
    assert isolation.decide(
        **dict(_ALLOWED, inside=True, requested=False, platform="darwin"),
        probe_fn=_no_probe,
    ) == isolation.Decision("inside")


def test_probe_reports_a_failing_unshare():
    error = isolation.probe("/bin/false", "/usr/sbin/ip")
    assert error == "`unshare --user --map-root-user --net` failed: "
    assert "No such file" in isolation.probe("/nonexistent/unshare", "ip")


@pytest.mark.parametrize(
    "argv,value",
    [
        ([], True),
        (["--model=digits", "--num_ps=2"], True),
        (["--noisolate_network"], False),
        (["--isolate_network=false", "--seed=3"], False),
        (["--noisolate_network", "--isolate_network"], True),
        (["--", "--noisolate_network"], True),  # Not a flag after `--`.
        (["--isolate_network=maybe"], False),  # The full parse then fails.
    ],
)
def test_flag_value_reads_only_its_flag(argv, value):
    assert isolation.flag_value(["train.py", *argv]) is value


def test_not_inside_without_the_marker_or_in_the_host_namespace(monkeypatch):
    monkeypatch.delenv(isolation.ENV_MARKER, raising=False)
    assert not isolation.inside_private_network()
    # A marker that names this very namespace (inherited outside the job).
    monkeypatch.setenv(isolation.ENV_MARKER, os.readlink("/proc/self/ns/net"))
    assert not isolation.inside_private_network()


def test_warning_is_one_line_naming_every_port(monkeypatch):
    jobs = {
        "chief": ["127.0.0.1:2220"],
        "worker": ["127.0.0.1:2221", "127.0.0.1:2222"],
        "ps": ["127.0.0.1:2223"],
    }
    logged = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *a: logged.append(fmt % a))
    monkeypatch.delenv(isolation.ENV_MARKER, raising=False)
    assert isolation.warn_if_exposed(jobs)
    (text,) = logged
    assert "\n" not in text
    assert text.startswith(WARNING)
    assert "(ports: chief 2220, worker 2221 2222, ps 2223)" in text
    assert "run code as this user" in text
