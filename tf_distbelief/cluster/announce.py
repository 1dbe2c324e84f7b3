"""A ps or worker task's word to the chief that it is stopping (SIGTERM).

An orchestrator takes a pod away with SIGTERM and a grace period (a
Kubernetes pod deleted or its node drained, a preemptible machine reclaimed).
A task that dies unannounced is a failure for the chief to diagnose: a failed
call, a probe. A task that gets SIGTERM says so first (`announce`): the chief
prints one line naming it and the signal (`worker 1 at HOST:PORT announced it
is stopping (SIGTERM)`), counts it as an announced loss (the job's goodput
lines) and its recovery names the cause, while the task goes on to exit.

The word travels as one JSON line over TCP to a small listener of the
chief's (`Listener`), answered `ok`, with a deadline
(`ANNOUNCE_TIMEOUT_SECS`); plain sockets, so that the task's process loads
nothing next to TensorFlow's runtime (grpcio's own gRPC core among them).
TensorFlow's servers cannot carry it: their services are fixed in C++, and
the task cannot add one to its port. So the chief listens on a port of its
own, which the tasks learn from their environment: a local cluster gives
each task the listener's address (`ADDRESS_ENV`); with `TF_CONFIG`, setting
`PORT_ENV` on every pod (the chief and the tasks) makes the chief listen on
that port of every interface and the tasks announce to the chief's host of
the cluster spec at that port. The answer comes once the chief has printed
its line, so the line comes before the task's exit. An announcement that
finds no listener (none configured, the chief gone) costs the task at most
the deadline and changes nothing: the chief learns of the loss as of any
other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping

from tf_distbelief import checks

__all__ = [
    "ADDRESS_ENV",
    "ANNOUNCE_TIMEOUT_SECS",
    "PORT_ENV",
    "Announcement",
    "Listener",
    "address_for",
    "announce",
    "announced",
]

# The listener's `host:port`, set by a local cluster in its tasks' environment.
ADDRESS_ENV = "TF_DISTBELIEF_ANNOUNCE_TO"
# With `TF_CONFIG`: the port the chief listens on, on every pod alike.
PORT_ENV = "TF_DISTBELIEF_ANNOUNCE_PORT"
# A listener answers in milliseconds; a loaded 2-core machine was seen taking
# up to 1.2 s to answer a probe. Out of a grace period of 30 s (Kubernetes).
ANNOUNCE_TIMEOUT_SECS = 3.0
# An announcement is one JSON line of a few hundred bytes.
_MAX_WORD_BYTES = 4096
# How long an announcement explains a loss of its task (`announced`): the task
# exits right after it, and the chief sees the loss within seconds.
_EXPLAINS_SECS = 60.0

# The chief's line, after the announcement: what the loss means, by job.
_WHAT_FOLLOWS = {
    "worker": (
        "an announced loss, not a failure; its steps go to the other workers "
        "until it serves again"
    ),
    "ps": (
        "an announced loss, not a failure; its variables are restored from the "
        "last checkpoint once it serves again (ps recovery)"
    ),
}

_LOCK = threading.Lock()
# The newest announcement received in this process, by task.
_RECEIVED: dict[str, Announcement] = {}


@dataclasses.dataclass(frozen=True)
class Announcement:
    """A task's announcement, as the chief received it.

    Attributes:
      task: `"/job:worker/task:1"`.
      address: the task's `host:port`, as the task gave it.
      signal: the signal's name, `"SIGTERM"`.
      received: when the chief received it, on `time.monotonic`'s scale.
    """

    task: str
    address: str
    signal: str
    received: float

    def short_name(self) -> str:
        """`worker 1`, as the tasks' own lines name themselves."""
        found = re.fullmatch(r"/job:(\w+)(?:/replica:\d+)?/task:(\d+)", self.task)
        return f"{found[1]} {found[2]}" if found else self.task

    def describe(self) -> str:
        """`worker 1 at HOST:PORT announced it is stopping (SIGTERM)`."""
        return (
            f"{self.short_name()} at {self.address} announced it is stopping "
            f"({self.signal})"
        )


def announced(task: str, within_secs: float = _EXPLAINS_SECS) -> Announcement | None:
    """The announcement of `task` received in this process within the last
    `within_secs` seconds, or None: what a lost task's line names as its cause.

    Args:
      task: `"/job:ps/task:0"`.
      within_secs: how old an announcement may be, in seconds.
    """
    with _LOCK:
        found = _RECEIVED.get(task)
    if found is None or time.monotonic() - found.received > within_secs:
        return None
    return found


