r"""How two workers' transfers share one emulated ps NIC: do they stay in step?

The planner (`tf_distbelief.planner.queueing`) assumes that a NIC sharing
its rate fairly keeps the offset between two workers' transfers as it is,
so that only their step times move them apart. This script checks it with
plain TCP, no TensorFlow: in the private network namespace, a ps task behind
an emulated NIC of `--rate` (`tf_distbelief.cluster.network.emulated`) and two worker
tasks that each fetch `--megabytes` from it, `--trials` times. Each trial
starts the second fetch `offset` after the first (0, then a quarter and a
half of one fetch's time alone, `t`), and measures the offset between their
ends. Printed per starting offset: the ends' offset (median and standard
deviation over the trials) as a share of `t`. A fair NIC ends them as far
apart as they started; unfairness between the two TCP flows shows as a
spread of the ends' offset around it.

Usage:
  python benchmarks/nic_sharing.py --rate=100mbit   # about 1 minute
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tf_distbelief.cluster.network import emulated, isolation  # noqa: E402  (no TensorFlow)

if __name__ == "__main__":
    isolation.enter_private_network()

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

from tf_distbelief import console  # noqa: E402

# A ps that sends NBYTES to each connection; workers that fetch on "go" and
# print the monotonic times (one clock for every namespace of the host) at
# which they started and ended.
_TASK = r"""
import socket, sys, threading, time
role, host, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
if role == "ps":
    chunk = bytes(65536)
    server = socket.create_server(("0.0.0.0", 5000))
    def serve(c):
        c.recv(1)
        sent = 0
        while sent < nbytes:
            c.sendall(chunk)
            sent += len(chunk)
        c.close()
    while True:
        threading.Thread(target=serve, args=(server.accept()[0],)).start()
for line in sys.stdin:
    delay = float(line)
    c = socket.create_connection((host, 5000), timeout=120)
    time.sleep(delay)
    start = time.monotonic()
    c.sendall(b"f")
    got = 0
    while got < nbytes:
        got += len(c.recv(1 << 20) or b"")
    print(start, time.monotonic(), flush=True)
    c.close()
"""


def define_flags():
    flags.DEFINE_string("rate", "100mbit", "Every NIC's rate.")
    flags.DEFINE_float("megabytes", 9.66, "Bytes of one fetch, in MB (1e6).")
    flags.DEFINE_integer("trials", 10, "Trials per starting offset.", lower_bound=2)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    f = flags.FLAGS
    rate = emulated.parse_rate(f.rate, "--rate")
    nbytes = int(f.megabytes * 1e6)
    alone = 8 * nbytes / rate
    net = emulated.EmulatedNetwork(emulated.NicRates(rate, rate))
    tasks = []
    try:
        for slot, role in enumerate(["ps", "worker", "worker"]):
            task = subprocess.Popen(
                [sys.executable, "-c", _TASK, role, net.host(0), str(nbytes)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=net.preexec,
            )
            net.attach(task.pid, slot, "ps" if role == "ps" else "worker")
            tasks.append(task)
        time.sleep(1.0)  # The ps listening.
        console.echo(
            f"{f.rate} NICs, fetches of {f.megabytes:g} MB: t = {alone:.3f} s alone"
        )
        console.echo("| start offset / t | end offset / t, median | std | trials |")
        console.echo("|---|---|---|---|")
        for share in (0.0, 0.25, 0.5):
            ends = []
            for _ in range(f.trials):
                for delay, task in zip((0.0, share * alone), tasks[1:]):
                    task.stdin.write(f"{delay}\n")
                    task.stdin.flush()
                first, second = (
                    [float(x) for x in task.stdout.readline().split()]
                    for task in tasks[1:]
                )
                ends.append((second[1] - first[1]) / alone)
            console.echo(
                f"| {share:.2f} | {np.median(ends):.3f} | "
                f"{np.std(ends, ddof=1):.3f} | {f.trials} |"
            )
    finally:
        for task in tasks:
            task.kill()
        net.close()


if __name__ == "__main__":
    define_flags()
    app.run(main)
