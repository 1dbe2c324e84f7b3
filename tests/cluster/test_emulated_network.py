"""The emulated network: each local task behind a NIC of a set rate (tc htb).

The real check runs a child process in the local cluster's private network
namespace: a ps variable of known size is read by the chief through a ps NIC
shaped to 50 Mbit/s, and the measured rate must be within 15% of it; then the
same read through an unshaped cluster, in the same namespace, must be far
faster.
"""

import json
import os
import re
import subprocess
import sys

import pytest

import tf_distbelief as tfdb
from tests.fixtures.launch import ROOT, TRAIN
from tf_distbelief.cluster import isolation, local, network

RATE_BITS_PER_SEC = 50 * 10**6
# 12.5 MB: 2 s at 50 Mbit/s, long against the connection's start and htb's burst.
VARIABLE_BYTES = 12_500_000


def _unavailable():
    """Why the private namespace (and so the emulated network) is not here."""
    unshare, ip = isolation.find_tool("unshare"), isolation.find_tool("ip")
    if not sys.platform.startswith("linux") or not unshare or not ip:
        return f"no Linux unshare/ip ({sys.platform}, {unshare}, {ip})"
    if not isolation.find_tool("tc"):
        return "no iproute2 tc"
    return isolation.probe(unshare, ip)


_UNAVAILABLE = _unavailable()


@pytest.mark.parametrize(
    "text, bits",
    [
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("10Gbit", 10**10),
        ("2.5gbit", 25 * 10**8),
        ("500kbit", 5 * 10**5),
        (123456, 123456),
        ("123456", 123456),
    ],
)
def test_parse_rate(text, bits):
    assert network.parse_rate(text) == bits


@pytest.mark.parametrize(
    "bad", ["fast", "1gbps", "-1mbit", "0", 5, "2tbit", True, 1.5e9]
)
def test_parse_rate_refuses_with_the_forms_allowed(bad):
    with pytest.raises(ValueError, match=r"`emulate_nic` must be a rate such as 1gbit"):
        network.parse_rate(bad, "emulate_nic")


def test_rates_and_their_line():
    assert network.NicRates.create(None) is None
    rates = network.NicRates.create("1gbit")
    assert rates == network.NicRates(10**9, 10**9)
    assert rates.describe() == "every task's NIC at 1 Gbit/s in and out"
    both = network.NicRates.create("1gbit", "10gbit")
    assert both.describe() == (
        "worker and chief NICs at 1 Gbit/s, ps NICs at 10 Gbit/s, in and out"
    )
    with pytest.raises(ValueError, match=r"`ps_nic_bandwidth` needs `nic_bandwidth`"):
        network.NicRates.create(None, "1gbit")


def test_each_task_port_gets_a_class_in_and_out():
    commands = network._commands(
        {"chief": [1000], "worker": [2000], "ps": [3000]},
        network.NicRates(10**9, 10**8),
    )
    assert commands[0][:8] == (
        "qdisc",
        "add",
        "dev",
        "lo",
        "root",
        "handle",
        "1:",
        "htb",
    )
    filters = [
        (c[c.index("u32") + 3], c[c.index("u32") + 4], c[-1])
        for c in commands
        if c[0] == "filter"
    ]
    assert filters == [
        ("dport", "1000", "1:10"),
        ("sport", "1000", "1:11"),
        ("dport", "2000", "1:12"),
        ("sport", "2000", "1:13"),
        ("dport", "3000", "1:14"),
        ("sport", "3000", "1:15"),
    ]
    rates = [c[c.index("rate") + 1] for c in commands if c[0] == "class"]
    assert rates == ["1000000000bit"] * 4 + ["100000000bit"] * 2


def test_outside_a_private_namespace_it_is_refused_before_any_task_starts():
    assert not isolation.inside_private_network()
    cluster = local.LocalCluster(1, 1, nic_bandwidth="1gbit")
    with pytest.raises(tfdb.EmulatedNetworkError, match=r"private network namespace"):
        cluster.start()
    assert cluster.processes == {}
    assert issubclass(tfdb.EmulatedNetworkError, tfdb.ConfigError)


def test_a_bad_rate_is_refused_when_the_cluster_is_made():
    with pytest.raises(ValueError, match=r"`nic_bandwidth` must be a rate"):
        local.LocalCluster(1, 1, nic_bandwidth="fast")


_CHILD = r"""
import json, os, sys, time
from tf_distbelief.cluster import isolation
isolation.enter_private_network()
import tensorflow as tf
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.cluster import local

def measure(rate):
    with local.LocalCluster(1, 1, nic_bandwidth=rate) as cluster:
        strategy = strategy_lib.DistBeliefStrategy(cluster.resolver)
        with strategy.scope():
            v = tf.Variable(tf.zeros([int(sys.argv[1]) // 4], tf.float32))
        v.read_value().numpy()  # The connections and the function, first.
        rates = []
        for _ in range(3):
            start = time.monotonic()
            nbytes = v.read_value().numpy().nbytes
            rates.append(nbytes * 8 / (time.monotonic() - start))
        return sorted(rates)[1]

print(json.dumps({"shaped": measure(sys.argv[2]), "unshaped": measure(None)}))
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no namespaces: {_UNAVAILABLE}")
def test_a_fetch_through_the_emulated_nic_runs_at_its_rate():
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, str(VARIABLE_BYTES), str(RATE_BITS_PER_SEC)],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(measured["shaped"] / RATE_BITS_PER_SEC - 1) <= 0.15, measured
    # The same read with no emulated network, in the same namespace.
    assert measured["unshaped"] > 3 * RATE_BITS_PER_SEC, measured


def _train(args, **env):
    return subprocess.run(
        [sys.executable, TRAIN, "--model=digits", *args],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env),
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_a_bad_rate_fails_at_parse_time():
    proc = _train(["--emulate_nic=1gbps"])
    assert proc.returncode == 1
    assert re.search(
        r"flag --emulate_nic=1gbps: --emulate_nic must be a rate", proc.stderr
    )
    assert "local cluster" not in proc.stdout


def test_tf_config_refuses_an_emulated_network_before_any_server():
    tf_config = json.dumps(
        {"cluster": {"chief": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"],
                     "worker": ["127.0.0.1:3"]}, "task": {"type": "ps", "index": 0}}
    )  # fmt: skip
    proc = _train(["--emulate_nic=1gbit"], TF_CONFIG=tf_config)
    assert proc.returncode == 1
    assert "`emulate_nic` emulates the local cluster's network" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no namespaces: {_UNAVAILABLE}")
def test_a_job_on_an_emulated_network_says_so_and_trains():
    proc = _train(
        ["--num_workers=1", "--num_ps=1", "--epochs=2", "--emulate_nic=1gbit",
         "--emulate_ps_nic=100mbit"]
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "network: emulated, worker and chief NICs at 1 Gbit/s, ps NICs at 100 "
        "Mbit/s, in and out (tc htb on the private namespace's loopback; no added "
        "latency)"
    ) in proc.stdout
    accuracy = float(re.findall(r"^test accuracy: ([0-9.]+)$", proc.stdout, re.M)[-1])
    assert accuracy >= 0.9
