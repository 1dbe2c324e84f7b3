"""Task addresses (`host:port`): port rules and "an address used twice".

A TensorFlow server listens on every interface of its machine at its port
(gRPC binds `[::]:port`), so two tasks clash when they name the same machine
and the same port, however the machine is spelled: `localhost`, `::1` and every
address of `127.0.0.0/8` are one machine's loopback. Host names are resolved
with `socket.getaddrinfo`, each in a daemon thread, all within
`_RESOLVE_BUDGET_SECS`; a name that does not resolve by then (no network, or a
Kubernetes service whose pods do not exist yet) is compared by its text, so
validation never fails or hangs on DNS.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Iterable

from tf_distbelief import errors

MIN_PORT = 1
MAX_PORT = 65535
# The machine key of every loopback spelling.
LOOPBACK = "loopback"
# Resolving is a nicety (it finds a clash written as two names); a second is
# enough for /etc/hosts and a healthy resolver and keeps every task's start-up
# short when DNS times out (its own timeout is 5 s per try).
_RESOLVE_BUDGET_SECS = 1.0
# One thread per lookup: past this many names (a large cluster of service
# names, distinct by construction) the rest are compared by their text.
_MAX_LOOKUPS = 64


class AddressError(errors.ConfigError):
    """A task address that cannot work; the message names the task and the fix."""


def split_address(task: str, address: str) -> tuple[str, int]:
    """Returns `(host, port)` of `address`, the port checked.

    Args:
      task: the task, as `job:index`, for the error message.
      address: `host:port`; an IPv6 host may be bracketed (`[::1]:2222`).

    Raises:
      AddressError: no host, or a port that is not an integer in 1-65535.
    """
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not host:
        raise AddressError(
            f"Address of task {task} must be 'host:port' with a host. Received: "
            f"{address!r}. Give the machine's name or IP, e.g. "
            f"'127.0.0.1:{port_text or 2222}'."
        )
    try:
        port = int(port_text)
    except ValueError:
        port = None
    if port is None or not MIN_PORT <= port <= MAX_PORT:
        raise AddressError(
            f"Port of task {task} must be an integer in {MIN_PORT}-{MAX_PORT}. "
            f"Received: {address!r}. Port 0 would let the server bind a random "
            "port that no other task learns (the job would wait for it forever); "
            "give every task a fixed free port, e.g. 'host:2222'."
        )
    return host, port


def _literal_key(host: str) -> str | None:
    """The machine key of an IP literal or `localhost`; None for a host name."""
    if host.lower().rstrip(".") == "localhost":
        return LOOPBACK
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if ip.is_loopback:
        return LOOPBACK
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return _literal_key(str(ip.ipv4_mapped))
    return str(ip)


def _resolve(names: Iterable[str], budget_secs: float) -> dict[str, set[str]]:
    """Returns `{name: machine keys}` for the names resolved within the budget."""
    resolved: dict[str, set[str]] = {}

    def _lookup(name):
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return
        keys = {_literal_key(info[4][0].split("%")[0]) for info in infos}
        resolved[name] = {key for key in keys if key}

    # Daemon threads: a lookup stuck in DNS never delays the process's exit.
    threads = [
        threading.Thread(target=_lookup, args=(name,), daemon=True) for name in names
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + budget_secs
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return {name: keys for name, keys in dict(resolved).items() if keys}


def machine_keys(
    hosts: Iterable[str], budget_secs: float = _RESOLVE_BUDGET_SECS
) -> dict[str, set[str]]:
    """Returns the machine keys of each host: who the host is, for clash checks.

    Args:
      hosts: host names or IP literals.
      budget_secs: time all name lookups together may take.

    Returns:
      `{host: keys}`: `{"loopback"}` for `localhost`, `::1` and `127.0.0.0/8`;
      the normalised IP for another IP literal; the addresses a host name
      resolves to; `{"name:<lower-case name>"}` for a name that does not
      resolve within the budget (or past the first `_MAX_LOOKUPS` names).
    """
    hosts = set(hosts)
    keys = {host: {key} for host in hosts if (key := _literal_key(host))}
    names = sorted(hosts - set(keys))
    resolved = _resolve(names[:_MAX_LOOKUPS], budget_secs) if names else {}
    for name in names:
        keys[name] = resolved.get(name) or {"name:" + name.lower().rstrip(".")}
    return keys


def find_address_used_twice(
    tasks: dict[str, str], budget_secs: float = _RESOLVE_BUDGET_SECS
) -> None:
    """Checks that no two tasks listen on the same machine and port.

    Args:
      tasks: `{"job:index": "host:port"}`, in the order to report clashes.
      budget_secs: time all host name lookups together may take.

    Raises:
      AddressError: a bad port (`split_address`) or an address used twice,
        naming both tasks.
    """
    split = {task: split_address(task, address) for task, address in tasks.items()}
    keys = machine_keys((host for host, _ in split.values()), budget_secs)
    seen: dict[tuple[str, int], str] = {}
    for task, (host, port) in split.items():
        for key in sorted(keys[host]):
            first = seen.get((key, port))
            if first is None:
                seen[(key, port)] = task
                continue
            if tasks[first] == tasks[task]:
                raise AddressError(
                    f"Address {tasks[task]} is used twice: by {first} and by "
                    f"{task}. Every task needs its own host:port."
                )
            if key == LOOPBACK:
                why = "both are this machine's loopback (localhost, ::1 and "
                why += "127.0.0.0/8 reach the same servers)"
            else:
                why = f"both are {key.removeprefix('name:')}"
            raise AddressError(
                f"Address {tasks[task]} of {task} and {tasks[first]} of {first} "
                f"are an address used twice: {why}, port {port}. Every task "
                "needs its own host:port; give one of them another port."
            )
