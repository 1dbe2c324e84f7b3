"""One training job, dispatched on the task type: the library side of `launch/`.

`run(config, spec)` is what `launch/train.py` calls. With `TF_CONFIG` naming a
`ps` or `worker` task it serves; `evaluator` evaluates each new checkpoint;
`chief` (or no `TF_CONFIG`: a local cluster is started) trains and reports test
accuracy. The model and its data come from a `ModelSpec`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import time
from collections.abc import Callable

import tensorflow as tf
import tf_keras
from absl import logging

from tf_distbelief import (
    adagrad,
    checks,
    cluster,
    console,
    downpour,
    errors,
    hooks,
    paths,
)
from tf_distbelief import model_parallel as model_parallel_lib
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.cluster import announce
from tf_distbelief.cluster import config as cluster_config
from tf_distbelief.cluster import connect as cluster_connect
from tf_distbelief.cluster.local import hung_tasks
from tf_distbelief.downpour import report as downpour_report
from tf_distbelief.faults import goodput, nonfinite, recovery, tf_keras_fit
from tf_distbelief.fit import evaluation, export, training
from tf_distbelief.job import stopping
from tf_distbelief.job.config import JobConfig
from tf_distbelief.job.spec import ModelSpec


def check_spec(config: JobConfig, spec: ModelSpec) -> None:
    """Checks that `spec` can train as `config` asks.

    Raises:
      TypeError: `spec` is not a `ModelSpec`.
      ConfigError: `config.devices_per_replica > 1` and `spec` has no
        model-parallel version, or `optimizer=lbfgs` and no `load_data`.
    """
    if not isinstance(spec, ModelSpec):
        raise checks.argument_error("spec", "a tf_distbelief ModelSpec", spec)
    if config.optimizer == "lbfgs" and spec.load_data is None:
        raise errors.ConfigError(
            "`optimizer=lbfgs` (Sandblaster, full batch) trains on `load_data`'s "
            f"arrays; ModelSpec {spec.name!r} has only `dataset_fn`."
        )
    if config.devices_per_replica > 1 and not spec.model_parallel:
        raise errors.ConfigError(
            "`devices_per_replica` > 1 needs a model with a model-parallel "
            "version (a ModelSpec with `model_parallel=True`; the demo models "
            f"digits and speech). Received: model={spec.name!r}"
        )


def build_model(config: JobConfig, spec: ModelSpec, devices=None):
    """Returns the uncompiled model of `spec` (tf_keras, or Keras 3 for a
    Keras 3 spec).

    Args:
      config: the job.
      spec: the model.
      devices: with `config.devices_per_replica > 1`, the devices of one replica
        (default: `model_parallel.worker_device_names(k)`: the workers' GPUs
        when each has k, else their `/device:CPU:0..k-1`).

    Raises:
      ConfigError: the model cannot be split into `devices_per_replica`
        partitions (e.g. more than a layer's output rows), naming it.
    """
    k = config.devices_per_replica
    if k > 1:
        try:
            return spec.build_model(
                devices or model_parallel_lib.worker_device_names(k)
            )
        except ValueError as e:
            raise errors.ConfigError(
                f"`devices_per_replica` must split model {spec.name!r} into "
                f"partitions its layers can hold. Received: {k} ({e})"
            ) from e
    return spec.build_model(None)


def build_optimizer(config: JobConfig) -> tf_keras.optimizers.Optimizer:
    """Returns the ps-side optimizer `config.optimizer` names."""
    if config.optimizer == "adagrad":
        return adagrad.Adagrad(
            config.learning_rate,
            initial_accumulator_value=config.initial_accumulator_value,
            epsilon=config.epsilon,
            staleness_power=config.staleness_power,
        )
    return tf_keras.optimizers.SGD(config.learning_rate)


def compile_model(config: JobConfig, strategy, spec: ModelSpec) -> tf_keras.Model:
    """Builds and compiles `spec`'s model under `strategy`'s scope.

    With `config.downpour`, Downpour is enabled on `strategy` first and installed
    on the compiled model; its `Downpour` object is `hooks.of(model).state`.
    """
    if config.downpour is not None:
        downpour.enable(strategy)
    with strategy.scope():
        model = build_model(config, spec)
        model.compile(
            optimizer=build_optimizer(config),
            loss=spec.loss(),
            metrics=list(spec.metrics),
            steps_per_execution=config.steps_per_execution,
        )
        if config.downpour is not None:
            downpour.install(model, config.downpour)
    return model


def train(
    config: JobConfig, spec: ModelSpec, cluster_resolver, print_fn=console.echo
) -> dict:
    """Trains on the cluster `cluster_resolver` describes, from the chief.

    A lost ps task is recovered from the last checkpoint in `model_dir`
    (`recovery.run_with_ps_recovery`: each attempt connects a new strategy
    and builds the model anew).

    Args:
      config: a validated `JobConfig`.
      spec: the model and its data.
      cluster_resolver: the chief's ClusterResolver.
      print_fn: where progress lines go.

    Returns:
      `{"test_accuracy": float or None (no test arrays), "epochs": int,
      "initial_epoch": int, "history": [...], "train_secs": float,
      "ps_recoveries": int}`; with `config.export_dir`, the model is
      exported there first.

    Raises:
      recovery.PsLostError: a ps task was lost and could not be recovered.
    """
    return recovery.run_with_ps_recovery(
        lambda: _train_attempt(config, spec, cluster_resolver, print_fn),
        cluster_resolver.cluster_spec().job_tasks("ps"),
        config.model_dir,
        config.ps_recovery_secs,
        print_fn,
    )


def connect_strategy(
    config: JobConfig, cluster_resolver
) -> strategy_lib.DistBeliefStrategy:
    """The job's `DistBeliefStrategy`, connected to the cluster (tf_keras and Keras 3).

    Connected first: a task that cannot be reached fails the job at once.

    Args:
      config: the job (`partitioner`, `shard_bytes`, the connect and step
        stall timeouts).
      cluster_resolver: the chief's ClusterResolver.

    Returns:
      The strategy, its variables sharded over the cluster's ps tasks.
    """
    num_ps = len(cluster_resolver.cluster_spec().as_dict()["ps"])
    return strategy_lib.DistBeliefStrategy(
        cluster_resolver,
        strategy_lib.make_partitioner(config.partitioner, num_ps, config.shard_bytes),
        connect_timeout_secs=config.connect_timeout_secs,
        step_stall_timeout_secs=config.step_stall_timeout_secs,
    )


def _train_attempt(config, spec, cluster_resolver, print_fn) -> dict:
    """One attempt of `train`: a new strategy and model, resumed from `model_dir`."""
    strategy = connect_strategy(config, cluster_resolver)
    if config.optimizer == "lbfgs":
        return _train_sandblaster(config, spec, strategy, *spec.load_data(), print_fn)
    if spec.dataset_fn is not None:
        data = spec.dataset_fn(config.batch_size, config.seed)
        test = spec.test_arrays()
    else:
        (x_train, y_train), test = spec.load_data()
        data = training.dataset_creator(
            x_train, y_train, config.batch_size, config.seed
        )
    model = compile_model(config, strategy, spec)
    algorithm = hooks.of(model)  # Downpour's, or None.
    callbacks = [] if algorithm is None else [downpour.DownpourMetrics(algorithm.state)]
    # Before the first step of a resumed attempt: the restore was exact.
    callbacks.append(tf_keras_fit.VerifyRestored(config.model_dir, print_fn))
    start = time.monotonic()
    result = training.fit(
        model,
        data,
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        batch_size=config.batch_size,
        model_dir=config.model_dir,
        log_every_steps=config.log_every_steps,
        callbacks=callbacks,
        print_fn=print_fn,
        checkpoint_every_steps=config.checkpoint_every_steps,
        nonfinite=config.nonfinite,
    )
    train_secs = time.monotonic() - start
    test_accuracy = training.accuracy(model, *test) if test is not None else None
    counters = None if algorithm is None else algorithm.read_counters()
    steps = result.steps - result.initial_step
    for line in closing_lines(counters, result.nonfinite_skipped, steps):
        print_fn(line)
    if test_accuracy is not None:
        print_fn(f"test accuracy: {test_accuracy:.4f}")
    _export(config, spec, model, print_fn)
    return {
        "test_accuracy": test_accuracy,
        "epochs": result.epochs,
        "initial_epoch": result.initial_epoch,
        "history": result.history,
        "train_secs": train_secs,
    }


def closing_lines(downpour_stats, skipped_steps: int, steps: int) -> list[str]:
    """The lines a training job prints after its last step, before its test
    accuracy: Downpour's summary (`downpour.report.summary_line`), and a
    warning when `--nonfinite=skip` skipped updates
    (`faults.nonfinite.skipped_line`: steps, or a Downpour run's pushes).

    Args:
      downpour_stats: each replica's counters (`Downpour.stats()`), or None
        for stock training.
      skipped_steps: stock training's steps skipped in this run.
      steps: stock training's steps in this run.
    """
    if downpour_stats is None:
        warning = nonfinite.skipped_line(skipped_steps, steps)
        return [] if warning is None else [warning]
    skipped = sum(s.nonfinite_pushes for s in downpour_stats)
    made = sum(s.pushes + s.dropped_pushes + s.nonfinite_pushes for s in downpour_stats)
    warning = nonfinite.skipped_line(skipped, made, "pushes")
    lines = [downpour_report.summary_line(downpour_stats)]
    return lines + ([] if warning is None else [warning])


def _train_sandblaster(config, spec, strategy, train_data, test_data, print_fn) -> dict:
    """`train` with Sandblaster L-BFGS (section 4.2): full-batch, no epochs."""
    from tf_distbelief import sandblaster

    # Built after the strategy connected, outside its scope: the parameters
    # live in Sandblaster's flat vectors on the ps, not in Keras variables.
    model = build_model(config, spec)
    trainer = sandblaster.SandblasterTrainer(
        strategy,
        model,
        spec.loss(),
        *train_data,
        config.sandblaster,
    )
    start = time.monotonic()
    # A rerun with the same `model_dir` resumes at the last L-BFGS checkpoint.
    accountant = goodput.current()
    if accountant is not None:  # Its checkpoints and iterations as training.
        accountant.begin_training(0)
    failed = True
    try:
        result = trainer.fit(model_dir=config.model_dir, print_fn=print_fn)
        failed = False
    finally:
        if accountant is not None:
            accountant.end_training(0, failed)
    train_secs = time.monotonic() - start
    stats = trainer.stats
    accepted = ", ".join(
        f"{worker}: {console.count(n)}"
        for worker, n in sorted(stats.accepted_by_worker.items())
    )
    print_fn(
        f"lbfgs: {result.num_iters} iterations, {result.num_evals} evaluations, "
        f"loss {result.loss:.6g} ({result.message}), {train_secs:.1f} s; "
        f"portions {console.count(stats.portions_scheduled)}, backup copies "
        f"{stats.backup_copies_scheduled}, discarded {stats.copies_discarded}, "
        f"accepted by worker {accepted}"
    )
    test_accuracy = training.accuracy(model, *test_data)
    print_fn(f"test accuracy: {test_accuracy:.4f}")
    _export(config, spec, model, print_fn)
    return {
        "test_accuracy": test_accuracy,
        "iterations": result.num_iters,
        "loss": result.loss,
        "train_secs": train_secs,
        "stats": stats,
    }


def _export(config: JobConfig, spec: ModelSpec, model, print_fn) -> None:
    """`export.export_model` into `config.export_dir`, if set (on the chief).

    The SavedModel's `serving_default` takes the test features' dtype and
    shape (int64 ids for an embedding model), where the spec has test arrays.
    """
    if not config.export_dir:
        return
    # A plain copy on one device: the same partitions on CPU:0 for a
    # model-parallel spec (as the evaluator builds it).
    devices = ["/device:CPU:0"] * config.devices_per_replica
    test = spec.test_arrays()
    input_spec = None
    if test is not None:
        x = test[0]
        input_spec = tf.TensorSpec([None, *x.shape[1:]], tf.as_dtype(x.dtype))
    written = export.export_model(
        model, lambda: build_model(config, spec, devices), config.export_dir, input_spec
    )
    print_fn(written.line(config.export_dir))


def evaluator_test_set(config: JobConfig, spec: ModelSpec) -> tuple:
    """The `evaluator` task's `(x_test, y_test)` arrays (tf_keras and Keras 3).

    Raises:
      ValueError: `config.model_dir` is not set, or `spec` has no test arrays.
    """
    if not config.model_dir:
        raise ValueError("The `evaluator` task needs `model_dir` (checkpoints).")
    test = spec.test_arrays()
    if test is None:
        raise ValueError(
            f"The `evaluator` task needs test arrays: ModelSpec {spec.name!r} has "
            "neither `eval_data` nor `load_data`."
        )
    return test


def evaluate_checkpoints(
    config: JobConfig, spec: ModelSpec, print_fn=console.echo
) -> dict[int, dict[str, float]]:
    """The `evaluator` task: evaluates every checkpoint in `model_dir`, in order.

    `evaluation.evaluate_checkpoints` on the test set: each checkpoint's
    loss and metrics are printed with its path and written to TensorBoard
    (`model_dir/tensorboard/eval`, `eval/<metric>`) at its global step. It
    stops after the checkpoint of `config.epochs` epochs (numbered by its
    step, `epochs * steps_per_epoch`). Training never contacts this task.

    Returns:
      `{step: {metric: value}}`.

    Raises:
      ValueError: `config.model_dir` is not set.
      TimeoutError: no new checkpoint for an hour before the last one.
    """
    x_test, y_test = evaluator_test_set(config, spec)
    # The evaluator has one device: the same partitions (hence the same
    # checkpointed weights) on CPU:0.
    model = build_model(
        config, spec, devices=["/device:CPU:0"] * config.devices_per_replica
    )
    # The trainer's optimizer: the model's checkpoint holds it (its values
    # are not restored), and another optimizer's differ in dtype.
    model.compile(
        optimizer=build_optimizer(config), loss=spec.loss(), metrics=list(spec.metrics)
    )
    model(x_test[:1], training=False)  # Weights exist before a restore.
    return run_evaluator(config, model, (x_test, y_test), print_fn)


def run_evaluator(
    config: JobConfig, model, test_set, print_fn=console.echo, read_checkpoint=None
) -> dict[int, dict[str, float]]:
    """The `evaluator` task's loop for a compiled `model` (tf_keras or Keras 3).

    `evaluation.evaluate_checkpoints` on `test_set` (`(x_test, y_test)`, in
    batches of 512) over `config.model_dir`'s checkpoints up to
    `config.epochs * config.steps_per_epoch`, `eval/*` scalars in
    `model_dir/tensorboard/eval`; `read_checkpoint` as there. Prints
    `evaluator: done` at the end.

    Returns:
      `{step: {metric: value}}`.
    """
    data = tf.data.Dataset.from_tensor_slices(tuple(test_set)).batch(512)
    results = evaluation.evaluate_checkpoints(
        model,
        data,
        paths.checkpoint_dir(config.model_dir),
        last_step=config.epochs * config.steps_per_epoch,
        tensorboard_dir=paths.eval_tensorboard_dir(config.model_dir),
        steps_per_epoch=config.steps_per_epoch,
        print_fn=print_fn,
        read_checkpoint=read_checkpoint,
    )
    print_fn("evaluator: done")
    return results


@dataclasses.dataclass(frozen=True)
class Trainer:
    """How the chief trains one kind of model; `run` does the rest of the job.

    The job spine (`run`: validation, the local cluster or `TF_CONFIG`, the
    ps/worker servers, the export folder check) is the same for every kind of
    model; a `Trainer` holds what differs.

    Attributes:
      name: what trains, for the local cluster's line (e.g. `"tf_keras"`).
      check: `(config, spec) -> None`, raises `ConfigError` for a setting this
        trainer cannot honour, before any server starts.
      train: `(config, spec, cluster_resolver, print_fn) -> dict`, the
        chief's training (`train`).
      evaluate: `(config, spec, print_fn) -> dict`, the `evaluator` task, or
        None where there is none.
    """

    name: str
    check: Callable[[JobConfig, ModelSpec], None]
    train: Callable[..., dict]
    evaluate: Callable[..., dict] | None = None


def gpu_summary(assignment) -> str:
    """`worker 0: 0,1; worker 1: 2,3; ps: none` from `LocalCluster.gpu_assignment`."""
    parts = [f"{j} {i}: {v}" for (j, i), v in sorted(assignment.items()) if v]
    return "; ".join(parts + ["ps: none"])


def run(
    config: JobConfig,
    spec: ModelSpec,
    print_fn=console.echo,
    trainer=None,
    start_secs: float | None = None,
    stop_on_signals: bool = False,
    ends_process: bool = False,
) -> dict | None:
    """Runs this process's part of the job; see the module docstring.

    Everything is validated before any server starts. On the chief (or a
    local job) the run holds `config.model_dir`'s lock
    (`paths.ModelDirLock`) and accounts its wall time from `start_secs`
    (`faults.goodput`): its `goodput:` line ends the job's output.

    Args:
      config: the job.
      spec: the model and its data (not loaded on ps and worker tasks).
      print_fn: where progress lines go.
      trainer: the chief's `Trainer`; None means `TF_KERAS` (a tf_keras
        model). `tf_distbelief.keras3.job.TRAINER` trains a Keras 3 model.
      start_secs: when the job started, on `time.monotonic`'s scale, for
        its goodput (`main` passes the process's start); None: now.
      stop_on_signals: on the chief (or a local job), SIGINT and SIGTERM
        end the process with one line (`job.stopping`; SIGTERM first saves
        the step reached, within `config.preemption_grace_secs`); `main`'s
        choice, never a library caller's.
      ends_process: the process ends at once after `run` (`main`: `os._exit`,
        no interpreter teardown). A local cluster's tasks are then ended
        without leaving them first (`LocalCluster.stop(leave_tasks=False)`):
        leaving spares the teardown's lines about functions on ended tasks,
        which never come, and it waited for each worker to delete the
        dataset iterators kept until then: 28 s after the test accuracy of a
        10,000-step digits job on 2 cores (stacks taken during it), long
        enough for an orchestrator's liveness rule to kill the chief.

    Returns:
      On the chief, `train`'s result; on other tasks, None.

    Raises:
      ValueError: a bad `config` field or cluster (`ClusterConfigError`).
      ModelDirInUseError: another live job trains into `config.model_dir`
        (the chief, or a local job, holds `paths.ModelDirLock` for its life).
      ClusterStartError: a local task failed to start.
    """
    trainer = TF_KERAS if trainer is None else trainer
    accountant = goodput.Goodput(start_secs)
    config.validate()
    trainer.check(config, spec)
    resolver = cluster.resolve_cluster(cluster_from=config.cluster_from)
    if resolver is not None and config.emulate_nic is not None:
        raise errors.ConfigError(
            "`emulate_nic` emulates the local cluster's network; with "
            f"`TF_CONFIG` the network is real. Received: {config.emulate_nic!r}"
        )
    trains = resolver is None or resolver.task_type == "chief"
    if config.export_dir and trains:
        export.check_export_dir(config.export_dir, config.model_dir)
    if trains:
        # Permission bits pass for root on /proc or a read-only mount: write.
        for name in ("model_dir", "export_dir"):
            if getattr(config, name):
                paths.probe_writable(name, getattr(config, name))
    if not trains:
        return _run(config, spec, print_fn, trainer, resolver, ends_process)
    if stop_on_signals:
        stopping.install(
            config.model_dir,
            print_fn,
            config.preemption_grace_secs,
            config.preemption_signal,
        )
    lock = contextlib.nullcontext()
    if config.model_dir:
        # One job per model_dir, refused before any server starts; the
        # evaluator only reads it.
        lock = paths.ModelDirLock(config.model_dir, print_fn)
    with lock, goodput.active(accountant):
        result = _run(config, spec, print_fn, trainer, resolver, ends_process)
        for line in accountant.end_lines():
            print_fn(line)
    return result


def _run(config, spec, print_fn, trainer, resolver, ends_process) -> dict | None:
    """`run` after validation (and the model_dir's lock, on the chief)."""
    if resolver is None:
        local = cluster.LocalCluster(
            config.num_workers,
            config.num_ps,
            cpu_devices_per_worker=config.devices_per_replica,
            gpus_per_worker=config.gpus_per_worker,
            restart_lost_tasks=True,
            report=print_fn,
            nic_bandwidth=config.emulate_nic,
            ps_nic_bandwidth=config.emulate_ps_nic,
            hung_task_timeout_secs=config.hung_task_timeout_secs,
            log_dir=config.model_dir and paths.cluster_log_dir(config.model_dir),
            on_announce=_count_announced,
        ).start()
        try:
            print_fn(
                f"local cluster: {config.num_workers} workers, {config.num_ps} ps "
                f"({', '.join(a for j in ('worker', 'ps') for a in local.jobs[j])}; "
                f"{trainer.name})"
            )
            if any(local.gpu_assignment.values()):
                print_fn(f"local cluster GPUs: {gpu_summary(local.gpu_assignment)}")
            if local.nic_rates is not None:
                print_fn(
                    f"network: emulated, {local.nic_rates.describe()} (each task "
                    "in its own network namespace behind a shaped veth; the "
                    "chief unshaped; no added latency)"
                )
            return trainer.train(config, spec, local.resolver, print_fn)
        finally:
            local.stop(leave_tasks=not ends_process)
    task_type = resolver.task_type
    logging.info("Task %s:%s", task_type, resolver.task_id)
    if task_type in cluster.SERVER_JOBS:
        cluster.run_server(
            resolver,
            cpu_devices=config.devices_per_replica if task_type == "worker" else 1,
            chief_gone_secs=config.chief_gone_secs,
        )
        return None
    if task_type == "evaluator" and trainer.evaluate is not None:
        trainer.evaluate(config, spec, print_fn)
        return None
    if task_type != "chief":
        roles = "chief, worker, ps" + (" or evaluator" if trainer.evaluate else "")
        raise cluster_config.ClusterConfigError(
            f"`TF_CONFIG` task type {task_type!r} is not run by {trainer.name}: "
            f"it runs {roles}."
        )
    watch = _report_hung_tasks(config, resolver, print_fn)
    listener = _listen_for_announcements(print_fn)
    try:
        return trainer.train(config, spec, resolver, print_fn)
    finally:
        watch.stop()
        if listener is not None:
            listener.stop()


def _count_announced(announcement: announce.Announcement) -> None:
    """Counts a task's announced loss in the job's goodput (`losses_line`)."""
    accountant = goodput.current()
    if accountant is not None:
        accountant.announced_loss(announcement.describe())


def _listen_for_announcements(print_fn) -> announce.Listener | None:
    """The `TF_CONFIG` chief's listener for its tasks' announcements, on every
    interface at `announce.PORT_ENV`'s port; None when it is not set."""
    port = os.environ.get(announce.PORT_ENV)
    if not port:
        return None
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise checks.argument_error(
            announce.PORT_ENV,
            "a port in 1..65535",
            port,
            fix="(where the chief hears its tasks announce SIGTERM)",
            prefix="Environment variable",
            error=cluster_config.ClusterConfigError,
        )
    return announce.Listener(
        "", int(port), report=print_fn, on_announce=_count_announced
    )


def _report_hung_tasks(config, resolver, print_fn) -> hung_tasks.HungTaskWatch:
    """The `TF_CONFIG` chief's watch: names a hung task; its pod's liveness
    probe (`cluster.k8s.manifest`), or whatever runs it, restarts it."""
    jobs = resolver.cluster_spec().as_dict()
    tasks = {
        f"/job:{job}/task:{index}": address
        for job in cluster.SERVER_JOBS
        for index, address in enumerate(jobs.get(job, ()))
    }
    return hung_tasks.HungTaskWatch(
        tasks,
        config.hung_task_timeout_secs,
        action=(
            "left to the orchestrator, which restarts it (the pods' liveness "
            "probe: python -m tf_distbelief.cluster.health); its step in flight "
            "runs again once it is restarted"
        ),
        report=print_fn,
    )


# The tf_keras job: `Model.fit` (stock or Downpour) or Sandblaster L-BFGS.
TF_KERAS = Trainer("tf_keras", check_spec, train, evaluate_checkpoints)


def main(config: JobConfig, spec: ModelSpec, trainer: Trainer | None = None) -> None:
    """Runs `run(config, spec)` for a launch script, then ends the process at once.

    The job's goodput counts from the process's start
    (`goodput.process_start_secs`): TensorFlow's import is start-up.

    SIGQUIT writes every thread's Python stack to stderr (`faulthandler`);
    the job goes on.

    TensorFlow's interpreter teardown tries to remove functions from the cluster
    tasks that `run` has already ended, and logs an error per task; ending the
    process after flushing skips that teardown. A failed job too ends at once,
    after writing its whole traceback to stderr: its teardown can hang
    (`console.exit_when_done`).

    Args:
      config: the job.
      spec: the model and its data.
      trainer: the chief's `Trainer` (`run`'s).

    Raises:
      errors.ConfigError: a refused setting (raised before any cluster
        starts), for the launch script to print in one line. A cluster whose
        tasks do not answer within the connect timeout
        (`ClusterConnectError`) or a non-finite step or push that stopped the
        job (`NonFiniteError`, `nonfinite="raise"`) ends the process with
        status 1 and one line naming them; any other `Exception`, with its
        traceback.
    """
    start_secs = goodput.process_start_secs()
    # `kill -QUIT PID`: every thread's Python stack to stderr, and the job
    # goes on: how a pause (a silent chief) shows where it is.
    faulthandler.register(signal.SIGQUIT, all_threads=True)
    console.exit_when_done(
        run,
        config,
        spec,
        console.echo,
        trainer,
        start_secs,
        True,
        True,
        keep=(errors.ConfigError,),
        one_line=(cluster_connect.ClusterConnectError, errors.NonFiniteError),
    )
