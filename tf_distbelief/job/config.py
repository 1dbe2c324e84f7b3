"""`JobConfig`: the settings of one training job, each with one owner.

The launch script's flags are derived from these dataclasses and their
defaults: `JobConfig` for the job, `DownpourConfig` (its `downpour` field) for
Downpour SGD, `SandblasterConfig` (its `sandblaster` field) for Sandblaster
L-BFGS. Each value is validated once, by the dataclass that owns it.
"""

from __future__ import annotations

import dataclasses

from tf_distbelief import checks, console, errors, partitioning, paths
from tf_distbelief import downpour as downpour_lib
from tf_distbelief import sandblaster as sandblaster_lib
from tf_distbelief.cluster import connect as connect_lib
from tf_distbelief.cluster import source as cluster_source
from tf_distbelief.cluster.local import hung_tasks
from tf_distbelief.cluster.network import emulated
from tf_distbelief.faults import settings as fault_settings

OPTIMIZERS = ("adagrad", "sgd", "lbfgs")


@dataclasses.dataclass
class JobConfig:
    """Everything a training job needs besides its model (`ModelSpec`).

    Attributes:
      optimizer: `adagrad` (on the ps shards, section 4.1), `sgd`, or `lbfgs`
        (Sandblaster L-BFGS, section 4.2: full-batch, the coordinator driving
        vector operations on the ps shards).
      learning_rate: gamma of AdaGrad or the SGD step size, > 0.
      initial_accumulator_value: AdaGrad's `a_0`, >= 0.
      epsilon: AdaGrad's epsilon, >= 0.
      staleness_power: stock tf_keras training with AdaGrad: a gradient
        computed on parameters `tau` updates old is applied with step
        `learning_rate / max(1, tau)^staleness_power`, >= 0; 0 turns it off
        (`adagrad.staleness`).
      batch_size: examples per step per worker, >= 1.
      epochs: epochs to train to, >= 1 (a resumed run continues to this epoch).
      steps_per_epoch: steps per epoch over all workers, >= 1.
      steps_per_execution: steps in one scheduled function, >= 1.
      num_workers: local cluster workers (ignored with `TF_CONFIG`), >= 1.
      num_ps: local cluster ps tasks (ignored with `TF_CONFIG`), >= 1.
      partitioner: one of `partitioning.PARTITIONERS` (`strategy.make_partitioner`).
      shard_bytes: the shard size of `min_size` and `max_size`, > 0.
      model_dir: checkpoints and TensorBoard logs, or None.
      export_dir: where the chief exports the trained model at the end
        (`export.export_model`: a SavedModel and a `.keras` file), or None.
      checkpoint_every_steps: steps between checkpoints besides each epoch
        end, >= 0 (0: epoch ends only); a failure loses at most this many
        steps. Needs `model_dir`.
      nonfinite: a step (Downpour: a push) with a NaN or inf gradient is
        never applied; `raise` stops the job naming the step, `skip` skips
        and counts it (`faults.settings.NONFINITE_MODES`).
      log_every_steps: progress lines every so many steps; 0 per epoch only.
      seed: model initialisation and data seed.
      chief_gone_secs: a ps/worker task exits once the chief has been gone this
        long (None: serve until SIGTERM).
      connect_timeout_secs: the chief fails, naming the tasks, when a ps or
        worker task does not answer as a TensorFlow server within this many
        seconds (> 0; a local cluster's tasks already listen when it connects).
      hung_task_timeout_secs: a ps or worker task that accepts connections but
        has not answered a status probe for this many seconds is hung and
        treated as lost (`cluster.local.hung_tasks`): the local cluster kills and
        restarts it, so its step in flight runs again on another worker;
        with `TF_CONFIG` the chief names it and leaves it to the orchestrator
        (the pods' liveness probe). Finite, > 0.
      step_stall_timeout_secs: the chief fails, naming the workers not
        accepting connections, when scheduled steps wait this many seconds
        with none finishing (every worker gone; `step_watch`; finite, > 0).
      ps_recovery_secs: a ps task lost during training is waited for this
        many seconds to serve again, then every ps variable and slot is
        restored from the last checkpoint in `model_dir` and training goes on
        (`recovery`); >= 0, 0 turns recovery off.
      preemption_grace_secs: seconds from SIGTERM (or `preemption_signal`)
        to the chief's exit: with a `model_dir`, the chief saves the step
        reached in that time, or abandons the save whole
        (`faults.preemption`); finite, >= 0, 0 ends the job at once unsaved.
        Below Kubernetes' default grace of 30 s.
      preemption_signal: None, or one more signal than SIGTERM that saves and
        stops the job (`faults.settings.PREEMPTION_SIGNALS`: Slurm's
        `--signal=USR1@60` sends SIGUSR1).
      downpour: a `DownpourConfig` to train with Downpour SGD (section 4.1: a
        parameter cache per worker), or None (default) for TensorFlow's stock
        parameter-server training.
      sandblaster: the `SandblasterConfig` of `optimizer="lbfgs"` (L-BFGS
        history, iterations, work portions, backup tasks).
      devices_per_replica: devices one model replica is split over (section 3:
        model parallelism), >= 1; > 1 needs a `ModelSpec` with
        `model_parallel`. Local cluster workers then expose that many CPU
        devices; with `TF_CONFIG`, worker tasks start with that many.
      gpus_per_worker: local cluster on a GPU host: GPUs each worker sees
        (`CUDA_VISIBLE_DEVICES`; ps tasks none), >= 0; None shares the
        host's GPUs evenly (`cluster.local.gpus`); 0 trains on CPUs. Ignored with
        `TF_CONFIG` (the cluster manager assigns devices).
      emulate_nic: local cluster only: None (default) uses loopback as it is;
        a rate (`1gbit`, `100mbit`, ...) puts each task behind an emulated NIC
        of that rate in and out (`cluster.network.emulated`; needs the private
        network namespace). Refused with `TF_CONFIG`.
      emulate_ps_nic: the ps tasks' emulated NIC rate; None: `emulate_nic`.
      cluster_from: where the cluster comes from (`cluster.source.CLUSTER_SOURCES`):
        `auto` (`TF_CONFIG`, else a JobSet's environment, else the local
        cluster), `tf_config`, or `jobset` (the pod's JobSet identity).
    """

    optimizer: str = "adagrad"
    learning_rate: float = 0.2
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    staleness_power: float = 0.75
    batch_size: int = 32
    epochs: int = 5
    steps_per_epoch: int = 100
    steps_per_execution: int = 10
    # The launch script's first line names them before TensorFlow loads.
    num_workers: int = console.LOCAL_NUM_WORKERS
    num_ps: int = console.LOCAL_NUM_PS
    partitioner: str = "min_size"
    shard_bytes: int = partitioning.DEFAULT_MIN_SHARD_BYTES
    model_dir: str | None = None
    export_dir: str | None = None
    checkpoint_every_steps: int = 0
    nonfinite: str = "raise"
    log_every_steps: int = 100
    seed: int = 0
    chief_gone_secs: float | None = None
    connect_timeout_secs: float = connect_lib.DEFAULT_CONNECT_TIMEOUT_SECS
    hung_task_timeout_secs: float = hung_tasks.DEFAULT_HUNG_TASK_TIMEOUT_SECS
    step_stall_timeout_secs: float = fault_settings.DEFAULT_STEP_STALL_TIMEOUT_SECS
    ps_recovery_secs: float = fault_settings.DEFAULT_PS_RECOVERY_SECS
    preemption_grace_secs: float = fault_settings.DEFAULT_PREEMPTION_GRACE_SECS
    preemption_signal: str | None = None
    downpour: downpour_lib.DownpourConfig | None = None
    sandblaster: sandblaster_lib.SandblasterConfig = dataclasses.field(
        default_factory=lambda: sandblaster_lib.SandblasterConfig()
    )
    devices_per_replica: int = 1
    gpus_per_worker: int | None = None
    emulate_nic: str | None = None
    emulate_ps_nic: str | None = None
    cluster_from: str = "auto"

    def validate(self) -> JobConfig:
        """Checks every field; returns self.

        Raises:
          ConfigError: naming the first bad field, its value and what is allowed.
          TypeError: `downpour` is not a `DownpourConfig` or None, or
            `sandblaster` not a `SandblasterConfig`.
        """
        for name, allowed in (
            ("optimizer", OPTIMIZERS),
            ("partitioner", partitioning.PARTITIONERS),
            ("nonfinite", fault_settings.NONFINITE_MODES),
            ("cluster_from", cluster_source.CLUSTER_SOURCES),
        ):
            if getattr(self, name) not in allowed:
                raise checks.argument_error(
                    name,
                    f"one of {', '.join(allowed)}",
                    getattr(self, name),
                    setting=True,
                )
        for name in (
            "batch_size",
            "epochs",
            "steps_per_epoch",
            "steps_per_execution",
            "num_workers",
            "num_ps",
            "shard_bytes",
            "devices_per_replica",
        ):
            if getattr(self, name) < 1:
                raise checks.argument_error(
                    name, ">= 1", getattr(self, name), setting=True
                )
        if self.gpus_per_worker is not None and self.gpus_per_worker < 0:
            raise checks.argument_error(
                "gpus_per_worker",
                ">= 0 or None (share the host's GPUs)",
                self.gpus_per_worker,
                setting=True,
            )
        if not self.connect_timeout_secs > 0:
            raise checks.argument_error(
                "connect_timeout_secs", "> 0", self.connect_timeout_secs, setting=True
            )
        if not 0 < self.hung_task_timeout_secs < float("inf"):
            raise checks.argument_error(
                "hung_task_timeout_secs",
                "a finite number of seconds > 0",
                self.hung_task_timeout_secs,
                setting=True,
            )
        if not 0 < self.step_stall_timeout_secs < float("inf"):
            raise checks.argument_error(
                "step_stall_timeout_secs",
                "a finite number of seconds > 0",
                self.step_stall_timeout_secs,
                setting=True,
            )
        if not 0 <= self.ps_recovery_secs < float("inf"):
            raise checks.argument_error(
                "ps_recovery_secs",
                "a finite number >= 0 (0: no recovery)",
                self.ps_recovery_secs,
                setting=True,
            )
        if not 0 <= self.preemption_grace_secs < float("inf"):
            raise checks.argument_error(
                "preemption_grace_secs",
                "a finite number >= 0 (0: stop at once, unsaved)",
                self.preemption_grace_secs,
                setting=True,
            )
        if (
            self.preemption_signal is not None
            and self.preemption_signal not in fault_settings.PREEMPTION_SIGNALS
        ):
            raise checks.argument_error(
                "preemption_signal",
                f"None or one of {', '.join(fault_settings.PREEMPTION_SIGNALS)}",
                self.preemption_signal,
                setting=True,
            )
        if not self.learning_rate > 0:
            raise checks.argument_error(
                "learning_rate", "> 0", self.learning_rate, setting=True
            )
        if self.downpour is not None:
            if not isinstance(self.downpour, downpour_lib.DownpourConfig):
                raise checks.argument_error(
                    "downpour",
                    "a tf_distbelief DownpourConfig or None",
                    self.downpour,
                    setting=True,
                )
            if self.optimizer == "lbfgs":
                raise errors.ConfigError(
                    "`downpour` trains with SGD-type optimizers (adagrad, sgd); "
                    "`optimizer=lbfgs` is Sandblaster. Received both."
                )
        if not isinstance(self.sandblaster, sandblaster_lib.SandblasterConfig):
            raise checks.argument_error(
                "sandblaster",
                "a tf_distbelief SandblasterConfig",
                self.sandblaster,
                setting=True,
            )
        if self.checkpoint_every_steps and not self.model_dir:
            raise errors.ConfigError(
                "`checkpoint_every_steps` needs `model_dir` (where the "
                f"checkpoints go). Received: {self.checkpoint_every_steps!r} "
                "and model_dir=None"
            )
        if self.model_dir:
            paths.check_model_dir(self.model_dir)
        for name in ("emulate_nic", "emulate_ps_nic"):
            if getattr(self, name) is not None:
                try:
                    emulated.parse_rate(getattr(self, name), name)
                except ValueError as e:
                    raise errors.ConfigError(str(e)) from None
        if self.emulate_ps_nic is not None and self.emulate_nic is None:
            raise errors.ConfigError(
                "`emulate_ps_nic` needs `emulate_nic` (the workers' and chief's "
                f"NIC rate). Received: {self.emulate_ps_nic!r}"
            )
        for name in (
            "initial_accumulator_value",
            "epsilon",
            "staleness_power",
            "log_every_steps",
            "checkpoint_every_steps",
        ):
            if getattr(self, name) < 0:
                raise checks.argument_error(
                    name, ">= 0", getattr(self, name), setting=True
                )
        return self
