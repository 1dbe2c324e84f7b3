"""Small helpers shared by the tests."""

from tf_distbelief.cluster import traffic


def cluster_bytes(local_cluster) -> int:
    """Bytes received so far on the TCP connections of `local_cluster`'s tasks.

    Summed over every established socket (`traffic.read_sockets`) whose own or
    peer port is a ps or worker task's: each byte between two local sockets is
    received by one of them, so this counts what crossed the cluster's
    connections once, and nothing of another process's (pytest's other `-n`
    process runs a cluster of its own on the same loopback interface).
    """
    ports = {
        int(address.rpartition(":")[2])
        for job in ("worker", "ps")
        for address in local_cluster.jobs[job]
    }
    sockets = traffic.read_sockets(with_pids=False)
    return traffic.bytes_received_on_ports(sockets, ports)


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