class Listener:
    """The chief's listener for announcements (a TCP server of its own).

    Args:
      host: the address to listen on (`"127.0.0.1"`; `""`: every interface).
      port: the port, 0 for a free one.
      report: called with each announcement's line (`Announcement.describe`
        and what follows from it), before the task is answered.
      on_announce: called with each `Announcement`, after `report`;
        exceptions are reported, not raised.

    Attributes:
      address: `host:port` the listener serves, the port as bound.
      received: every `Announcement`, in order.

    Raises:
      ValueError: `port` is not in 0..65535.
      OSError: the port could not be bound.
    """

    def __init__(
        self,
        host: str,
        port: int = 0,
        report: Callable[[str], None] = print,
        on_announce: Callable[[Announcement], None] | None = None,
    ):
        if not checks.is_int(port) or not 0 <= port <= 65535:
            raise checks.argument_error("port", "an integer in 0..65535", port)
        self.received: list[Announcement] = []
        self._report = report
        self._on_announce = on_announce
        if host:
            self._socket = socket.create_server((host, port))
        elif socket.has_dualstack_ipv6():
            self._socket = socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True
            )
        else:
            self._socket = socket.create_server(("", port))
        bound = self._socket.getsockname()[1]
        self.address = f"{host or socket.gethostname()}:{bound}"
        threading.Thread(
            target=self._serve, name="tfdb-announcements", daemon=True
        ).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return  # Stopped.
            threading.Thread(
                target=self._answer, args=(connection,), daemon=True
            ).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(ANNOUNCE_TIMEOUT_SECS)
            try:
                with connection.makefile("rb") as lines:
                    word = json.loads(lines.readline(_MAX_WORD_BYTES))
                announcement = Announcement(
                    str(word["task"]),
                    str(word["address"]),
                    str(word["signal"]),
                    time.monotonic(),
                )
            except (OSError, ValueError, KeyError, TypeError):
                return  # Not an announcement: no answer.
            self._heard(announcement)
            with contextlib.suppress(OSError):
                connection.sendall(b"ok\n")

    def _heard(self, announcement: Announcement) -> None:
        job = "ps" if announcement.task.startswith("/job:ps/") else "worker"
        with _LOCK:
            _RECEIVED[announcement.task] = announcement
        self.received.append(announcement)
        self._report(f"{announcement.describe()}: {_WHAT_FOLLOWS[job]}")
        if self._on_announce is not None:
            try:
                self._on_announce(announcement)
            except Exception as e:  # noqa: BLE001 - the task is answered all the same.
                self._report(f"announcement of {announcement.task}: {e!r}")

    def stop(self) -> None:
        """Stops listening: later announcements are refused at once. Returns
        at once (safe in a signal handler's path: nothing is waited for)."""
        with contextlib.suppress(OSError):
            self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()


def address_for(
    jobs: Mapping[str, object], environ: Mapping[str, str] | None = None
) -> str | None:
    """Where a task announces: `ADDRESS_ENV`, else the chief's host at
    `PORT_ENV`, else None (no announcement).

    Args:
      jobs: the cluster, `{job: [address, ...]}` (a list or `{index:
        address}`).
      environ: the environment (default: this process's).
    """
    environ = os.environ if environ is None else environ
    if environ.get(ADDRESS_ENV):
        return environ[ADDRESS_ENV]
    port = environ.get(PORT_ENV)
    chief = jobs.get("chief")
    if isinstance(chief, Mapping):
        chief = [chief[k] for k in sorted(chief)]
    if not port or not chief:
        return None
    return f"{str(chief[0]).rpartition(':')[0]}:{port}"


def announce(
    address: str,
    task: str,
    task_address: str,
    signal: str,
    timeout_secs: float = ANNOUNCE_TIMEOUT_SECS,
) -> bool:
    """Tells the chief's listener at `address` that `task` is stopping.

    Args:
      address: the listener's `host:port` (`address_for`).
      task: `"/job:worker/task:1"`.
      task_address: the task's own `host:port`, for the chief's line.
      signal: the signal's name, `"SIGTERM"`.
      timeout_secs: the most seconds to wait for the answer, > 0.

    Returns:
      True once the chief has answered (its line printed); False if no
      listener answered within `timeout_secs`.
    """
    if not timeout_secs > 0:
        raise checks.argument_error("timeout_secs", "> 0", timeout_secs)
    word = json.dumps({"task": task, "address": task_address, "signal": signal})
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port)), timeout=timeout_secs
        ) as connection:
            connection.sendall(word.encode() + b"\n")
            with connection.makefile("rb") as answer:
                return answer.readline(16) == b"ok\n"
    except (OSError, ValueError):
        return False
