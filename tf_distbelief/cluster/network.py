"""An emulated network for the local cluster: each task behind a NIC of a set rate.

Downpour SGD trades staleness for bandwidth (Dean et al. 2012, section 4.1);
on one host's loopback a byte costs almost nothing, so the trade cannot show.
Inside the private network namespace the local cluster runs in
(`isolation.enter_private_network`: the process is root of its own user and
network namespaces, so no privilege is needed), the kernel's `htb` queueing
discipline on the loopback device shapes traffic by TCP port: each task has a
port of its own, hence a NIC of its own, one rate into the task and one out.

How bytes are charged: every TCP connection between two tasks has a server
end (the task's listening port) and a client end (an ephemeral port), and
`u32` filters see only the ports, so a connection is charged to its server
end's NIC: what a ps sends and receives (fetches and pushes) to the ps's NIC,
what the chief sends a worker (scheduled functions) and receives from it to
the worker's NIC. With one ps this is the real bottleneck of parameter-server
training, every worker's parameters crossing the ps's NIC; with several ps a
worker's own NIC, which carries its traffic to all of them, is not enforced
(each ps's is). Latency cannot be added (this kernel has no `netem`).

No TensorFlow. `LocalCluster(nic_bandwidth=...)` calls `shape` before any
task starts and `unshape` when it stops.

Example:
  ```
  isolation.enter_private_network()  # First thing: re-executes the program.
  with LocalCluster(2, 1, nic_bandwidth="1gbit") as cluster:
    ...
  ```
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from collections.abc import Mapping, Sequence

from tf_distbelief import checks, errors
from tf_distbelief.cluster import isolation

__all__ = [
    "EmulatedNetworkError",
    "NicRates",
    "describe_rate",
    "parse_rate",
    "shape",
    "unshape",
]

_DEVICE = "lo"
# tc's units, as `--emulate_nic` takes them (decimal, bits per second).
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)?\s*$", re.IGNORECASE)
# Slower than a modem or faster than any NIC: a typo, not a network.
_MIN_BITS_PER_SEC = 10**4
_MAX_BITS_PER_SEC = 10**12
# The loopback device's MTU is 64 KiB: a class's quantum (bytes it may send
# per round) must hold one packet, and its burst enough packets that a fast
# class is not held below its rate by the kernel's timer (1 ms of traffic).
_LOOPBACK_MTU_BYTES = 65536
_BURST_SECS = 0.001
_TC_TIMEOUT_SECS = 10.0


class EmulatedNetworkError(errors.ConfigError):
    """The emulated network cannot be set up here (raised before any task starts)."""


@dataclasses.dataclass(frozen=True)
class NicRates:
    """The NIC rate of each kind of task, in bits per second.

    Attributes:
      worker_bits_per_sec: each worker's NIC, in and out; also the chief's.
      ps_bits_per_sec: each ps task's NIC, in and out.
    """

    worker_bits_per_sec: int
    ps_bits_per_sec: int

    def __post_init__(self):
        for name in ("worker_bits_per_sec", "ps_bits_per_sec"):
            value = getattr(self, name)
            if not checks.is_int(value) or not (
                _MIN_BITS_PER_SEC <= value <= _MAX_BITS_PER_SEC
            ):
                raise ValueError(
                    f"Argument `{name}` must be an int in [{_MIN_BITS_PER_SEC}, "
                    f"{_MAX_BITS_PER_SEC}] bits/s. Received: {value!r}"
                )

    @classmethod
    def create(cls, nic_bandwidth, ps_nic_bandwidth=None) -> NicRates | None:
        """The rates of `LocalCluster(nic_bandwidth, ps_nic_bandwidth)`, or None.

        Args:
          nic_bandwidth: None (no emulated network), a rate as `parse_rate`
            takes it (`"1gbit"`, `"100mbit"`, or bits per second).
          ps_nic_bandwidth: the ps tasks' rate; None: `nic_bandwidth`.

        Raises:
          ValueError: a rate `parse_rate` refuses, or `ps_nic_bandwidth`
            without `nic_bandwidth`.
        """
        if nic_bandwidth is None:
            if ps_nic_bandwidth is not None:
                raise ValueError(
                    "Argument `ps_nic_bandwidth` needs `nic_bandwidth` (the "
                    f"workers' NIC rate). Received: {ps_nic_bandwidth!r}"
                )
            return None
        worker = parse_rate(nic_bandwidth, "nic_bandwidth")
        ps = worker
        if ps_nic_bandwidth is not None:
            ps = parse_rate(ps_nic_bandwidth, "ps_nic_bandwidth")
        return cls(worker, ps)

    def describe(self) -> str:
        """`"every task's NIC at 1 Gbit/s in and out"`, for the job's line."""
        worker = describe_rate(self.worker_bits_per_sec)
        if self.ps_bits_per_sec == self.worker_bits_per_sec:
            return f"every task's NIC at {worker} in and out"
        ps = describe_rate(self.ps_bits_per_sec)
        return f"worker and chief NICs at {worker}, ps NICs at {ps}, in and out"


