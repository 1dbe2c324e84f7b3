"""Bounded start-up: the chief waits for every task it trains with, then fails
naming the ones it could not reach.

TensorFlow's `ParameterServerStrategy` blocks without a message, and without a
bound, while a ps or worker task does not answer, and so it does at an
address that accepts TCP connections but is not a TensorFlow server, or is a
hung one; `wait_for_tasks` runs first, with a bound and a progress line that
names what it waits for, and waits for an answer (`health.probe`), not for a
TCP connection.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from absl import logging

from tf_distbelief import checks
from tf_distbelief.cluster import config as config_lib
from tf_distbelief.cluster import health

# A real cluster's tasks may start minutes after the chief (image pulls,
# scheduling); a local cluster's tasks are already listening when it connects.
DEFAULT_CONNECT_TIMEOUT_SECS = 300.0
_POLL_SECS = 0.5
_REPORT_EVERY_SECS = 10.0


class ClusterConnectError(config_lib.ClusterStartError):
    """Tasks of the cluster did not answer within the connect timeout."""


def wait_for_tasks(
    jobs: Mapping[str, Mapping[int, str] | list],
    timeout_secs: float = DEFAULT_CONNECT_TIMEOUT_SECS,
    report: Callable[[str], None] | None = None,
) -> None:
    """Waits until every `ps` and `worker` task answers as a TensorFlow server.

    Args:
      jobs: the cluster, `{job: {index: "host:port"}}` or `{job: [...]}`.
      timeout_secs: the longest wait, in seconds, > 0.
      report: where a progress line goes every 10 s of waiting (default:
        `absl.logging.warning`).

    Raises:
      ValueError: `timeout_secs` is not > 0.
      ClusterConnectError: naming every task that did not answer in time and
        what was found there, e.g. `/job:ps/task:0 at 127.0.0.1:2222 (does not
        accept connections)`.
    """
    if not timeout_secs > 0:
        raise checks.argument_error("connect_timeout_secs", "> 0", timeout_secs)
    report = report or logging.warning
    pending = {}
    for job in config_lib.SERVER_JOBS:
        tasks = jobs.get(job) or {}
        items = tasks.items() if isinstance(tasks, Mapping) else enumerate(tasks)
        for index, address in items:
            pending[f"/job:{job}/task:{index}"] = address
    start = time.monotonic()
    next_report = start + _REPORT_EVERY_SECS
    deadline = start + timeout_secs
    while True:
        # A probe's deadline never carries the wait past `timeout_secs`.
        probe_secs = max(
            0.1, min(health.DEFAULT_PROBE_TIMEOUT_SECS, deadline - time.monotonic())
        )
        states = health.probe_all(pending, probe_secs)
        pending = {
            task: address
            for task, address in pending.items()
            if states[task] is not health.TaskState.ANSWERS
        }
        if not pending:
            return
        now = time.monotonic()
        names = ", ".join(
            f"{task} at {address} ({states[task].describe()})"
            for task, address in pending.items()
        )
        if now >= deadline:
            raise ClusterConnectError(
                f"Could not reach {names} within --connect_timeout_secs="
                f"{timeout_secs:g} s. Start those tasks (or check their addresses "
                "in TF_CONFIG and the network between them and the chief), or "
                "raise --connect_timeout_secs."
            )
        if now >= next_report:
            report(f"waiting for {names} ({now - start:.0f} s of {timeout_secs:g} s)")
            next_report = now + _REPORT_EVERY_SECS
        time.sleep(_POLL_SECS)
