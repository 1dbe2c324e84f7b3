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
