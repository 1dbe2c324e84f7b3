"""Small helpers shared by the tests."""

import time


def loopback_bytes() -> int:
    """Bytes through the loopback interface (received side), from the kernel."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    raise AssertionError("no loopback interface in /proc/net/dev")


def wait_for_worker_recovery(strategy, timeout_secs: float = 120.0) -> None:
    """Waits until `strategy`'s ClusterCoordinator is done recovering a worker.

    After a worker fails, the coordinator's failure handler keeps calling
    `update_server_def` with this strategy's cluster until the worker is back.
    Still running when the next test connects to the cluster anew, it
    reconfigures the process-wide eager context under that test (a restarted
    worker then died with SIGSEGV). Call it after restarting a killed worker.
    TensorFlow has no public way to wait for it, hence the private attributes.

    Raises:
      TimeoutError: still recovering after `timeout_secs` seconds.
    """
    coordinator = strategy._cluster_coordinator
    if coordinator is None:
        return
    pending = coordinator._cluster.failure_handler._cluster_due_for_update_or_finish
    deadline = time.monotonic() + timeout_secs
    while pending.is_set():
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"The coordinator was still recovering a worker after "
                f"{timeout_secs:g} s."
            )
        time.sleep(0.1)
