"""An emulated network for the local cluster: each task behind a NIC of a set rate.

Downpour SGD trades staleness for bandwidth (Dean et al. 2012, section 4.1);
on one host's loopback a byte costs almost nothing, so the trade cannot show.
Inside the local cluster's private network namespace
(`isolation.enter_private_network`: the process is root of its own user and
network namespaces, so no privilege is needed), every ps and worker task runs
in a network namespace of its own, as if on its own machine, linked to a
bridge in the chief's namespace by a virtual Ethernet pair (veth) whose two
ends each carry the kernel's `htb` queueing discipline: the task's end limits
what the task sends, the bridge's end what it receives. Within each, small
packets (acknowledgements, requests) go before bulk data, as a host's
flow-queueing discipline sends them, so a NIC carries a push in beside a
fetch out, both at its rate. Every byte into or out of a task crosses its
NIC, whichever end opened the connection (the ps pulls the gradients of a
push from the worker's server, and those bytes go into the ps's NIC as they
would on a real network).

The chief stays in the private namespace, on the bridge's address, behind no
NIC of its own (what it sends a task and reads from it still crosses that
task's NIC). Latency cannot be added (this kernel has no `netem`).

No TensorFlow. `LocalCluster(nic_bandwidth=...)` makes an `EmulatedNetwork`
before any task starts, starts each task in its own namespace (`preexec`),
gives it its NIC (`attach`) and closes the network when it stops.

Example:
  ```
  isolation.enter_private_network()  # First thing: re-executes the program.
  with LocalCluster(2, 1, nic_bandwidth="1gbit") as cluster:
    ...
  ```
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import subprocess
import threading
from collections.abc import Sequence

from tf_distbelief import checks, errors
from tf_distbelief.cluster.network import isolation

__all__ = [
    "EmulatedNetwork",
    "EmulatedNetworkError",
    "NicRates",
    "describe_rate",
    "parse_rate",
]

# tc's units, as `--emulate_nic` takes them (decimal, bits per second).
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?bit)?\s*$", re.IGNORECASE)
# Slower than a modem or faster than any NIC: a typo, not a network.
_MIN_BITS_PER_SEC = 10**4
_MAX_BITS_PER_SEC = 10**12
# The links' MTU, the largest a veth takes (as loopback's 64 KiB: few packets
# per byte on 2 cores). A class's quantum (bytes it may send per round) must
# hold one packet, and its burst enough packets that a fast class is not held
# below its rate by the kernel's timer (1 ms of traffic).
_MTU_BYTES = 65535
_QUANTUM_BYTES = 65536
_BURST_SECS = 0.001
_COMMAND_TIMEOUT_SECS = 10.0
# Each network's subnet, 10.<64 + k>.0.0/16: the bridge (the chief) on .0.1,
# task slot s (the ps tasks, then the workers) on 2 + s.
_FIRST_SUBNET = 64
_MAX_NETWORKS = 64
_CLONE_NEWNET = 0x40000000


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
                raise checks.argument_error(
                    name,
                    f"an int in [{_MIN_BITS_PER_SEC}, {_MAX_BITS_PER_SEC}] bits/s",
                    value,
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
        return f"worker NICs at {worker}, ps NICs at {ps}, in and out"

    def bits_per_sec(self, job: str) -> int:
        """The NIC rate of a task of `job` ("ps" or "worker")."""
        return self.ps_bits_per_sec if job == "ps" else self.worker_bits_per_sec


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
        raise checks.argument_error(
            name,
            "a rate such as 1gbit, 100mbit or 10gbit (units bit, kbit, mbit, "
            "gbit, tbit; decimal), between 10kbit and 1tbit",
            value,
            setting=True,
        )
    return bits


def describe_rate(bits_per_sec: int) -> str:
    """`"1 Gbit/s"` for 10**9, `"100 Mbit/s"` for 10**8."""
    for unit, scale in (("Tbit/s", 10**12), ("Gbit/s", 10**9), ("Mbit/s", 10**6)):
        if bits_per_sec >= scale:
            return f"{bits_per_sec / scale:g} {unit}"
    return f"{bits_per_sec / 10**3:g} kbit/s"


def _run(command: Sequence[str], stdin: str | None = None) -> None:
    try:
        proc = subprocess.run(
            list(command),
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_SECS,
        )
    except subprocess.TimeoutExpired:
        raise EmulatedNetworkError(
            f"The emulated network could not be set up: `{' '.join(command)}` "
            f"did not finish within {_COMMAND_TIMEOUT_SECS:g} s."
        ) from None
    if proc.returncode != 0:
        lines = f": {stdin.strip()}" if stdin else ""
        raise EmulatedNetworkError(
            f"The emulated network could not be set up: `{' '.join(command)}"
            f"{lines}` failed ({proc.stderr.strip() or proc.returncode}). It "
            "needs the kernel's veth, bridge and htb."
        )


def _htb(device: str, bits: int) -> str:
    """`tc -batch` lines: `device` sends at most `bits` per second.

    Small packets (IPv4 total length under 512 bytes: TCP acknowledgements,
    RPC requests) go first, in a class of their own that may use the whole
    rate, the rest in turn: as a host's flow-queueing discipline (fq_codel)
    sends a sparse flow's packets before a bulk flow's. In one FIFO, the
    acknowledgements of a push into a ps wait behind a fetch's data leaving
    it, and the push slows (measured: 85-91% of the rate beside a fetch).
    """
    burst = max(2 * _QUANTUM_BYTES, round(bits / 8 * _BURST_SECS))
    small = max(1, bits // 100)  # Guaranteed; borrows up to `bits` first.
    shape = f"burst {burst} cburst {burst} quantum {_QUANTUM_BYTES}"
    return (
        f"qdisc add dev {device} root handle 1: htb default 20\n"
        f"class add dev {device} parent 1: classid 1:1 htb rate {bits}bit "
        f"ceil {bits}bit {shape}\n"
        f"class add dev {device} parent 1:1 classid 1:10 htb rate {small}bit "
        f"ceil {bits}bit {shape} prio 0\n"
        f"class add dev {device} parent 1:1 classid 1:20 htb rate "
        f"{bits - small}bit ceil {bits}bit {shape} prio 1\n"
        # An IPv4 packet over 64 KiB (the kernel's BIG TCP aggregates) has a
        # total length of 0: bulk (without this filter a push beside a fetch
        # still ran at 75-86% of the rate).
        f"filter add dev {device} parent 1: protocol ip prio 1 u32 "
        f"match u16 0x0000 0xffff at 2 flowid 1:20\n"
        f"filter add dev {device} parent 1: protocol ip prio 2 u32 "
        f"match u16 0x0000 0xfe00 at 2 flowid 1:10\n"
    )


def _enter_new_network_namespace() -> None:
    """Child-side, before exec: a network namespace of the child's own."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"unshare(CLONE_NEWNET): {os.strerror(errno)}")


