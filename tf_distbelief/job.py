"""One training job, dispatched on the task type: the library side of `launch/`.

`run(config)` is what `launch/train.py` calls. With `TF_CONFIG` naming a `ps` or
`worker` task it serves; `evaluator` evaluates each new checkpoint; `chief` (or no
`TF_CONFIG`: a local cluster is started) trains and reports test accuracy.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import tensorflow as tf
import tf_keras
from absl import logging

import models
import models.model_parallel
from tf_distbelief import cluster, training
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.adagrad import optimizer as adagrad
from tf_distbelief.downpour import replica as downpour
from tf_distbelief.downpour import schedule as downpour_schedule
from tf_distbelief.model_parallel import devices as model_parallel
from tf_distbelief.sandblaster import trainer as sandblaster

MODELS = tuple(models.MODELS)
OPTIMIZERS = ("adagrad", "sgd", "lbfgs")
PARTITIONERS = ("min_size", "max_size", "fixed")
MODEL_PARALLEL_MODELS = ("digits", "speech")
LOCAL_OPTIMIZERS = downpour_schedule.LOCAL_OPTIMIZERS
ADAGRAD_ACCUMULATORS = downpour_schedule.ADAGRAD_ACCUMULATORS


@dataclasses.dataclass
class JobConfig:
    """Everything a training job needs; the launch script's flags map onto it.

    Attributes:
      model: one of `MODELS`.
      optimizer: `adagrad` (on the ps shards, section 4.1), `sgd`, or `lbfgs`
        (Sandblaster L-BFGS, section 4.2: full-batch, the coordinator driving
        vector operations on the ps shards).
      learning_rate: gamma of AdaGrad or the SGD step size, > 0.
      initial_accumulator_value: AdaGrad's `a_0`, >= 0.
      epsilon: AdaGrad's epsilon, >= 0.
      batch_size: examples per step per worker, >= 1.
      epochs: epochs to train to, >= 1 (a resumed run continues to this epoch).
      steps_per_epoch: steps per epoch over all workers, >= 1.
      steps_per_execution: steps in one scheduled function, >= 1.
      num_workers: local cluster workers (ignored with `TF_CONFIG`), >= 1.
      num_ps: local cluster ps tasks (ignored with `TF_CONFIG`), >= 1.
      partitioner: `min_size`/`max_size` (`shard_bytes` per shard, at most one
        shard per ps) or `fixed` (one shard per ps).
      shard_bytes: the shard size of `min_size` and `max_size`, > 0.
      model_dir: checkpoints and TensorBoard logs, or None.
      log_every_steps: progress lines every so many steps; 0 per epoch only.
      speech_hidden_units: width of the speech model's hidden layers.
      speech_classes: the speech model's softmax width.
      seed: model initialisation and data seed.
      chief_gone_secs: a ps/worker task exits once the chief has been gone this
        long (None: serve until SIGTERM).
      downpour: train with Downpour SGD (section 4.1: a parameter cache per
        worker) instead of TensorFlow's stock parameter-server training.
      n_fetch: Downpour: steps between fetches, >= 1.
      n_push: Downpour: steps between pushes, >= 1.
      local_learning_rate: Downpour: step size of each worker's update of its
        cache, >= 0, or None: `learning_rate` for a local AdaGrad step, 0.5
        for a local SGD step (`DownpourConfig.local_learning_rate`).
      local_optimizer: Downpour: the update of each worker's cache, one of
        `LOCAL_OPTIMIZERS` (`DownpourConfig.local_optimizer`).
      adagrad_accumulator: Downpour with AdaGrad: how a push grows the ps
        accumulator, one of `ADAGRAD_ACCUMULATORS`
        (`DownpourConfig.adagrad_accumulator`).
      warmstart_steps: Downpour: steps worker 0 trains alone first, >= 0.
      max_staleness: Downpour: drop pushes staler than this (None: never).
      lbfgs_history: Sandblaster: `m`, the (s, y) pairs kept on the ps, >= 1.
      lbfgs_max_iters: Sandblaster: L-BFGS iterations at most, >= 1.
      portions: Sandblaster: work portions per batch, >= 1 (far more than
        workers).
      backup_tasks: Sandblaster: copies of the last outstanding portions go to
        idle workers; the first to finish counts.
      straggler_worker: test/benchmark hook: this worker runs its portions
        `straggler_slowdown` times slower (None: no straggler).
      straggler_slowdown: the straggler's slowdown factor, >= 1.
      devices_per_replica: devices one model replica is split over (section 3:
        model parallelism), >= 1; > 1 needs `model` digits (a partitioned
        locally connected model) or speech (partitioned dense layers). Local
        cluster workers then expose that many CPU devices; with `TF_CONFIG`,
        worker tasks start with that many CPU devices.
    """

    model: str = "digits"
    optimizer: str = "adagrad"
    learning_rate: float = 0.2
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    batch_size: int = 32
    epochs: int = 5
    steps_per_epoch: int = 100
    steps_per_execution: int = 10
    num_workers: int = 2
    num_ps: int = 2
    partitioner: str = "min_size"
    shard_bytes: int = strategy_lib.DEFAULT_MIN_SHARD_BYTES
    model_dir: str | None = None
    log_every_steps: int = 100
    speech_hidden_units: int = 256
    speech_classes: int = 8192
    seed: int = 0
    chief_gone_secs: float | None = None
    downpour: bool = False
    n_fetch: int = 1
    n_push: int = 1
    local_learning_rate: float | None = None
    local_optimizer: str = "adagrad"
    adagrad_accumulator: str = "squares"
    warmstart_steps: int = 0
    max_staleness: int | None = None
    lbfgs_history: int = 10
    lbfgs_max_iters: int = 100
    portions: int = 32
    backup_tasks: bool = True
    straggler_worker: int | None = None
    straggler_slowdown: float = 1.0
    devices_per_replica: int = 1

    def validate(self) -> JobConfig:
        """Checks every field; returns self.

        Raises:
          ValueError: naming the first bad field, its value and what is allowed.
        """
        for name, allowed in (
            ("model", MODELS),
            ("optimizer", OPTIMIZERS),
            ("partitioner", PARTITIONERS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"`{name}` must be one of {', '.join(allowed)}. Received: "
                    f"{getattr(self, name)!r}"
                )
        for name in (
            "batch_size",
            "epochs",
            "steps_per_epoch",
            "steps_per_execution",
            "num_workers",
            "num_ps",
            "shard_bytes",
            "speech_hidden_units",
            "speech_classes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"`{name}` must be >= 1. Received: {getattr(self, name)!r}"
                )
        if not self.learning_rate > 0:
            raise ValueError(
                f"`learning_rate` must be > 0. Received: {self.learning_rate!r}"
            )
        if not self.downpour:
            for name, default in (
                ("n_fetch", 1),
                ("n_push", 1),
                ("local_learning_rate", None),
                ("local_optimizer", "adagrad"),
                ("adagrad_accumulator", "squares"),
                ("warmstart_steps", 0),
                ("max_staleness", None),
            ):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"`{name}` is a Downpour setting: it needs `downpour=True` "
                        f"(--downpour). Received: {name}={getattr(self, name)!r}"
                    )
        if self.downpour:
            self.downpour_config()  # Raises on a bad Downpour setting.
            if self.optimizer == "lbfgs":
                raise ValueError(
                    "`downpour` trains with SGD-type optimizers (adagrad, sgd); "
                    "`optimizer=lbfgs` is Sandblaster. Received both."
                )
        if self.devices_per_replica < 1:
            raise ValueError(
                "`devices_per_replica` must be >= 1. Received: "
                f"{self.devices_per_replica!r}"
            )
        if self.devices_per_replica > 1 and self.model not in MODEL_PARALLEL_MODELS:
            raise ValueError(
                f"`devices_per_replica` > 1 needs a model with a model-parallel "
                f"version ({', '.join(MODEL_PARALLEL_MODELS)}). Received: "
                f"model={self.model!r}"
            )
        for name in ("lbfgs_history", "lbfgs_max_iters", "portions"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"`{name}` must be >= 1. Received: {getattr(self, name)!r}"
                )
        if not self.straggler_slowdown >= 1:
            raise ValueError(
                "`straggler_slowdown` must be >= 1. Received: "
                f"{self.straggler_slowdown!r}"
            )
        for name in ("initial_accumulator_value", "epsilon", "log_every_steps"):
            if getattr(self, name) < 0:
                raise ValueError(
                    f"`{name}` must be >= 0. Received: {getattr(self, name)!r}"
                )
        return self

    def downpour_config(self) -> downpour.DownpourConfig:
        """Returns the `DownpourConfig` of a job with `downpour=True`."""
        return downpour.DownpourConfig(
            n_fetch=self.n_fetch,
            n_push=self.n_push,
            local_learning_rate=self.local_learning_rate,
            warmstart_steps=self.warmstart_steps,
            max_staleness=self.max_staleness,
            local_optimizer=self.local_optimizer,
            adagrad_accumulator=self.adagrad_accumulator,
        )


def make_partitioner(name: str, num_ps: int, shard_bytes: int):
    """Returns the TF partitioner a `JobConfig.partitioner` names."""
    partitioners = tf.distribute.experimental.partitioners
    if name == "min_size":
        return partitioners.MinSizePartitioner(shard_bytes, max_shards=num_ps)
    if name == "max_size":
        return partitioners.MaxSizePartitioner(shard_bytes, max_shards=num_ps)
    if name == "fixed":
        return partitioners.FixedShardsPartitioner(num_ps)
    raise ValueError(
        f"`partitioner` must be one of {', '.join(PARTITIONERS)}. Received: {name!r}"
    )


def load_data(config: JobConfig):
    """Returns `(x_train, y_train), (x_test, y_test)` of `config.model`."""
    if config.model == "speech":
        return models.speech.load_data(
            num_classes=config.speech_classes, seed=config.seed
        )
    return models.MODELS[config.model].load_data(seed=config.seed)


def build_model(config: JobConfig, devices=None) -> tf_keras.Model:
    """Returns the uncompiled tf_keras model `config.model` names.

    Args:
      config: the job.
      devices: with `config.devices_per_replica > 1`, the devices of one replica
        (default: `model_parallel.worker_device_names(k)`: the workers' GPUs
        when each has k, else their `/device:CPU:0..k-1`).
    """
    k = config.devices_per_replica
    if k > 1:
        return models.model_parallel.build_model(
            config.model,
            devices or model_parallel.worker_device_names(k),
            seed=config.seed,
            num_partitions=k,
            speech_hidden_units=config.speech_hidden_units,
            speech_classes=config.speech_classes,
        )
    if config.model == "speech":
        return models.speech.build_model(
            config.speech_hidden_units, config.speech_classes, seed=config.seed
        )
    return models.MODELS[config.model].build_model(seed=config.seed)


def build_optimizer(config: JobConfig) -> tf_keras.optimizers.Optimizer:
    """Returns the ps-side optimizer `config.optimizer` names."""
    if config.optimizer == "adagrad":
        return adagrad.Adagrad(
            config.learning_rate,
            initial_accumulator_value=config.initial_accumulator_value,
            epsilon=config.epsilon,
        )
    return tf_keras.optimizers.SGD(config.learning_rate)


def compile_model(config: JobConfig, strategy) -> tf_keras.Model:
    """Builds and compiles the model under `strategy`'s scope.

    With `config.downpour`, Downpour is enabled on `strategy` first and installed
    on the compiled model; its `Downpour` object is `model.downpour`.
    """
    if config.downpour:
        downpour.enable(strategy)
    with strategy.scope():
        model = build_model(config)
        model.compile(
            optimizer=build_optimizer(config),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=config.steps_per_execution,
        )
        if config.downpour:
            model.downpour = downpour.install(model, config.downpour_config())
    return model


def train(config: JobConfig, cluster_resolver, print_fn=print) -> dict:
    """Trains on the cluster `cluster_resolver` describes, from the chief.

    Args:
      config: a validated `JobConfig`.
      cluster_resolver: the chief's ClusterResolver.
      print_fn: where progress lines go.

    Returns:
      `{"test_accuracy": float, "epochs": int, "initial_epoch": int,
      "history": [...], "train_secs": float}`.
    """
    (x_train, y_train), (x_test, y_test) = load_data(config)
    num_ps = len(cluster_resolver.cluster_spec().as_dict()["ps"])
    strategy = strategy_lib.DistBeliefStrategy(
        cluster_resolver,
        make_partitioner(config.partitioner, num_ps, config.shard_bytes),
    )
    if config.optimizer == "lbfgs":
        return _train_sandblaster(
            config, strategy, (x_train, y_train), (x_test, y_test), print_fn
        )
    model = compile_model(config, strategy)
    callbacks = [downpour.DownpourMetrics(model.downpour)] if config.downpour else []
    start = time.monotonic()
    result = training.fit(
        model,
        training.dataset_creator(x_train, y_train, config.batch_size, config.seed),
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        batch_size=config.batch_size,
        model_dir=config.model_dir,
        log_every_steps=config.log_every_steps,
        callbacks=callbacks,
        print_fn=print_fn,
    )
    train_secs = time.monotonic() - start
    test_accuracy = training.accuracy(model, x_test, y_test)
    if config.downpour:
        for worker, stats in enumerate(model.downpour.stats()):
            print_fn(f"downpour replica {worker}: {stats}")
    print_fn(f"test accuracy: {test_accuracy:.4f}")
    return {
        "test_accuracy": test_accuracy,
        "epochs": result.epochs,
        "initial_epoch": result.initial_epoch,
        "history": result.history,
        "train_secs": train_secs,
    }


def _train_sandblaster(config, strategy, train_data, test_data, print_fn) -> dict:
    """`train` with Sandblaster L-BFGS (section 4.2): full-batch, no epochs."""
    if config.straggler_worker is not None and not (
        0 <= config.straggler_worker < strategy.num_workers
    ):
        raise ValueError(
            f"`straggler_worker` must be in [0, {strategy.num_workers}). Received: "
            f"{config.straggler_worker!r}"
        )
    # Built after the strategy connected, outside its scope: the parameters
    # live in Sandblaster's flat vectors on the ps, not in Keras variables.
    model = build_model(config)
    trainer = sandblaster.SandblasterTrainer(
        strategy,
        model,
        tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        *train_data,
        portions=config.portions,
        history=config.lbfgs_history,
        backup_tasks=config.backup_tasks,
        straggler_worker=config.straggler_worker,
        straggler_slowdown=config.straggler_slowdown,
    )
    start = time.monotonic()
    result = trainer.fit(max_iters=config.lbfgs_max_iters)
    train_secs = time.monotonic() - start
    stats = trainer.stats
    print_fn(
        f"lbfgs: {result.num_iters} iterations, {result.num_evals} evaluations, "
        f"loss {result.loss:.6f} ({result.message}), {train_secs:.1f} s; "
        f"portions {stats.portions_scheduled}, backup copies "
        f"{stats.backup_copies_scheduled}, discarded {stats.copies_discarded}, "
        f"accepted by worker {dict(sorted(stats.accepted_by_worker.items()))}"
    )
    test_accuracy = training.accuracy(model, *test_data)
    print_fn(f"test accuracy: {test_accuracy:.4f}")
    return {
        "test_accuracy": test_accuracy,
        "iterations": result.num_iters,
        "loss": result.loss,
        "train_secs": train_secs,
        "stats": stats,
    }


def evaluate_checkpoints(config: JobConfig, print_fn=print) -> None:
    """The `evaluator` task: test accuracy of each new checkpoint in `model_dir`.

    Uses `tf_keras.utils.SidecarEvaluator`; it stops after the checkpoint of
    `config.epochs` epochs. Training never contacts this task.

    Raises:
      ValueError: `config.model_dir` is not set.
    """
    if not config.model_dir:
        raise ValueError("The `evaluator` task needs `model_dir` (checkpoints).")
    _, (x_test, y_test) = load_data(config)
    # The evaluator has one device: the same partitions (hence the same
    # checkpointed weights) on CPU:0.
    model = build_model(config, devices=["/device:CPU:0"])
    model.compile(
        optimizer=build_optimizer(config),
        loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    data = tf.data.Dataset.from_tensor_slices((x_test, y_test)).batch(512)
    tf_keras.utils.SidecarEvaluator(
        model,
        data,
        checkpoint_dir=f"{config.model_dir}/{training.CHECKPOINT_SUBDIR}",
        max_evaluations=config.epochs,
    ).start()
    print_fn("evaluator: done")


def run(config: JobConfig, print_fn=print) -> dict | None:
    """Runs this process's part of the job; see the module docstring.

    Everything is validated before any server starts.

    Args:
      config: the job.
      print_fn: where progress lines go.

    Returns:
      On the chief, `train`'s result; on other tasks, None.

    Raises:
      ValueError: a bad `config` field or cluster (`ClusterConfigError`).
      ClusterStartError: a local task failed to start.
    """
    config.validate()
    resolver = cluster.resolve_cluster()
    if resolver is None:
        with cluster.LocalCluster(
            config.num_workers,
            config.num_ps,
            cpu_devices_per_worker=config.devices_per_replica,
        ) as local:
            print_fn(
                f"local cluster: {config.num_workers} workers, {config.num_ps} ps "
                f"({', '.join(a for j in ('worker', 'ps') for a in local.jobs[j])})"
            )
            return train(config, local.resolver, print_fn)
    task_type = resolver.task_type
    logging.info("Task %s:%s", task_type, resolver.task_id)
    if task_type in cluster.SERVER_JOBS:
        cluster.run_server(
            resolver,
            cpu_devices=config.devices_per_replica if task_type == "worker" else 1,
            chief_gone_secs=config.chief_gone_secs,
        )
        return None
    if task_type == "evaluator":
        evaluate_checkpoints(config, print_fn)
        return None
    if task_type != "chief":
        raise cluster.ClusterConfigError(
            f"`TF_CONFIG` task type must be chief, worker, ps or evaluator. "
            f"Received: {task_type!r}"
        )
    return train(config, resolver, print_fn)


def main(config: JobConfig) -> None:
    """Runs `run(config)` for a launch script, then ends the process at once.

    TensorFlow's interpreter teardown tries to remove functions from the cluster
    tasks that `run` has already ended, and logs an error per task; ending the
    process after flushing skips that teardown. Errors propagate as usual.

    Args:
      config: the job.
    """
    tf.get_logger().setLevel("WARNING")
    logging.set_verbosity(logging.WARNING)
    run(config)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
