"""Small helpers shared by the tests."""

import re
import subprocess


def cluster_bytes(local_cluster) -> int:
    """Bytes received so far on the TCP connections of `local_cluster`'s tasks.

    Summed over every established socket (`ss -tinH`) whose own or peer port
    is a ps or worker task's: each byte between two local sockets is received
    by one of them, so this counts what crossed the cluster's connections
    once, and nothing of another process's (pytest's other `-n` process runs
    a cluster of its own on the same loopback interface).
    """
    ports = {
        int(address.rpartition(":")[2])
        for job in ("worker", "ps")
        for address in local_cluster.jobs[job]
    }
    out = subprocess.run(
        ["ss", "-tinH", "state", "established"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    total, ours = 0, False
    for line in out.splitlines():
        if line and not line[0].isspace():  # Recv-Q Send-Q local peer
            ends = line.split()[2:4]
            ours = any(int(end.rpartition(":")[2]) in ports for end in ends)
        elif ours:
            received = re.search(r"\bbytes_received:(\d+)", line)
            total += int(received.group(1)) if received else 0
    return total


def wait_for_worker_recovery(strategy, timeout_secs: float = 120.0) -> None:
    """`tf_distbelief.strategy.wait_for_worker_recovery` (kept for the tests)."""
    from tf_distbelief import strategy as strategy_lib

    strategy_lib.wait_for_worker_recovery(strategy, timeout_secs)


def tensorboard_scalars(folder):
    """`{tag: [(step, value), ...]}` of every event file in `folder`, in order.

    Event files are named by their creation time, so a resumed run's come
    after the run before it.
    """
    import os

    import tensorflow as tf

    scalars = {}
    for name in sorted(os.listdir(folder)):
        if not name.startswith("events.out.tfevents"):
            continue
        for record in tf.data.TFRecordDataset(os.path.join(folder, name)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                number = float(tf.make_ndarray(value.tensor))
                scalars.setdefault(value.tag, []).append((event.step, number))
    return scalars
