"""The emulated network: each local task behind a NIC of a set rate (veth, htb).

The real check runs a child process in the local cluster's private network
namespace: a ps variable of known size is read by the chief (a fetch) and
written from a worker (a push, which the ps pulls from the worker's server)
through a ps NIC shaped to 50 Mbit/s behind a worker NIC of 500 Mbit/s, and
each measured rate must be within 15% of 50 Mbit/s; then the same transfers
through an unshaped cluster, in the same namespace, must be far faster.
"""

import json
import os
import re
import subprocess
import sys

import pytest

import tf_distbelief as tfdb
from tests.fixtures.launch import ROOT, TRAIN
from tf_distbelief.cluster.local import local_cluster
from tf_distbelief.cluster.network import emulated, isolation

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
    assert emulated.parse_rate(text) == bits


@pytest.mark.parametrize(
    "bad", ["fast", "1gbps", "-1mbit", "0", 5, "2tbit", True, 1.5e9]
)
def test_parse_rate_refuses_with_the_forms_allowed(bad):
    with pytest.raises(ValueError, match=r"`emulate_nic` must be a rate such as 1gbit"):
        emulated.parse_rate(bad, "emulate_nic")


def test_rates_and_their_line():
    assert emulated.NicRates.create(None) is None
    rates = emulated.NicRates.create("1gbit")
    assert rates == emulated.NicRates(10**9, 10**9)
    assert rates.describe() == "every task's NIC at 1 Gbit/s in and out"
    both = emulated.NicRates.create("1gbit", "10gbit")
    assert both.describe() == (
        "worker NICs at 1 Gbit/s, ps NICs at 10 Gbit/s, in and out"
    )
    with pytest.raises(ValueError, match=r"`ps_nic_bandwidth` needs `nic_bandwidth`"):
        emulated.NicRates.create(None, "1gbit")


def test_each_end_of_a_task_link_gets_an_htb_at_the_task_rate():
    lines = emulated._htb("nic0", 10**9).splitlines()
    shape = "burst 131072 cburst 131072 quantum 65536"
    assert lines == [
        "qdisc add dev nic0 root handle 1: htb default 20",
        "class add dev nic0 parent 1: classid 1:1 htb rate 1000000000bit ceil "
        f"1000000000bit {shape}",
        # Packets under 512 bytes first (IPv4 total length, bytes 2-3), but
        # not a length of 0 (a packet over 64 KiB).
        "class add dev nic0 parent 1:1 classid 1:10 htb rate 10000000bit ceil "
        f"1000000000bit {shape} prio 0",
        "class add dev nic0 parent 1:1 classid 1:20 htb rate 990000000bit ceil "
        f"1000000000bit {shape} prio 1",
        "filter add dev nic0 parent 1: protocol ip prio 1 u32 match u16 0x0000 "
        "0xffff at 2 flowid 1:20",
        "filter add dev nic0 parent 1: protocol ip prio 2 u32 match u16 0x0000 "
        "0xfe00 at 2 flowid 1:10",
    ]
    # 1 ms of traffic when that is more than two packets.
    assert "burst 1250000 " in emulated._htb("nic0", 10**10)
    rates = emulated.NicRates.create("1gbit", "100mbit")
    assert rates.bits_per_sec("worker") == 10**9
    assert rates.bits_per_sec("ps") == 10**8


def test_outside_a_private_namespace_it_is_refused_before_any_task_starts():
    assert not isolation.inside_private_network()
    cluster = local_cluster.LocalCluster(1, 1, nic_bandwidth="1gbit")
    with pytest.raises(tfdb.EmulatedNetworkError, match=r"private network namespace"):
        cluster.start()
    assert cluster.processes == {}
    assert issubclass(tfdb.EmulatedNetworkError, tfdb.ConfigError)


def test_a_bad_rate_is_refused_when_the_cluster_is_made():
    with pytest.raises(ValueError, match=r"`nic_bandwidth` must be a rate"):
        local_cluster.LocalCluster(1, 1, nic_bandwidth="fast")


def _child_json(script: str, *args) -> dict:
    """Runs `script` in a child Python (it enters the private namespace) and
    returns the JSON object of its last output line."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        cwd=ROOT,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_CHILD = r"""
import json, os, sys, time
from tf_distbelief.cluster.network import isolation
isolation.enter_private_network()
import tensorflow as tf
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.cluster.local import local_cluster

def median_rate(run, nbytes):
    run()  # The connections and the function, first.
    rates = []
    for _ in range(3):
        start = time.monotonic()
        run()
        rates.append(nbytes * 8 / (time.monotonic() - start))
    return sorted(rates)[1]

def measure(rate, ps_rate):
    with local_cluster.LocalCluster(
        1, 1, nic_bandwidth=rate, ps_nic_bandwidth=ps_rate
    ) as c:
        strategy = strategy_lib.DistBeliefStrategy(c.resolver)
        size = int(sys.argv[1]) // 4
        with strategy.scope():
            v = tf.Variable(tf.zeros([size], tf.float32))

        @tf.function
        def push():
            # Made on the worker, written on the ps: the ps pulls the bytes
            # from the worker's server, and they enter the ps's NIC.
            v.assign(tf.fill([size], 1.0))
            return v.sparse_read([0])  # Read on the ps: after the write.

        def on_worker():
            with tf.device("/job:worker/replica:0/task:0"):
                return push().numpy()

        nbytes = size * 4
        return {
            "fetch": median_rate(lambda: v.read_value().numpy(), nbytes),
            "push": median_rate(on_worker, nbytes),
        }