def parse_rate(value, name: str = "nic_bandwidth") -> int:
    """Bits per second of a rate: `"1gbit"`, `"100mbit"`, `"2.5gbit"`, or an int.

    Units are tc's, decimal: `bit`, `kbit`, `mbit`, `gbit`, `tbit`; a bare
    number is bits per second.

    Args:
      value: the rate.
      name: the argument's or flag's name, for the message.

    Returns:
      The rate in bits per second, an int in [1e4, 1e12].

    Raises:
      ValueError: naming `name`, the value and the forms allowed.
    """
    bits = None
    if checks.is_int(value):
        bits = int(value)
    elif isinstance(value, str):
        match = _RATE_RE.match(value)
        if match:
            unit = (match.group(2) or "bit").lower()
            bits = round(float(match.group(1)) * _UNITS[unit])
    if bits is None or not _MIN_BITS_PER_SEC <= bits <= _MAX_BITS_PER_SEC:
        raise ValueError(
            f"`{name}` must be a rate such as 1gbit, 100mbit or 10gbit (units "
            f"bit, kbit, mbit, gbit, tbit; decimal), between 10kbit and 1tbit. "
            f"Received: {value!r}"
        )
    return bits


def describe_rate(bits_per_sec: int) -> str:
    """`"1 Gbit/s"` for 10**9, `"100 Mbit/s"` for 10**8."""
    for unit, scale in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6)):
        if bits_per_sec >= scale:
            return f"{bits_per_sec / scale:g} {unit}"
    return f"{bits_per_sec / 10**3:g} kbit/s"


def _tc(tc: str, *args: str) -> None:
    proc = subprocess.run(
        [tc, *args], capture_output=True, text=True, timeout=_TC_TIMEOUT_SECS
    )
    if proc.returncode != 0:
        raise EmulatedNetworkError(
            f"The emulated network could not be set up: `tc {' '.join(args)}` "
            f"failed ({proc.stderr.strip() or proc.returncode}). It needs the "
            "kernel's htb queueing discipline and u32 filters."
        )


def _commands(
    jobs: Mapping[str, Sequence[int]], rates: NicRates
) -> list[tuple[str, ...]]:
    """The tc commands that give each task's port its NIC (in: dport, out: sport)."""
    commands = [
        # Unclassified traffic (none between tasks) goes out unshaped.
        ("qdisc", "add", "dev", _DEVICE, "root", "handle", "1:", "htb", "default", "0"),
    ]
    minor = 0x10
    for job in ("chief", "worker", "ps"):
        bits = rates.ps_bits_per_sec if job == "ps" else rates.worker_bits_per_sec
        burst = max(2 * _LOOPBACK_MTU_BYTES, round(bits / 8 * _BURST_SECS))
        for port in jobs.get(job, ()):
            for match in ("dport", "sport"):  # Into the task, out of it.
                classid = f"1:{minor:x}"
                commands.append(
                    ("class", "add", "dev", _DEVICE, "parent", "1:", "classid",
                     classid, "htb", "rate", f"{bits}bit", "ceil", f"{bits}bit",
                     "burst", str(burst), "cburst", str(burst),
                     "quantum", str(_LOOPBACK_MTU_BYTES))
                )  # fmt: skip
                commands.append(
                    ("filter", "add", "dev", _DEVICE, "parent", "1:", "protocol",
                     "ip", "prio", "1", "u32", "match", "ip", match, str(port),
                     "0xffff", "flowid", classid)
                )  # fmt: skip
                minor += 1
    return commands


def shape(jobs: Mapping[str, Sequence[int]], rates: NicRates) -> None:
    """Puts each task's port behind a NIC of its job's rate, on the loopback device.

    Args:
      jobs: `{"chief": [port], "worker": [ports], "ps": [ports]}`.
      rates: the NIC rates.

    Raises:
      EmulatedNetworkError: this process is not in a private network
        namespace (it would shape the host's loopback, and may not), `tc` is
        missing, or the kernel refused htb or u32.
    """
    if not isolation.inside_private_network():
        raise EmulatedNetworkError(
            "An emulated network (`nic_bandwidth`, `--emulate_nic`) needs the "
            "local cluster's private network namespace, and this process is not "
            "in one: call tf_distbelief.cluster.isolation.enter_private_network() "
            "first thing (launch/train.py does, unless --noisolate_network), on "
            "a Linux host with user namespaces and util-linux unshare."
        )
    tc = isolation.find_tool("tc")
    if tc is None:
        raise EmulatedNetworkError(
            "An emulated network needs iproute2's `tc`, which is not on PATH or "
            "in /usr/sbin or /sbin: install iproute2."
        )
    unshape()
    for command in _commands(jobs, rates):
        _tc(tc, *command)


def unshape() -> None:
    """Removes the emulated network from the loopback device, if there is one."""
    tc = isolation.find_tool("tc")
    if tc is not None and isolation.inside_private_network():
        subprocess.run(
            [tc, "qdisc", "del", "dev", _DEVICE, "root"],
            capture_output=True,
            timeout=_TC_TIMEOUT_SECS,
        )
