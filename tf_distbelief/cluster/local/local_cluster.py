"""The local cluster: ps and worker tasks as child processes on 127.0.0.1.

The embedded default when there is no `TF_CONFIG`: the calling process becomes
the chief, the tasks run `python -m tf_distbelief.cluster.server_main`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping

import portpicker
from absl import logging

from tf_distbelief import checks, console
from tf_distbelief.cluster import announce, health
from tf_distbelief.cluster import config as config_lib
from tf_distbelief.cluster import server as server_lib
from tf_distbelief.cluster.local import children, hung_tasks
from tf_distbelief.cluster.local import gpus as gpus_lib
from tf_distbelief.cluster.network import emulated, isolation
from tf_distbelief.faults import preemption

# A child server imports TensorFlow (4-5 s on this class of machine) before it
# listens; 120 s leaves room for a loaded 2-core machine starting 4 of them.
DEFAULT_START_TIMEOUT_SECS = 120.0
# SIGTERM ends a TF server in about 2 s; after this we SIGKILL.
_TERMINATE_GRACE_SECS = 10.0
_POLL_SECS = 0.1
# Starts of a cluster whose task found its port taken: portpicker's free port
# can be bound by another process (a second test run, another cluster) before
# the task binds it; each new start picks other free ports.
_START_ATTEMPTS = 3
# How often the supervisor looks for exited tasks; a lost task is down for
# this plus its start-up (4-5 s).
_SUPERVISE_POLL_SECS = 0.2
# How long `stop` asks each task whether it answers before leaving it.
_STOP_PROBE_SECS = 2.0
# How long `stop` waits for a coordinator's failure handler to finish one
# attempt to reconnect a lost task (one `update_server_def`).
_RECOVERY_AT_STOP_SECS = 30.0
# Restarts over the life of one local cluster: a task that keeps dying is a
# fault restarts will not fix.
DEFAULT_MAX_RESTARTS = 10


class LocalCluster:
    """ps and worker tasks as child processes on free 127.0.0.1 ports.

    The embedded default cluster: the calling process becomes the chief. Child
    processes die with the chief (`PR_SET_PDEATHSIG`) and are ended by `stop()`,
    by leaving the `with` block, and at interpreter exit, so no process is left
    behind.

    TensorFlow's servers listen on every interface, whatever the spec's
    127.0.0.1 says, and run any op sent to them. Unless the process runs in a
    private network namespace (`isolation.enter_private_network`, which
    `launch/train.py` calls), `start()` logs one warning naming the ports.

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
      log_dir: where the task logs (`<job>_<index>.log`) and ready files go,
        kept after `stop` (the launch script passes `<model_dir>/cluster`);
        None: a temporary folder, made by `start` and removed by `stop`.
      ports: optional fixed ports, `{"chief": [p], "worker": [p, ...], "ps":
        [...]}`; jobs left out get free ports from portpicker.
      gpus_per_worker: GPUs each worker sees on a GPU host (its own
        `CUDA_VISIBLE_DEVICES`; ps tasks see none): None (default) shares the
        host's GPUs evenly, 0 hides them; see `cluster.local.gpus`. Worker GPU
        memory grows as used (`TF_FORCE_GPU_ALLOW_GROWTH`), and so does the
        chief's unless TensorFlow already uses a GPU in this process.
      visible_gpus: the GPU ids to share out; None finds them
        (`gpus.visible_gpus`: `CUDA_VISIBLE_DEVICES`, else `nvidia-smi -L`).
      restart_lost_tasks: a supervisor thread restarts a ps or worker task that
        exited, on its same address, as an orchestrator would (a Kubernetes
        TFJob's restart policy): the coordinator reconnects a restarted worker
        by itself, and recovers a restarted ps from the last checkpoint
        (`tf_distbelief.faults.recovery`). Off by default: fault-tolerance tests
        restart tasks themselves (`restart`).
      max_restarts: restarts the supervisor does at most, over all tasks;
        then a lost task stays down (the chief's bounded waits name it).
      report: where the supervisor's line per restart goes (default
        `absl.logging.warning`).
      intra_op_threads: threads per op in each ps and worker task (its
        `TF_NUM_INTRAOP_THREADS`); 0 (default): as this process's environment
        gives (TensorFlow: one per core, so more tasks than cores on one host
        oversubscribe them); 1: each task a one-core machine, as the paper's.
      nic_bandwidth: None (default): loopback as it is. A rate (`"1gbit"`,
        `"100mbit"`, bits per second): an emulated network, each ps and
        worker task in a network namespace of its own behind a NIC of that
        rate in and out, on its own address (`cluster.network.emulated`; the chief on
        the bridge's); needs this process in a private network namespace
        (`isolation.enter_private_network`).
      ps_nic_bandwidth: the ps tasks' NIC rate; None: `nic_bandwidth`.
      hung_task_timeout_secs: a ps or worker task that accepts connections but
        has not answered a status probe for this many seconds (stopped, or
        stuck) is killed as lost (`cluster.local.hung_tasks`), so that TensorFlow's
        recovery runs (and the supervisor, with `restart_lost_tasks`,
        restarts it); None (default): hung tasks are not watched.
      on_announce: called with each `announce.Announcement` of a task that
        got SIGTERM (after `report` got its line): a task told the chief it
        is stopping before it exits (`cluster.announce`; the cluster listens
        for that while it runs and gives its tasks the address).

    Attributes:
      hung_task_watch: the `HungTaskWatch` while the cluster runs, else None.
      announcements: the `announce.Listener` of the tasks' announcements while
        the cluster runs, else None.

    Raises:
      ValueError: a count, `max_restarts` or `intra_op_threads` out of range,
        a NIC rate `network.parse_rate` refuses, or `hung_task_timeout_secs`
        not a finite number of seconds > 0.
      EmulatedNetworkError: (`start`) an emulated network asked for where it
        cannot be set up; raised before any task starts.
      GpuAssignmentError: `gpus_per_worker` asks for more GPUs than there are.
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
        gpus_per_worker: int | None = None,
        visible_gpus: list[str] | None = None,
        restart_lost_tasks: bool = False,
        max_restarts: int = DEFAULT_MAX_RESTARTS,
        report: Callable[[str], None] | None = None,
        intra_op_threads: int = 0,
        nic_bandwidth: str | int | None = None,
        ps_nic_bandwidth: str | int | None = None,
        hung_task_timeout_secs: float | None = None,
        on_announce: Callable[[announce.Announcement], None] | None = None,
    ):
        for name, value, least in (
            ("num_workers", num_workers, 1),
            ("num_ps", num_ps, 1),
            ("cpu_devices_per_worker", cpu_devices_per_worker, 1),
            ("max_restarts", max_restarts, 0),
            ("intra_op_threads", intra_op_threads, 0),
        ):
            rule = "a positive integer" if least else "an integer >= 0"
            checks.check_int(name, value, least, rule, rule)
        if not start_timeout_secs > 0:
            raise checks.argument_error(
                "start_timeout_secs", "positive", start_timeout_secs
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
        if hung_task_timeout_secs is not None:
            hung_task_timeout_secs = checks.check_positive_secs(
                "hung_task_timeout_secs", hung_task_timeout_secs
            )
        self.hung_task_timeout_secs = hung_task_timeout_secs
        self.hung_task_watch: hung_tasks.HungTaskWatch | None = None
        # None: loopback as it is; else each task's emulated NIC.
        self.nic_rates = emulated.NicRates.create(nic_bandwidth, ps_nic_bandwidth)
        # The emulated network while the cluster runs (`start` makes it).
        self.network: emulated.EmulatedNetwork | None = None
        if visible_gpus is None:
            visible_gpus = gpus_lib.visible_gpus()
        # `{(job, index): CUDA_VISIBLE_DEVICES}`; empty on a host without GPUs.
        self.gpu_assignment = gpus_lib.assign_gpus(
            visible_gpus, num_workers, num_ps, gpus_per_worker
        )
        self.num_workers = num_workers
        self.num_ps = num_ps
        self.cpu_devices_per_worker = cpu_devices_per_worker
        self.start_timeout_secs = start_timeout_secs
        # A temporary folder of our own is made by `start` and removed by
        # `stop` (a cluster never started leaves none); a given one is kept.
        self._temporary_log_dir = log_dir is None
        self._log_dir = log_dir
        if not self._temporary_log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self.jobs: dict[str, list[str]] = {}
        self.processes: dict[tuple[str, int], subprocess.Popen] = {}
        self.resolver = None
        self.restart_lost_tasks = restart_lost_tasks
        self.max_restarts = max_restarts
        self.intra_op_threads = intra_op_threads
        self.restarts: list[tuple[str, int]] = []
        self._report = report or logging.warning
        # Held while a task is being (re)started or the cluster stopped: the
        # supervisor and `restart`/`stop` never act on one process together.
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._supervisor: threading.Thread | None = None
        self._on_announce = on_announce
        self.announcements: announce.Listener | None = None
        # Announced since the task's last (re)start: `{task name: Announcement}`.
        self._announced: dict[str, announce.Announcement] = {}
        self._announced_lock = threading.Lock()

    def _spawn(self, job: str, index: int) -> subprocess.Popen:
        tf_config = json.dumps(
            {"cluster": self.jobs, "task": {"type": job, "index": index}}
        )
        # The task logs at this process's TensorFlow log level (INFO and
        # WARNING hidden unless set otherwise).
        env = dict(os.environ, TF_CONFIG=tf_config)
        env.pop(announce.PORT_ENV, None)
        env.pop(announce.ADDRESS_ENV, None)
        if self.announcements is not None:
            env[announce.ADDRESS_ENV] = self.announcements.address
        console.quiet_environment(env)
        env.update(gpus_lib.task_env(self.gpu_assignment, job, index))
        if self.intra_op_threads:
            env["TF_NUM_INTRAOP_THREADS"] = str(self.intra_op_threads)
        devices = self.cpu_devices_per_worker if job == "worker" else 1
        log = open(os.path.join(self._log_dir, f"{job}_{index}.log"), "ab")
        ready = self._ready_file(job, index)
        with contextlib.suppress(FileNotFoundError):
            os.remove(ready)
        emulated = self.network
        try:
            proc = children.popen_for_life(
                [
                    sys.executable,
                    "-m",
                    "tf_distbelief.cluster.server_main",
                    f"--cpu_devices={devices}",
                    f"--ready_file={ready}",
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                # Out of the chief's process group: Ctrl-C in a terminal (or
                # a signal to the job's group) reaches the chief alone, which
                # ends the tasks; a task that died of it would be restarted.
                start_new_session=True,
                preexec_fn=(
                    children.set_parent_death_signal
                    if emulated is None
                    else _own_network_namespace
                ),
            )
        finally:
            log.close()
        if emulated is not None:
            try:
                emulated.attach(proc.pid, self._slot(job, index), job)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
        return proc

    def _slot(self, job: str, index: int) -> int:
        """A task's place on the emulated network: the ps tasks, then the workers."""
        return index if job == "ps" else self.num_ps + index

    def _host(self, job: str, index: int = 0) -> str:
        """The address a task listens on: its own on an emulated network."""
        if self.network is None:
            return "127.0.0.1"
        if job == "chief":
            return self.network.chief_host
        return self.network.host(self._slot(job, index))

    def _ready_file(self, job: str, index: int) -> str:
        return os.path.join(self._log_dir, f"{job}_{index}.ready")

    def log_tail(self, job: str, index: int, num_bytes: int = 2000) -> str:
        """Returns the last `num_bytes` of a task's log ("" when there is none:
        before `start`, or after `stop` removed a temporary folder)."""
        if self._log_dir is None:
            return ""
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

        A task whose port, picked by portpicker, another process took before
        the task bound it, makes the cluster start again on other free ports
        (at most `_START_ATTEMPTS` starts, each reported); a port given in
        `ports` is not replaced.

        Returns:
          self, with `resolver` set to the chief's ClusterResolver.

        Raises:
          ClusterStartError: see the class docstring; or the cluster is
            running (started and not stopped: a second start would leave the
            first start's tasks serving).
        """
        if self in _LIVE_CLUSTERS:
            raise config_lib.ClusterStartError(
                f"This LocalCluster is running (ps {self.jobs['ps']}, workers "
                f"{self.jobs['worker']}): call stop() before starting it again."
            )
        for attempt in range(1, _START_ATTEMPTS + 1):
            try:
                return self._start_once()
            except _PortTaken as e:
                if e.job in self._ports or attempt == _START_ATTEMPTS:
                    raise
                self._report(f"local cluster: {e} Starting again on other ports.")
        raise AssertionError("unreachable")  # The last attempt returns or raises.

    def _start_once(self) -> LocalCluster:
        """One start of every task on the ports of `ports` or free ones."""
        if self._log_dir is None:
            self._log_dir = tempfile.mkdtemp(prefix="tf_distbelief_cluster_")
        _register_live(self)
        if any(self.gpu_assignment.values()):
            # Read when this process's TensorFlow first creates its GPU devices
            # (when the strategy connects); without it the chief would reserve
            # almost all memory of the GPUs it shares with the workers.
            os.environ.setdefault("TF_FORCE_GPU_ALLOW_GROWTH", "true")
        try:  # From here a failure stops what started and removes the folder.
            ports = {
                job: self._ports.get(job)
                or [portpicker.pick_unused_port() for _ in range(count)]
                for job, count in (
                    ("chief", 1),
                    ("worker", self.num_workers),
                    ("ps", self.num_ps),
                )
            }
            if self.nic_rates is not None:  # Before any task starts.
                self.network = emulated.EmulatedNetwork(self.nic_rates)
            self.jobs = {
                job: [f"{self._host(job, i)}:{p}" for i, p in enumerate(job_ports)]
                for job, job_ports in ports.items()
            }
            self.announcements = announce.Listener(
                self._host("chief"), report=self._report, on_announce=self._announce
            )
            for job in ("ps", "worker"):
                for index in range(len(self.jobs[job])):
                    self.processes[(job, index)] = self._spawn(job, index)
            self._wait_listening()
        except BaseException:
            self.stop()
            raise
        self.resolver = config_lib.make_resolver(
            {job: dict(enumerate(a)) for job, a in self.jobs.items()}, "chief", 0
        )
        isolation.warn_if_exposed(self.jobs)
        if self.restart_lost_tasks:
            self._stopping.clear()
            self._supervisor = threading.Thread(
                target=self._supervise, name="LocalClusterSupervisor", daemon=True
            )
            self._supervisor.start()
        if self.hung_task_timeout_secs is not None:
            # The watch kills a hung task itself (its own process: see
            # `hung_tasks`); the supervisor restarts it.
            with _stopped_on_error(self), self._lock:
                self.hung_task_watch = hung_tasks.HungTaskWatch(
                    self._task_addresses(),
                    self.hung_task_timeout_secs,
                    action=(
                        "killed, to be restarted"
                        if self.restart_lost_tasks
                        else "killed (`restart_lost_tasks` is off)"
                    ),
                    report=self._report,
                    pids={
                        _task_name(job, index): proc.pid
                        for (job, index), proc in self.processes.items()
                    },
                )
        return self

    def _announce(self, announcement: announce.Announcement) -> None:
        """A task announced it is stopping: its restart line will say so."""
        with self._announced_lock:
            self._announced[announcement.task] = announcement
        if self._on_announce is not None:
            self._on_announce(announcement)

    def _task_addresses(self) -> dict[str, str]:
        """`{"/job:worker/task:0": "127.0.0.1:port", ...}`: ps and worker tasks."""
        return {
            _task_name(job, index): address
            for job in ("worker", "ps")
            for index, address in enumerate(self.jobs.get(job, ()))
        }

    def _supervise(self) -> None:
        """Restarts each ps or worker task that exited (see the class docstring)."""
        while not self._stopping.wait(_SUPERVISE_POLL_SECS):
            with self._lock:
                if self._stopping.is_set():
                    return
                for (job, index), proc in sorted(self.processes.items()):
                    if proc.poll() is None:
                        continue
                    address = self.jobs[job][index]
                    if len(self.restarts) >= self.max_restarts:
                        self._report(
                            f"local cluster: {job}:{index} at {address} exited "
                            f"(code {proc.returncode}); not restarted: "
                            f"{self.max_restarts} restarts done (`max_restarts`)"
                        )
                        self._stopping.set()
                        return
                    self.restarts.append((job, index))
                    code, start = proc.returncode, time.monotonic()
                    with self._announced_lock:
                        said = self._announced.pop(_task_name(job, index), None)
                    why = f"code {code}"
                    if said is not None:
                        why += f", after announcing it was stopping ({said.signal})"
                    try:
                        self._restart_locked(job, index)
                    except config_lib.ClusterStartError as e:
                        self._report(f"local cluster: restart failed: {e}")
                        continue
                    self._report(
                        f"local cluster: {job}:{index} at {address} exited ({why}"
                        f"); restarted on the same address, serving after "
                        f"{time.monotonic() - start:.1f} s (restart "
                        f"{len(self.restarts)} of at most {self.max_restarts})"
                    )

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
                raise checks.argument_error(name, f"in [1, {most}]", value)
        jobs = {
            "chief": {0: f"{self._host('chief')}:{portpicker.pick_unused_port()}"},
            "worker": dict(enumerate(self.jobs["worker"][:num_workers])),
            "ps": dict(enumerate(self.jobs["ps"][:num_ps])),
        }
        return config_lib.make_resolver(jobs, "chief", 0)

    def restart(self, job: str, index: int) -> None:
        """Ends one task if it runs, starts it again on its address, waits for it.

        A restarted worker rejoins the coordinator within seconds (TensorFlow
        reconnects to the same address).
        """
        with self._lock:
            with self._announced_lock:
                self._announced.pop(_task_name(job, index), None)
            self._restart_locked(job, index)

    def _restart_locked(self, job: str, index: int) -> None:
        proc = self.processes[(job, index)]
        watch = self.hung_task_watch
        if watch is not None:
            watch.set_pid(_task_name(job, index), None)  # It forgets the old one.
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        self.processes[(job, index)] = self._spawn(job, index)
        if watch is not None:
            watch.set_pid(_task_name(job, index), self.processes[(job, index)].pid)
        self._wait_listening({(job, index): self.processes[(job, index)]})

    def _wait_listening(self, pending=None) -> None:
        deadline = time.monotonic() + self.start_timeout_secs
        pending = dict(pending or self.processes)
        while pending:
            for (job, index), proc in list(pending.items()):
                address = self.jobs[job][index]
                if proc.poll() is not None:
                    tail = self.log_tail(job, index)
                    taken = (
                        "already in use" in tail.lower()
                        or "failed to add port" in tail.lower()
                    )
                    hint = (
                        f" (port {server_lib.port_of(address)} is already in use)"
                        if taken
                        else ""
                    )
                    message = (
                        f"Local task {job}:{index} at {address} exited with code "
                        f"{proc.returncode} before listening{hint}. Log tail:\n{tail}"
                    )
                    if taken:
                        raise _PortTaken(job, message)
                    raise config_lib.ClusterStartError(message)
                if os.path.exists(self._ready_file(job, index)):
                    del pending[(job, index)]
            if pending and time.monotonic() > deadline:
                names = ", ".join(f"{j}:{i}" for j, i in sorted(pending))
                raise config_lib.ClusterStartError(
                    f"Local tasks {names} did not listen within "
                    f"{self.start_timeout_secs:g} s (`start_timeout_secs`)."
                )
            time.sleep(_POLL_SECS)

    def kill(self, job: str, index: int, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to one task (for fault-tolerance tests)."""
        self.processes[(job, index)].send_signal(sig)

    def stop(self, leave_tasks: bool = True) -> None:
        """Ends every task: SIGTERM, then SIGKILL after a grace period.

        First this process's eager context leaves the tasks while they still
        answer (`eager_context.disconnect_from_tasks`), so that exiting later
        does not log a gRPC error per function and task; not if one of them
        is hung (`health.probe`), as leaving would wait on it for ever. A
        stopped task is sent SIGCONT after SIGTERM, so that it ends too. A
        task lost for good that a coordinator is reconnecting is started once
        more, so that the reconnect ends (`_reconnected_before_leaving`): a
        later strategy of this process then connects at once. Every wait is
        bounded: the hung task watch, the supervisor's restart in progress,
        the probes (2 s), a lost task's start (`start_timeout_secs`), a
        coordinator's attempt to reconnect a lost task (30 s; the
        coordinators' failure handlers are stopped before the tasks are left,
        as leaving them beside a reconnect crashed the process), the SIGTERM
        grace (10 s).

        Args:
          leave_tasks: leave the tasks before ending them (default). False
            when the process ends at once afterwards (`os._exit`, as on
            SIGTERM), whose teardown never runs.
        """
        _LIVE_CLUSTERS.discard(self)
        self._stopping.set()
        if self.announcements is not None:
            # First: the tasks this ends announce nothing to a chief that
            # ends them itself (their calls are refused at once).
            self.announcements.stop()
            self.announcements = None
        if self.hung_task_watch is not None:
            self.hung_task_watch.stop()
            self.hung_task_watch = None
        supervisor = self._supervisor
        if supervisor is not None and supervisor is not threading.current_thread():
            # At most one task restart in progress (`start_timeout_secs`).
            supervisor.join(self.start_timeout_secs + _TERMINATE_GRACE_SECS)
        if leave_tasks and "tensorflow" in sys.modules and self.jobs:
            # Leaving the tasks talks to each of them, and to a hung one for
            # ever: only when all answer a probe (else the exit logs a line per
            # function and task, and nothing waits).
            tasks = self._task_addresses()
            states = health.probe_all(tasks, _STOP_PROBE_SECS)
            if all(s is not health.TaskState.SILENT for s in states.values()):
                refused = [
                    task
                    for task, state in states.items()
                    if state is health.TaskState.REFUSED
                ]
                if refused and self._reconnected_before_leaving(refused):
                    refused = []
                _leave_tasks(list(tasks.values()), lost_for_good=bool(refused))
        procs = [p for p in self.processes.values() if p.poll() is None]
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
                proc.send_signal(signal.SIGCONT)  # A stopped task handles it.
        deadline = time.monotonic() + _TERMINATE_GRACE_SECS
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait()
        if self.network is not None:
            self.network.close()
            self.network = None
        if self._temporary_log_dir and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
            self._log_dir = None

    def _reconnected_before_leaving(self, lost: list[str]) -> bool:
        """Restarts the `lost` tasks if a coordinator is reconnecting one,
        and waits for the reconnect to finish.

        A coordinator's failure handler reconnects a lost task with a call
        that waits, without a bound, for the task to answer; while it waits,
        so do the worker threads that lost the task, and a new strategy of
        this process would wait for them (`wait_for_idle_coordinators`).
        Left so, they would wake up when a later cluster serves the task's
        address (fixed ports) and reconnect it beside that cluster's own
        connection. Restarting the lost task on its address lets the
        reconnect finish as TensorFlow's recovery does, before the tasks
        are left and ended; those coordinators' closure queues are stopped
        first, so that their worker threads end instead of running the work
        still queued. Bounded: each task's start (`start_timeout_secs`), then
        `_RECOVERY_AT_STOP_SECS` for the reconnect and the worker threads.

        Args:
          lost: names (`"/job:worker/task:1"`) of the tasks refusing
            connections.

        Returns:
          True if no coordinator waits for one of this cluster's tasks now.
        """
        from tf_distbelief.tf_internals import coordinator

        handlers = coordinator.reconnecting_failure_handlers(
            self._task_addresses().values()
        )
        if not handlers:
            return False
        # Their queued work is not run on the task started again.
        coordinator.stop_closure_queues(handlers)
        try:
            with self._lock:
                for job, index in sorted(self.processes):
                    if _task_name(job, index) in lost:
                        self._restart_locked(job, index)
        except config_lib.ClusterStartError as e:
            logging.warning(
                "Could not restart a lost task for its coordinator's reconnect "
                "at stop: %s",
                e,
            )
            return False
        if coordinator.wait_until_reconnected(handlers, _RECOVERY_AT_STOP_SECS):
            return True
        logging.warning(
            "A coordinator was still reconnecting a restarted task after %g s at stop.",
            _RECOVERY_AT_STOP_SECS,
        )
        return False

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


@contextlib.contextmanager
def _stopped_on_error(cluster: LocalCluster):
    """Stops `cluster` (its tasks) if the block raises, and re-raises."""
    try:
        yield
    except BaseException:
        cluster.stop()
        raise


def _task_name(job: str, index: int) -> str:
    """`"/job:ps/task:0"`: a task's name, as TensorFlow and the watch name it."""
    return f"/job:{job}/task:{index}"


def _own_network_namespace() -> None:
    """Child-side: dies with the chief, in a network namespace of its own."""
    children.set_parent_death_signal()
    emulated.EmulatedNetwork.preexec()


def _leave_tasks(addresses: list[str], lost_for_good: bool) -> None:
    """Leaves the tasks at `addresses` once no coordinator's failure handler
    can reconnect one of them (an `update_server_def` beside a handler's
    crashed the process, SIGSEGV, when a restarted task came back): the
    handlers are stopped first, each waited for at most
    `_RECOVERY_AT_STOP_SECS` in all. With `lost_for_good` (a task refuses
    connections and the supervisor has stopped, so it will not come back) a
    handler's reconnect can only fail, and blocks on that task for minutes:
    it is not waited for."""
    from tf_distbelief.tf_internals import coordinator, eager_context

    wait_secs = 0.0 if lost_for_good else _RECOVERY_AT_STOP_SECS
    with coordinator.failure_handlers_stopped(addresses, wait_secs) as held:
        if not held and not lost_for_good:
            logging.warning(
                "Not leaving the local cluster's tasks politely: a coordinator "
                "was still reconnecting a task after %g s.",
                _RECOVERY_AT_STOP_SECS,
            )
            return
        try:
            left = eager_context.disconnect_from_tasks(addresses)
        except Exception as e:  # noqa: BLE001 (ending the tasks comes first)
            logging.warning("Could not disconnect from the local cluster: %s", e)
            left = False
    # Outside the handlers' locks: dropping a kept iterator may drop the last
    # reference to an earlier coordinator, whose `__del__` stops its failure
    # handler (taking the lock held above).
    if left and eager_context.connected_to_no_remote_task():
        coordinator.release_per_worker_resources()


class _PortTaken(config_lib.ClusterStartError):
    """A task of `job` exited before listening because its port was taken."""

    def __init__(self, job: str, message: str):
        super().__init__(message)
        self.job = job


_LIVE_CLUSTERS: set[LocalCluster] = set()
_CLEANUP_INSTALLED = False


def stop_live_clusters(leave_tasks: bool = True) -> None:
    """Stops every `LocalCluster` of this process that is still running.

    Args:
      leave_tasks: as for `LocalCluster.stop`; False when the process ends
        at once afterwards (a signal handler), whose teardown never runs.
    """
    for cluster in list(_LIVE_CLUSTERS):
        cluster.stop(leave_tasks)


def _register_live(cluster: LocalCluster) -> None:
    """Stops `cluster` at interpreter exit and on SIGTERM of this (chief) process."""
    global _CLEANUP_INSTALLED
    _LIVE_CLUSTERS.add(cluster)
    if _CLEANUP_INSTALLED:
        return
    import atexit

    atexit.register(stop_live_clusters)
    _CLEANUP_INSTALLED = True
    if threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)

    def _on_sigterm(signum, frame):
        # Then the process ends at once, as SIGTERM's default action would:
        # the interpreter's teardown waited for ever on a `ClusterCoordinator`
        # still retrying its functions on the ended tasks (seen: a chief
        # SIGTERMed as it started training did not exit in 900 s).
        # The handler that was there first (a launched job's one line, which
        # may end the process itself), then the tasks whatever it did; unless
        # it asked for a save at the signal, which ends the process itself
        # within its grace period (`faults.preemption`), the tasks first.
        try:
            if callable(previous):
                previous(signum, frame)
        finally:
            if not preemption.requested():
                stop_live_clusters(leave_tasks=False)
                console.end_process(128 + signum)

    signal.signal(signal.SIGTERM, _on_sigterm)
