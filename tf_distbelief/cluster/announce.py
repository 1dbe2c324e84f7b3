"""A ps or worker task's word to the chief that it is stopping (SIGTERM).

An orchestrator takes a pod away with SIGTERM and a grace period (a
Kubernetes pod deleted or its node drained, a preemptible machine reclaimed).
A task that dies unannounced is a failure for the chief to diagnose: a failed
call, a probe. A task that gets SIGTERM says so first (`announce`): the chief
prints one line naming it and the signal (`worker 1 at HOST:PORT announced it
is stopping (SIGTERM)`), counts it as an announced loss (the job's goodput
lines) and its recovery names the cause, while the task goes on to exit.

The word travels as one gRPC call (grpcio, TensorFlow's own transport, without
TensorFlow) to a small listener of the chief's (`Listener`), with a deadline
(`ANNOUNCE_TIMEOUT_SECS`). TensorFlow's servers cannot carry it: their
services are fixed in C++, and the task cannot add one to its port. So the
chief listens on a port of its own, which the tasks learn from their
environment: a local cluster gives each task the listener's address
(`ADDRESS_ENV`); with `TF_CONFIG`, setting `PORT_ENV` on every pod (the chief
and the tasks) makes the chief listen on that port of every interface and the
tasks announce to the chief's host of the cluster spec at that port. The call
is answered once the chief has printed its line, so the line comes before the
task's exit. An announcement that finds no listener (none configured, the
chief gone) costs the task at most the deadline and changes nothing: the chief
learns of the loss as of any other.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
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
_METHOD = "/tf_distbelief.Announce/Stopping"
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
        parts = dict(p.split(":", 1) for p in self.task.strip("/").split("/"))
        return f"{parts.get('job', '?')} {parts.get('task', '?')}"

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
    """The chief's listener for announcements (a gRPC server of its own).

    Args:
      host: the address to listen on (`"127.0.0.1"`; `"[::]"`: every
        interface).
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
        import grpc

        if not checks.is_int(port) or not 0 <= port <= 65535:
            raise checks.argument_error("port", "an integer in 0..65535", port)
        self.received: list[Announcement] = []
        self._report = report
        self._on_announce = on_announce
        self._server = grpc.server(concurrent.futures.ThreadPoolExecutor(2))
        service, method = _METHOD.strip("/").split("/")
        self._server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    service, {method: grpc.unary_unary_rpc_method_handler(self._call)}
                ),
            )
        )
        try:
            bound = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:
            bound = 0
        if not bound:
            raise OSError(
                f"The announcement listener could not listen on {host}:{port} "
                "(the port is in use, or the host is not this machine's)."
            )
        self._server.start()
        self.address = f"{host}:{bound}"

    def _call(self, request: bytes, context) -> bytes:
        del context
        word = json.loads(request)
        announcement = Announcement(
            str(word["task"]),
            str(word["address"]),
            str(word["signal"]),
            time.monotonic(),
        )
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
        return b"ok"

    def stop(self) -> None:
        """Stops listening: later calls are refused at once; one in progress
        gets 0.5 s to be answered. Returns at once (safe in a signal
        handler's path: nothing is waited for)."""
        self._server.stop(0.5)


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
    import grpc

    if not timeout_secs > 0:
        raise checks.argument_error("timeout_secs", "> 0", timeout_secs)
    word = json.dumps({"task": task, "address": task_address, "signal": signal})
    channel = grpc.insecure_channel(address)
    try:
        call = channel.unary_unary(_METHOD)
        call(word.encode(), timeout=timeout_secs, wait_for_ready=False)
        return True
    except grpc.RpcError:
        return False
    finally:
        channel.close()
