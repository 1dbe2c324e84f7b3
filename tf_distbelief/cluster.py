"""The cluster: `TF_CONFIG`, validation, ps/worker servers and the local cluster.

This is the only module that reads `TF_CONFIG`. It follows TensorFlow's layout for
parameter-server training (`tf.distribute.experimental.ParameterServerStrategy`):

* `chief`: the coordinator (Dean et al. 2012, section 4: it schedules work; in
  Sandblaster it also drives the optimizer). It runs the training program.
* `worker`: a model replica. It runs `tf.distribute.Server` and executes the
  functions the coordinator schedules on it.
* `ps`: a parameter-server shard. It runs `tf.distribute.Server` and holds a slice
  of every sharded variable.
* `evaluator` (optional): a side-car that reads checkpoints; training never
  contacts it, so it is removed from the cluster the strategy connects to.

With no `TF_CONFIG` and no explicit resolver, `LocalCluster` starts the ps and
worker tasks as child processes on free 127.0.0.1 ports (the embedded default).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

import portpicker

ALLOWED_JOBS = ("chief", "worker", "ps", "evaluator")
SERVER_JOBS = ("worker", "ps")
_TF_CONFIG = "TF_CONFIG"

# A child server imports TensorFlow (4-5 s on this class of machine) before it
# listens; 120 s leaves room for a loaded 2-core machine starting 4 of them.
DEFAULT_START_TIMEOUT_SECS = 120.0
# SIGTERM ends a TF server in about 2 s; after this we SIGKILL.
_TERMINATE_GRACE_SECS = 10.0
_POLL_SECS = 0.1


class ClusterConfigError(ValueError):
    """A cluster configuration (`TF_CONFIG` or a resolver) is invalid."""


class ClusterStartError(RuntimeError):
    """A local ps or worker task failed to start or died."""


def _normalize_job(job: str, tasks: Any) -> dict[int, str]:
    """Returns `{task_index: "host:port"}` for a job given as a list or a dict."""
    if isinstance(tasks, (list, tuple)):
        items = enumerate(tasks)
    elif isinstance(tasks, Mapping):
        items = []
        for key, address in tasks.items():
            try:
                index = int(key)
            except (TypeError, ValueError):
                raise ClusterConfigError(
                    f"Task index {key!r} of job `{job}` is not an integer. A sparse "
                    'job is a JSON object with integer keys, e.g. {"1": '
                    '"127.0.0.1:2223"}.'
                ) from None
            if index < 0:
                raise ClusterConfigError(
                    f"Task index {index} of job `{job}` is negative; task indices "
                    "are >= 0."
                )
            items.append((index, address))
    else:
        raise ClusterConfigError(
            f"Job `{job}` must be a list of 'host:port' strings or an object "
            f"mapping task index to 'host:port'. Received: {tasks!r}"
        )
    result = {}
    for index, address in items:
        if not isinstance(address, str) or address.rpartition(":")[2] == "":
            raise ClusterConfigError(
                f"Address of task {job}:{index} must be a 'host:port' string. "
                f"Received: {address!r}"
            )
        result[index] = address
    return result


def validate_cluster(
    cluster: Any, task_type: str | None, task_id: int | None
) -> dict[str, dict[int, str]]:
    """Validates a cluster description and the current task.

    Args:
      cluster: `{job: ["host:port", ...]}` or `{job: {"index": "host:port"}}`,
        as in the `cluster` field of `TF_CONFIG`.
      task_type: this process's job (`chief`, `worker`, `ps`, `evaluator`), or
        None for a process outside the cluster.
      task_id: this process's index within its job, or None.

    Returns:
      The cluster as `{job: {task_index: "host:port"}}`, jobs without tasks
      dropped.

    Raises:
      ClusterConfigError: an unknown job name, a task type not in the cluster, a
        task index out of range (negative included), no `ps` or no `worker`
        task, more than one `chief`, or the same host:port used twice.
    """
    if not isinstance(cluster, Mapping) or not cluster:
        raise ClusterConfigError(
            "The cluster must be a non-empty object mapping job names "
            f"({', '.join(ALLOWED_JOBS)}) to task addresses. Received: {cluster!r}"
        )
    unknown = sorted(job for job in cluster if job not in ALLOWED_JOBS)
    if unknown:
        raise ClusterConfigError(
            f"Unknown job name(s) {unknown} in the cluster; allowed job names are "
            f"{', '.join(ALLOWED_JOBS)}. For example use `worker` and `ps`, not "
            "`worker_hosts` and `ps_hosts`."
        )
    jobs = {job: _normalize_job(job, tasks) for job, tasks in cluster.items()}
    jobs = {job: tasks for job, tasks in jobs.items() if tasks}
    for job in SERVER_JOBS:
        if job not in jobs:
            raise ClusterConfigError(
                f"The cluster has no `{job}` task; parameter-server training needs "
                f"at least one `ps` and one `worker`. Jobs received: {sorted(jobs)}"
            )
    for job in ("chief", "evaluator"):
        if len(jobs.get(job, {})) > 1:
            raise ClusterConfigError(
                f"The cluster has {len(jobs[job])} `{job}` tasks; at most 1 is allowed."
            )
    seen: dict[str, str] = {}
    for job, tasks in jobs.items():
        for index, address in sorted(tasks.items()):
            if address in seen:
                raise ClusterConfigError(
                    f"Address {address} is used twice: by {seen[address]} and by "
                    f"{job}:{index}. Every task needs its own host:port."
                )
            seen[address] = f"{job}:{index}"
    if task_type is not None:
        if task_type not in ALLOWED_JOBS:
            raise ClusterConfigError(
                f"Task type {task_type!r} is not a known job; allowed are "
                f"{', '.join(ALLOWED_JOBS)}."
            )
        if task_type not in jobs:
            raise ClusterConfigError(
                f"Task type `{task_type}` is not in the cluster, whose jobs are "
                f"{sorted(jobs)}."
            )
        if not isinstance(task_id, int) or isinstance(task_id, bool):
            raise ClusterConfigError(
                f"Task index of `{task_type}` must be an integer. Received: {task_id!r}"
            )
        if task_id not in jobs[task_type]:
            raise ClusterConfigError(
                f"Task index {task_id} is out of range for job `{task_type}`, "
                f"whose task indices are {sorted(jobs[task_type])}."
            )
    return jobs


def _make_resolver(jobs, task_type, task_id, rpc_layer="grpc"):
    import tensorflow as tf

    cluster_spec = tf.train.ClusterSpec(jobs)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster_spec, task_type=task_type, task_id=task_id, rpc_layer=rpc_layer
    )


def resolve_cluster(cluster_resolver=None):
    """Returns the validated cluster to train on, or None for a local cluster.

    An explicit `cluster_resolver` wins over `TF_CONFIG`. `TF_CONFIG` is parsed
    here, validated with `validate_cluster`, and turned into a TensorFlow
    `SimpleClusterResolver` (sparse jobs with string keys are normalised, which
    `TFConfigClusterResolver` does not do).

    Args:
      cluster_resolver: a `tf.distribute.cluster_resolver.ClusterResolver`, or
        None to read `TF_CONFIG`.

    Returns:
      A `tf.distribute.cluster_resolver.ClusterResolver`, or None when neither a
      resolver nor `TF_CONFIG` is given.

    Raises:
      ClusterConfigError: `TF_CONFIG` is not valid JSON, lacks `cluster`, or the
        cluster fails `validate_cluster`.
    """
    if cluster_resolver is not None:
        spec = cluster_resolver.cluster_spec().as_dict()
        task_type = cluster_resolver.task_type
        task_id = cluster_resolver.task_id
        jobs = validate_cluster(spec, task_type, task_id)
        return _make_resolver(
            jobs, task_type, task_id, cluster_resolver.rpc_layer or "grpc"
        )
    text = os.environ.get(_TF_CONFIG, "").strip()
    if not text:
        return None
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterConfigError(
            f"`TF_CONFIG` is not valid JSON ({e.msg} at line {e.lineno} column "
            f"{e.colno}). Received: {text[:200]!r}"
        ) from None
    if not isinstance(config, dict) or "cluster" not in config:
        raise ClusterConfigError(
            "`TF_CONFIG` must be a JSON object with a `cluster` field and a `task` "
            f"field. Received: {text[:200]!r}"
        )
    task = config.get("task", {})
    if not isinstance(task, dict):
        raise ClusterConfigError(
            f'`TF_CONFIG` field `task` must be {{"type": ..., "index": ...}}. '
            f"Received: {task!r}"
        )
    task_type = task.get("type")
    task_id = task.get("index", 0 if task_type else None)
    jobs = validate_cluster(config["cluster"], task_type, task_id)
    return _make_resolver(jobs, task_type, task_id, config.get("rpc_layer", "grpc"))


def training_cluster_resolver(cluster_resolver):
    """Returns `cluster_resolver` without the `evaluator` job (never contacted)."""
    jobs = cluster_resolver.cluster_spec().as_dict()
    jobs.pop("evaluator", None)
    task_type = cluster_resolver.task_type
    if task_type == "evaluator":
        task_type = None
    return _make_resolver(
        jobs, task_type, cluster_resolver.task_id, cluster_resolver.rpc_layer
    )


def server_config(cpu_devices: int = 1, inter_op_threads: int = 0):
    """Returns the `tf.compat.v1.ConfigProto` a ps or worker server starts with.

    Args:
      cpu_devices: CPU devices the server exposes (`/device:CPU:0..n-1`). Model
        parallelism on CPUs needs more than 1; logical devices configured in the
        process are not seen by a `tf.distribute.Server`.
      inter_op_threads: the inter-op thread pool size, 0 for TensorFlow's default.

    Returns:
      A `tf.compat.v1.ConfigProto`.
    """
    import tensorflow as tf

    return tf.compat.v1.ConfigProto(
        device_count={"CPU": cpu_devices},
        inter_op_parallelism_threads=inter_op_threads,
    )


def _port_of(address: str) -> int:
    return int(address.rpartition(":")[2])


def _host_of(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _listening(address: str) -> bool:
    try:
        with socket.create_connection((_host_of(address), _port_of(address)), 0.5):
            return True
    except OSError:
        return False


def run_server(
    cluster_resolver,
    cpu_devices: int = 1,
    chief_gone_secs: float | None = None,
    ready_file: str | None = None,
) -> None:
    """Runs this process's ps or worker task until SIGTERM/SIGINT, then exits 0.

    TensorFlow servers never exit by themselves. Besides SIGTERM, a task can end
    when the coordinator is done: with `chief_gone_secs` set, the task exits once
    the chief's port, after having been seen listening, has refused connections
    for that many seconds (a restarted chief within that time keeps the cluster).

    Args:
      cluster_resolver: a resolver whose task type is `ps` or `worker`.
      cpu_devices: CPU devices this server exposes (see `server_config`).
      chief_gone_secs: seconds without a listening chief before exiting, or None
        to serve until a signal.
      ready_file: a path written once the server listens (how `LocalCluster`
        knows the task is up), or None.

    Raises:
      ClusterConfigError: the task type is not `ps` or `worker`.
      ClusterStartError: the server could not listen on its address.
    """
    import tensorflow as tf

    task_type = cluster_resolver.task_type
    if task_type not in SERVER_JOBS:
        raise ClusterConfigError(
            f"Only `ps` and `worker` tasks run a server. Received task type "
            f"{task_type!r}."
        )
    spec = training_cluster_resolver(cluster_resolver).cluster_spec()
    stop = threading.Event()

    def _on_signal(signum, frame):
        del frame
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    address = spec.task_address(task_type, cluster_resolver.task_id)
    try:
        tf.distribute.Server(
            spec,
            job_name=task_type,
            task_index=cluster_resolver.task_id,
            protocol=cluster_resolver.rpc_layer or "grpc",
            config=server_config(cpu_devices),
            start=True,
        )
    except tf.errors.UnknownError as e:
        raise ClusterStartError(
            f"The {task_type}:{cluster_resolver.task_id} server could not listen on "
            f"{address}: port {_port_of(address)} is already in use or the host is "
            f"not this machine ({e.message})."
        ) from None
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(address)
    chief = spec.as_dict().get("chief")
    chief_address = chief[0] if isinstance(chief, list) and chief else None
    seen_chief = False
    gone_since = None
    while not stop.wait(1.0):
        if chief_gone_secs is None or chief_address is None:
            continue
        if _listening(chief_address):
            seen_chief, gone_since = True, None
        elif seen_chief:
            gone_since = gone_since or time.monotonic()
            if time.monotonic() - gone_since >= chief_gone_secs:
                break
    sys.stdout.flush()
    sys.stderr.flush()
    # The gRPC server has no clean shutdown in TF 2; ending the process is the
    # supported way to stop it.
    os._exit(0)


def _set_parent_death_signal():
    """Child-side: SIGKILL this process when the parent dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