_networks_in_use: set[int] = set()
_networks_lock = threading.Lock()


class EmulatedNetwork:
    """The bridge of a local cluster's emulated network, and each task's NIC.

    Made before any task starts; each task then starts in a network namespace
    of its own (`preexec`), and `attach` links it to the bridge through a veth
    pair shaped in both directions (see the module docstring).

    Args:
      rates: the NIC rates.

    Raises:
      EmulatedNetworkError: this process is not in a private network
        namespace (it would change the host's network, and may not), `ip`,
        `tc` or `nsenter` is missing, the kernel refused a bridge, or more
        than 64 emulated networks are open in this process.
    """

    def __init__(self, rates: NicRates):
        if not isolation.inside_private_network():
            raise EmulatedNetworkError(
                "An emulated network (`nic_bandwidth`, `--emulate_nic`) needs the "
                "local cluster's private network namespace, and this process is "
                "not in one: call "
                "tf_distbelief.cluster.enter_private_network() first "
                "thing (launch/train.py does, unless --noisolate_network), on a "
                "Linux host with user namespaces and util-linux unshare."
            )
        tools = {name: isolation.find_tool(name) for name in ("ip", "tc", "nsenter")}
        missing = [name for name, path in tools.items() if path is None]
        if missing:
            raise EmulatedNetworkError(
                f"An emulated network needs {', '.join(missing)} (iproute2's ip "
                "and tc, util-linux's nsenter), not found on PATH or in "
                "/usr/sbin or /sbin."
            )
        self.rates = rates
        self._ip, self._tc, self._nsenter = (tools[n] for n in ("ip", "tc", "nsenter"))
        with _networks_lock:
            free = [k for k in range(_MAX_NETWORKS) if k not in _networks_in_use]
            if not free:
                raise EmulatedNetworkError(
                    f"At most {_MAX_NETWORKS} emulated networks can be open in one "
                    "process; close a LocalCluster first."
                )
            self._number = free[0]
            _networks_in_use.add(self._number)
        self.bridge = f"dbnet{self._number}"
        self._subnet = f"10.{_FIRST_SUBNET + self._number}"
        self._links = 0
        try:
            self._ip_batch(
                f"link add {self.bridge} type bridge\n"
                f"addr add {self.chief_host}/16 dev {self.bridge}\n"
                f"link set {self.bridge} up\n"
            )
        except BaseException:
            self.close()
            raise

    @property
    def chief_host(self) -> str:
        """The chief's address on the bridge."""
        return f"{self._subnet}.0.1"

    def host(self, slot: int) -> str:
        """The address of task `slot` (0, 1, ...: the ps tasks, then the workers)."""
        checks.check_int("slot", slot, 0)
        n = slot + 2
        if n > 0xFFFE:
            raise checks.argument_error("slot", "< 65533", slot)
        return f"{self._subnet}.{n >> 8}.{n & 0xFF}"

    @staticmethod
    def preexec() -> None:
        """Child-side (`Popen(preexec_fn=...)`): the task's own network namespace."""
        _enter_new_network_namespace()

    def attach(self, pid: int, slot: int, job: str) -> None:
        """Links task process `pid` (started with `preexec`) to the bridge.

        Its namespace gets the address `host(slot)`, a fixed MAC (a restarted
        task is reached at once, by the same address), and one NIC at its
        job's rate: an htb on each end of the veth pair.

        Raises:
          EmulatedNetworkError: an `ip`, `tc` or `nsenter` command failed.
        """
        bits = self.rates.bits_per_sec(job)
        self._links += 1
        outside = f"{self.bridge}h{self._links}"
        inside = "nic0"
        n = slot + 2
        mac = f"02:db:{self._number:02x}:00:{n >> 8:02x}:{n & 0xFF:02x}"
        self._ip_batch(
            f"link add {outside} mtu {_MTU_BYTES} type veth peer name {inside} "
            f"netns {pid} mtu {_MTU_BYTES}\n"
            f"link set {outside} master {self.bridge} up\n"
        )
        _run([self._tc, "-batch", "-"], _htb(outside, bits))  # Into the task.
        enter = [self._nsenter, f"--net=/proc/{pid}/ns/net"]
        _run(
            [*enter, self._ip, "-batch", "-"],
            "link set lo up\n"
            f"link set {inside} address {mac} up\n"
            f"addr add {self.host(slot)}/16 dev {inside}\n",
        )
        _run([*enter, self._tc, "-batch", "-"], _htb(inside, bits))  # Out of it.

    def close(self) -> None:
        """Removes the tasks' veth pairs and the bridge.

        A veth pair would also end with its task's namespace, but only once
        the task's process is gone, which may be after this returns: the next
        network given the same number would then find `<bridge>h<k>` taken.
        """
        number = getattr(self, "_number", None)
        if number is None:
            return
        links = "".join(
            f"link del {self.bridge}h{k}\n"
            for k in range(1, getattr(self, "_links", 0) + 1)
        )
        subprocess.run(
            # -force: on past a pair already gone with its namespace.
            [self._ip, "-force", "-batch", "-"],
            input=links + f"link del {self.bridge}\n",
            capture_output=True,
            text=True,
            timeout=_COMMAND_TIMEOUT_SECS,
        )
        with _networks_lock:
            _networks_in_use.discard(number)
        self._number = None

    def _ip_batch(self, lines: str) -> None:
        _run([self._ip, "-batch", "-"], lines)
