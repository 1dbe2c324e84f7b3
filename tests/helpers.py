"""Small helpers shared by the tests."""


def loopback_bytes() -> int:
    """Bytes through the loopback interface (received side), from the kernel."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[0])
    raise AssertionError("no loopback interface in /proc/net/dev")