class LocalCluster:
    """ps and worker tasks as child processes on free 127.0.0.1 ports.

    The embedded default cluster: the calling process becomes the chief. Child
    processes die with the chief (`PR_SET_PDEATHSIG`) and are ended by `stop()`,
    by leaving the `with` block, and at interpreter exit, so no process is left
    behind.

    Example:
      ```
      with LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = tf_distbelief.DistBeliefStrategy(cluster.resolver)
      ```

    Args:
      num_workers: worker tasks (model replicas), >= 1.
      num_ps: ps tasks (parameter shards), >= 1.
      cpu_devices_per_worker: CPU devices each worker server exposes, >= 1.
      start_timeout_secs: how long to wait for all tasks to listen.
      log_dir: where task logs go; a temporary folder by default.
      ports: optional fixed ports, `{"chief": [p], "worker": [p, ...], "ps":
        [...]}`; jobs left out get free ports from portpicker.

    Raises:
      ValueError: a count is not a positive integer.
      ClusterStartError: a task died or did not listen in time (its log tail is
        in the message).
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        cpu_devices_per_worker: int = 1,
        start_timeout_secs: float = DEFAULT_START_TIMEOUT_SECS,
        log_dir: str | None = None,
        ports: Mapping[str, list[int]] | None = None,
    ):
        for name, value in (
            ("num_workers", num_workers),
            ("num_ps", num_ps),
            ("cpu_devices_per_worker", cpu_devices_per_worker),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"Argument `{name}` must be a positive integer. Received: {value!r}"
                )
        if not start_timeout_secs > 0:
            raise ValueError(
                "Argument `start_timeout_secs` must be positive. Received: "
                f"{start_timeout_secs!r}"
            )
        counts = {"chief": 1, "worker": num_workers, "ps": num_ps}
        ports = dict(ports or {})
        for job, job_ports in ports.items():
            if job not in counts or len(job_ports) != counts[job]:
                raise ValueError(
                    f"Argument `ports` must map chief/worker/ps to as many ports as "
                    f"tasks ({counts}). Received: {job!r}: {job_ports!r}"
                )
        self._ports = ports
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.cpu_devices_per_worker = cpu_devices_per_worker
        self.start_timeout_secs = start_timeout_secs
        self._log_dir = log_dir or tempfile.mkdtemp(prefix="tf_distbelief_cluster_")
        self.jobs: dict[str, list[str]] = {}
        self.processes: dict[tuple[str, int], subprocess.Popen] = {}
        self.resolver = None

    def _spawn(self, job: str, index: int) -> subprocess.Popen:
        tf_config = json.dumps(
            {"cluster": self.jobs, "task": {"type": job, "index": index}}
        )
        env = dict(os.environ, TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="2")
        devices = self.cpu_devices_per_worker if job == "worker" else 1
        log = open(os.path.join(self._log_dir, f"{job}_{index}.log"), "ab")
        ready = self._ready_file(job, index)
        with contextlib.suppress(FileNotFoundError):
            os.remove(ready)
        try:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tf_distbelief.server_main",
                    f"--cpu_devices={devices}",
                    f"--ready_file={ready}",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_set_parent_death_signal,
            )
        finally:
            log.close()

    def _ready_file(self, job: str, index: int) -> str:
        return os.path.join(self._log_dir, f"{job}_{index}.ready")

    def log_tail(self, job: str, index: int, num_bytes: int = 2000) -> str:
        """Returns the last `num_bytes` of a task's log."""
        path = os.path.join(self._log_dir, f"{job}_{index}.log")
        try:
            with open(path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - num_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def start(self) -> LocalCluster:
        """Starts every task and waits until all listen.

        Returns:
          self, with `resolver` set to the chief's ClusterResolver.

        Raises:
          ClusterStartError: see the class docstring.
        """
        ports = {
            job: self._ports.get(job)
            or [portpicker.pick_unused_port() for _ in range(count)]
            for job, count in (
                ("chief", 1),
                ("worker", self.num_workers),
                ("ps", self.num_ps),
            )
        }
        self.jobs = {
            job: [f"127.0.0.1:{p}" for p in job_ports]
            for job, job_ports in ports.items()
        }
        _register_live(self)
        for job in ("ps", "worker"):
            for index in range(len(self.jobs[job])):
                self.processes[(job, index)] = self._spawn(job, index)
        try:
            self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self.resolver = _make_resolver(
            {job: dict(enumerate(a)) for job, a in self.jobs.items()}, "chief", 0
        )
        return self

    def resolver_for(self, num_workers: int | None = None, num_ps: int | None = None):
        """Returns a chief resolver for the first `num_workers` workers and `num_ps` ps.

        Each call names a new, free chief port: in TF 2.21 a process that
        reconnects with a different cluster spec starts a new chief server, which
        cannot bind the port of the one before (servers never shut down). Tests
        use this to share one cluster among strategies of different sizes.

        Args:
          num_workers: workers to include (all by default), 1..`self.num_workers`.
          num_ps: ps tasks to include (all by default), 1..`self.num_ps`.

        Returns:
          A `tf.distribute.cluster_resolver.SimpleClusterResolver` of task `chief`.

        Raises:
          ValueError: a count out of range.
        """
        num_workers = self.num_workers if num_workers is None else num_workers
        num_ps = self.num_ps if num_ps is None else num_ps
        for name, value, most in (
            ("num_workers", num_workers, self.num_workers),
            ("num_ps", num_ps, self.num_ps),
        ):
            if not 1 <= value <= most:
                raise ValueError(
                    f"Argument `{name}` must be in [1, {most}]. Received: {value}"
                )
        jobs = {
            "chief": {0: f"127.0.0.1:{portpicker.pick_unused_port()}"},
            "worker": dict(enumerate(self.jobs["worker"][:num_workers])),
            "ps": dict(enumerate(self.jobs["ps"][:num_ps])),
        }
        return _make_resolver(jobs, "chief", 0)

    def restart(self, job: str, index: int) -> None:
        """Ends one task if it runs, starts it again on its address, waits for it.

        A restarted worker rejoins the coordinator within seconds (TensorFlow
        reconnects to the same address).
        """
        proc = self.processes[(job, index)]
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self.processes[(job, index)] = self._spawn(job, index)
        self._wait_listening({(job, index): self.processes[(job, index)]})

    def _wait_listening(self, pending=None) -> None:
        deadline = time.monotonic() + self.start_timeout_secs
        pending = dict(pending or self.processes)
        while pending:
            for (job, index), proc in list(pending.items()):
                address = self.jobs[job][index]
                if proc.poll() is not None:
                    tail = self.log_tail(job, index)
                    hint = (
                        f" (port {_port_of(address)} is already in use)"
                        if "already in use" in tail.lower()
                        or "failed to add port" in tail.lower()
                        else ""
                    )
                    raise ClusterStartError(
                        f"Local task {job}:{index} at {address} exited with code "
                        f"{proc.returncode} before listening{hint}. Log tail:\n{tail}"
                    )
                if os.path.exists(self._ready_file(job, index)):
                    del pending[(job, index)]
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{j}:{i}" for j, i in sorted(pending))
                raise ClusterStartError(
                    f"Local tasks {names} did not listen within "
                    f"{self.start_timeout_secs:g} s (`start_timeout_secs`)."
                )
            time.sleep(_POLL_SECS)

    def kill(self, job: str, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to one task (for fault-tolerance tests)."""
        self.processes[(job, index)].send_signal(sig)

    def stop(self) -> None:
        """Ends every task: SIGTERM, then SIGKILL after a grace period."""
        _LIVE_CLUSTERS.discard(self)
        procs = [p for p in self.processes.values() if p.poll() is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE_SECS
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


_LIVE_CLUSTERS: set[LocalCluster] = set()
_CLEANUP_INSTALLED = False


def _stop_live_clusters() -> None:
    for cluster in list(_LIVE_CLUSTERS):
        cluster.stop()


def _register_live(cluster: LocalCluster) -> None:
    """Stops `cluster` at interpreter exit and on SIGTERM of this (chief) process."""
    global _CLEANUP_INSTALLED
    _LIVE_CLUSTERS.add(cluster)
    if _CLEANUP_INSTALLED:
        return
    import atexit

    atexit.register(_stop_live_clusters)
    _CLEANUP_INSTALLED = True
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def _on_sigterm(signum, frame):
        _stop_live_clusters()
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_sigterm)
