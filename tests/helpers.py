"""Small helpers shared by the tests."""


def loopback_bytes() -> int:
    """Bytes through the loopback interface (received side), from the kernel."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    raise AssertionError("no loopback interface in /proc/net/dev")


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
