"""Socket bytes and CPU seconds of local processes: the kernel's own counters.

What a local cluster's tasks send each other and the CPU they use, read from
outside the processes (no TensorFlow here), for tests and benchmarks that
measure a job on one machine (Linux):

* `read_sockets` runs `ss -tinpH state established` and `parse_ss` turns its
  output into `TcpSocket`s: per connection, the bytes this end sent that the
  peer acknowledged (`bytes_acked`) and the bytes it received
  (`bytes_received`), and the process ids holding the socket.
* `link_bytes` attributes the change between two readings to a pair of process
  groups (e.g. workers and ps tasks), counting each loopback connection once;
  `bytes_received_on_ports` sums what every connection touching a set of ports
  (a cluster's task ports) received.
* `cpu_secs` reads a process's user plus system CPU seconds from
  `/proc/<pid>/stat` (`tf_distbelief.cluster.local.proc_stat`).

Example:

```python
before = traffic.read_sockets()
...  # Train.
link = traffic.link_bytes(before, traffic.read_sockets(), worker_pids, ps_pids)
print(link.sent, link.received)
```
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import re
import subprocess
from collections.abc import Iterable, Mapping

from tf_distbelief.cluster.local import proc_stat

__all__ = [
    "Endpoint",
    "LinkBytes",
    "TcpSocket",
    "bytes_received_on_ports",
    "cpu_secs",
    "link_bytes",
    "parse_endpoint",
    "parse_ss",
    "read_sockets",
]

Endpoint = tuple[str, int]

_PID = re.compile(r"pid=(\d+)")
_COUNTER = re.compile(r"\b(bytes_acked|bytes_received):(\d+)")
_IPV4_MAPPED = "::ffff:"


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    """One established TCP socket, as `ss -tinpH state established` shows it.

    Attributes:
      local: `(host, port)` of this end.
      peer: `(host, port)` of the other end.
      pids: process ids holding the socket (empty when `ss` may not see them,
        or when read without `-p`).
      bytes_acked: bytes this end sent that the peer acknowledged.
      bytes_received: bytes this end received.
    """

    local: Endpoint
    peer: Endpoint
    pids: tuple[int, ...]
    bytes_acked: int
    bytes_received: int


def parse_endpoint(text: str) -> Endpoint:
    """Parses one address column of `ss`.

    `127.0.0.1:80`, `[::1]:80`, `[::ffff:127.0.0.1]:80` (an IPv4 peer of an
    IPv6 socket, read as the IPv4 address) and `host%interface:80` are accepted.

    Args:
      text: the column, e.g. `[::ffff:127.0.0.1]:45919`.

    Returns:
      `(host, port)`.

    Raises:
      ValueError: the text does not end in `:<port>`.
    """
    host, _, port = text.rpartition(":")
    host = host.strip("[]")
    if host.startswith(_IPV4_MAPPED):
        host = host[len(_IPV4_MAPPED) :]
    return host.split("%")[0], int(port)


def parse_ss(text: str) -> list[TcpSocket]:
    """Parses the output of `ss -tinpH state established` (or `ss -tinH ...`).

    Each socket is a line `Recv-Q Send-Q local peer [users:((...pid=N...))]`
    followed by an indented line of TCP info. `ss` leaves out counters that are
    0, so a missing `bytes_acked` or `bytes_received` reads as 0.

    Args:
      text: the command's standard output.

    Returns:
      The sockets, in order.
    """
    sockets = []
    current = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            if current is not None:
                sockets.append(TcpSocket(**current))
            fields = line.split()
            current = {
                "local": parse_endpoint(fields[2]),
                "peer": parse_endpoint(fields[3]),
                "pids": tuple(int(p) for p in _PID.findall(line)),
                "bytes_acked": 0,
                "bytes_received": 0,
            }
        elif current is not None:
            for name, value in _COUNTER.findall(line):
                current[name] = int(value)
    if current is not None:
        sockets.append(TcpSocket(**current))
    return sockets


def read_sockets(with_pids: bool = True, pids: Iterable[int] = ()) -> list[TcpSocket]:
    """Runs `ss -tinpH state established` and parses it.

    Args:
      with_pids: whether to ask `ss` for the owning processes (`-p`, which
        reads every process's file descriptors); without, `pids` is empty.
      pids: processes whose network namespaces are read too (each once, by
        `nsenter`), e.g. the tasks of a local cluster on an emulated network,
        each in a namespace of its own.

    Returns:
      Every established TCP socket that `ss` shows in this process's network
      namespace and in those of `pids`.

    Raises:
      subprocess.CalledProcessError: `ss` (or `nsenter`) failed.
      FileNotFoundError: there is no `ss` (iproute2) or, with `pids` in
        other namespaces, no `nsenter` on the machine.
    """
    flags = "-tinpH" if with_pids else "-tinH"
    command = ["ss", flags, "state", "established"]
    namespaces = {_netns("self"): None}
    for pid in pids:
        with contextlib.suppress(OSError):  # A process that has exited.
            namespaces.setdefault(_netns(pid), pid)
    sockets = []
    for pid in namespaces.values():
        enter = [] if pid is None else ["nsenter", f"--net=/proc/{pid}/ns/net"]
        out = subprocess.run(
            enter + command, check=True, capture_output=True, text=True
        )
        sockets += parse_ss(out.stdout)
    return sockets


def _netns(pid) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def bytes_received_on_ports(sockets: Iterable[TcpSocket], ports: Iterable[int]) -> int:
    """Bytes received by the sockets whose own or peer port is one of `ports`.

    Given a cluster's task ports, this counts each byte between two of its
    local sockets once (one of them received it), and nothing of another
    process's connections (e.g. a second cluster on the same loopback).

    Args:
      sockets: the sockets (`read_sockets`).
      ports: the ports whose connections count.

    Returns:
      The sum of `bytes_received` over those sockets.
    """
    ports = set(ports)
    return sum(
        s.bytes_received for s in sockets if s.local[1] in ports or s.peer[1] in ports
    )


@dataclasses.dataclass(frozen=True)
class LinkBytes:
    """Bytes between two groups of processes, seen from the first group.

    Attributes:
      sent: bytes the first group sent to the second (acknowledged).
      received: bytes the first group received from the second.
    """

    sent: int = 0
    received: int = 0

    @property
    def total(self) -> int:
        """Bytes both ways: `sent + received`."""
        return self.sent + self.received


def link_bytes(
    before: Iterable[TcpSocket],
    after: Iterable[TcpSocket],
    pids: Iterable[int],
    peer_pids: Iterable[int],
    peer_ports: Mapping[int, int] | None = None,
) -> LinkBytes:
    """Bytes moved between processes `pids` and `peer_pids` from `before` to `after`.

    Every connection between the two groups appears twice on loopback, once
    from each end; it is counted once, from the end owned by `pids`. The other
    end is attributed by its owner: the socket whose local endpoint is this
    socket's peer, or else `peer_ports` (the groups' listening ports, for a peer
    whose socket `ss` shows without a process). A connection opened after
    `before` counts from 0; one closed before `after` is lost (gRPC keeps its
    channels open, so none close during training).

    Args:
      before: the sockets at the start (`parse_ss`, `read_sockets`).
      after: the sockets at the end.
      pids: process ids of the first group (e.g. the workers).
      peer_pids: process ids of the second group (e.g. the ps tasks).
      peer_ports: optional `{listening port: pid}` of known servers.

    Returns:
      A `LinkBytes`.
    """
    after = list(after)
    pids, peer_pids = set(pids), set(peer_pids)
    owners: dict[Endpoint, set[int]] = collections.defaultdict(set)
    for s in after:
        owners[s.local].update(s.pids)
    ports = dict(peer_ports or {})
    start = {(s.local, s.peer): s for s in before}
    sent = received = 0
    for s in after:
        if not pids.intersection(s.pids):
            continue
        peer_owners = owners.get(s.peer) or {ports.get(s.peer[1])}
        if not peer_pids.intersection(peer_owners):
            continue
        old = start.get((s.local, s.peer))
        if old is None or old.bytes_acked > s.bytes_acked:
            old = TcpSocket(s.local, s.peer, s.pids, 0, 0)
        sent += s.bytes_acked - old.bytes_acked
        received += s.bytes_received - old.bytes_received
    return LinkBytes(sent, received)


def cpu_secs(pid: int) -> float:
    """User plus system CPU seconds process `pid` has used so far.

    Read from `/proc/<pid>/stat` (fields 14 and 15, in clock ticks), as
    `psutil.Process(pid).cpu_times()` reads them; children are not included.

    Args:
      pid: the process id.

    Returns:
      The seconds, a multiple of 1 / `SC_CLK_TCK` (usually 0.01 s).

    Raises:
      ProcessLookupError: no process `pid` (or it is gone).
    """
    try:
        fields = proc_stat.fields(pid)
    except FileNotFoundError:
        raise ProcessLookupError(f"No process {pid} (no /proc/{pid}/stat).") from None
    user_ticks, system_ticks = (int(fields[i]) for i in proc_stat.CPU_FIELDS)
    return (user_ticks + system_ticks) / os.sysconf("SC_CLK_TCK")