shaped = measure(sys.argv[2], sys.argv[3])
print(json.dumps({"shaped": shaped, "unshaped": measure(None, None)}))
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no namespaces: {_UNAVAILABLE}")
def test_fetches_and_pushes_cross_the_ps_nic_at_its_rate():
    # Workers 10 times faster than the ps: both directions are the ps's.
    measured = _child_json(
        _CHILD, VARIABLE_BYTES, 10 * RATE_BITS_PER_SEC, RATE_BITS_PER_SEC
    )
    for direction in ("fetch", "push"):
        rate = measured["shaped"][direction]
        assert abs(rate / RATE_BITS_PER_SEC - 1) <= 0.15, (direction, measured)
        # The same transfer with no emulated network, in the same namespace.
        assert measured["unshaped"][direction] > 3 * RATE_BITS_PER_SEC, measured


_DUPLEX_CHILD = r"""
import json, os, subprocess, sys, time
from tf_distbelief.cluster.network import isolation, emulated
isolation.enter_private_network()

# Plain TCP between three namespaces: a "ps" server, a "push" client that
# sends it NBYTES, a "fetch" client that reads NBYTES from it.
TASK = r'''
import socket, sys, threading, time
role, host, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
chunk = bytes(65536)
def send(c):
    sent = 0
    while sent < nbytes:
        c.sendall(chunk)
        sent += len(chunk)
def receive(c):
    got = 0
    while got < nbytes:
        got += len(c.recv(1 << 20) or b"")
if role == "ps":
    s = socket.create_server(("0.0.0.0", 5000))
    def serve(c):
        if c.recv(1) == b"p":
            receive(c)
            c.sendall(b"k")
        else:
            send(c)
        c.close()
    while True:
        threading.Thread(target=serve, args=(s.accept()[0],)).start()
for line in sys.stdin:
    c = socket.create_connection((host, 5000), timeout=60)
    start = time.monotonic()
    if role == "push":
        c.sendall(b"p")
        send(c)
        c.recv(1)
    else:
        c.sendall(b"f")
        receive(c)
    print(time.monotonic() - start, flush=True)
    c.close()
'''
rate, nbytes = int(sys.argv[1]), int(sys.argv[2])
net = emulated.EmulatedNetwork(emulated.NicRates(rate, rate))
tasks = {}
try:
    for slot, role in enumerate(["ps", "push", "fetch"]):
        tasks[role] = subprocess.Popen(
            [sys.executable, "-c", TASK, role, net.host(0), str(nbytes)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=net.preexec,
        )
        net.attach(tasks[role].pid, slot, "ps" if role == "ps" else "worker")
    time.sleep(1.0)  # The ps listening.
    rates = {"push": [], "fetch": []}
    for _ in range(3):
        for role in rates:
            tasks[role].stdin.write("go\n")
            tasks[role].stdin.flush()
        for role in rates:
            rates[role].append(nbytes * 8 / float(tasks[role].stdout.readline()))
    print(json.dumps({k: sorted(v)[1] for k, v in rates.items()}))
finally:
    for task in tasks.values():
        task.kill()
    net.close()
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no namespaces: {_UNAVAILABLE}")
def test_a_ps_nic_carries_a_push_in_beside_a_fetch_out_at_its_rate():
    # A NIC is full duplex: one worker's push into the ps and another's fetch
    # out of it, at once, each at the rate (in one FIFO the push's
    # acknowledgements waited behind the fetch's data: 85-91% of it).
    rate = 2 * RATE_BITS_PER_SEC
    measured = _child_json(_DUPLEX_CHILD, rate, VARIABLE_BYTES // 2)
    for direction in ("push", "fetch"):
        assert abs(measured[direction] / rate - 1) <= 0.1, (direction, measured)


_RESTART_CHILD = r"""
import json, os, sys, time
from tf_distbelief.cluster.network import isolation
isolation.enter_private_network()
from tf_distbelief.cluster import health
from tf_distbelief.cluster.local import local_cluster

with local_cluster.LocalCluster(1, 1, nic_bandwidth="1gbit") as cluster:
    address = cluster.jobs["worker"][0]
    before = health.probe(address, 5.0).value
    old = cluster.processes[("worker", 0)].pid
    cluster.restart("worker", 0)
    start = time.monotonic()
    after = health.probe(address, 5.0).value
    print(json.dumps({
        "address": address,
        "chief": cluster.resolver.cluster_spec().as_dict()["chief"][0],
        "before": before,
        "after": after,
        "secs": time.monotonic() - start,
        "new_process": cluster.processes[("worker", 0)].pid != old,
    }))
sys.stdout.flush()
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.skipif(_UNAVAILABLE is not None, reason=f"no namespaces: {_UNAVAILABLE}")
def test_a_restarted_task_answers_at_once_on_its_own_address():
    seen = _child_json(_RESTART_CHILD)
    # Each task on an address of its own, the chief on the bridge's.
    assert re.fullmatch(r"10\.64\.0\.3:\d+", seen["address"]), seen
    assert re.fullmatch(r"10\.64\.0\.1:\d+", seen["chief"]), seen
    assert seen["before"] == seen["after"] == "answers", seen
    assert seen["new_process"], seen
    # The same address and MAC: no wait for the neighbour tables to learn it.
    assert seen["secs"] < 2.0, seen


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
        "network: emulated, worker NICs at 1 Gbit/s, ps NICs at 100 Mbit/s, in "
        "and out (each task in its own network namespace behind a shaped veth; "
        "the chief unshaped; no added latency)"
    ) in proc.stdout
    accuracy = float(re.findall(r"^test accuracy: ([0-9.]+)$", proc.stdout, re.M)[-1])
    assert accuracy >= 0.9
