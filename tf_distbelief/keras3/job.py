"""The training job for a Keras 3 model (`launch/train.py --keras=3`).

The same cluster handling as `tf_distbelief.job.runner.run` (a local cluster
without `TF_CONFIG`; with it, ps/worker tasks serve and the chief trains), with
`tf_distbelief.keras3.fit` as the training loop. Settings that path does not
have yet are refused, naming the setting, before any server starts.
"""

from __future__ import annotations

import os
import time

import keras
import numpy as np
from absl import logging

from tf_distbelief import cluster, console, errors, paths
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.cluster import config as cluster_config
from tf_distbelief.job import spec as spec_lib
from tf_distbelief.job.config import JobConfig
from tf_distbelief.keras3 import optimizer as optimizer_lib
from tf_distbelief.keras3 import training

# JobConfig fields the Keras 3 path does not have, with their only allowed
# value and why.
_UNSUPPORTED = (
    ("optimizer", "adagrad", "AdaGrad on the ps is the Keras 3 path's optimizer"),
    ("model_dir", None, "the Keras 3 path writes no checkpoints"),
    ("checkpoint_every_steps", 0, "the Keras 3 path writes no checkpoints"),
    ("devices_per_replica", 1, "no model-parallel Keras 3 layers"),
    ("nonfinite", "raise", "a non-finite gradient stops the job"),
)


def check_config(config: JobConfig) -> None:
    """Raises ConfigError naming a `config` setting the Keras 3 path lacks."""
    config.validate()
    for name, allowed, why in _UNSUPPORTED:
        value = getattr(config, name)
        if value != allowed:
            raise errors.ConfigError(
                f"`{name}` must be {allowed!r} with Keras 3 (`--keras=3`): {why}. "
                f"Received: {value!r}"
            )


def _loss(spec: spec_lib.ModelSpec):
    if spec.loss is spec_lib.sparse_categorical_crossentropy:
        return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    loss = spec.loss()
    if type(loss).__module__.startswith("tf_keras"):
        raise ValueError(
            f"Model spec {spec.name!r}: `loss` must give a Keras 3 loss with "
            f"`--keras=3`. Received: {loss!r}"
        )
    return loss


def train(
    config: JobConfig, spec: spec_lib.ModelSpec, cluster_resolver, print_fn=console.echo
) -> dict:
    """Trains `spec`'s Keras 3 model on the cluster, from the chief.

    Args:
      config: a `JobConfig` that passes `check_config`.
      spec: `build_model(None)` returns a built Keras 3 model; `load_data`
        gives the arrays.
      cluster_resolver: the chief's ClusterResolver.
      print_fn: where progress lines go.

    Returns:
      `{"test_accuracy": float, "history": {name: [per epoch]}, "train_secs":
      float, "keras_file": str or None}`.

    Raises:
      TypeError: `spec.build_model` did not return a Keras 3 model.
    """
    num_ps = len(cluster_resolver.cluster_spec().as_dict()["ps"])
    strategy = strategy_lib.DistBeliefStrategy(
        cluster_resolver,
        strategy_lib.make_partitioner(config.partitioner, num_ps, config.shard_bytes),
        connect_timeout_secs=config.connect_timeout_secs,
        step_stall_timeout_secs=config.step_stall_timeout_secs,
    )
    # Outside the strategy's scope: the model's own variables stay on the
    # chief; `fit` puts their ps copies on the ps.
    model = spec.build_model(None)
    (x_train, y_train), (x_test, y_test) = spec.load_data()
    start = time.monotonic()
    history = training.fit(
        model,
        x_train,
        y_train,
        strategy=strategy,
        batch_size=config.batch_size,
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        # Downpour runs one local step per scheduled function (`keras3.fit`).
        steps_per_execution=1 if config.downpour else config.steps_per_execution,
        loss=_loss(spec),
        optimizer=optimizer_lib.Adagrad(
            config.learning_rate, config.initial_accumulator_value, config.epsilon
        ),
        downpour=config.downpour,
        verbose=1,
        print_fn=print_fn,
        seed=config.seed,
    )
    train_secs = time.monotonic() - start
    predictions = model.predict(x_test, batch_size=256, verbose=0)
    test_accuracy = float(np.mean(predictions.argmax(-1) == y_test))
    if history.downpour is not None:
        for worker, stats in enumerate(history.downpour.stats()):
            print_fn(f"downpour replica {worker}: {stats}")
    print_fn(f"test accuracy: {test_accuracy:.4f}")
    keras_file = None
    if config.export_dir:
        os.makedirs(config.export_dir, exist_ok=True)
        keras_file = os.path.join(config.export_dir, paths.KERAS_FILE)
        # Written whole, then renamed: an earlier export is replaced, never torn.
        partial = os.path.join(config.export_dir, f".partial.{os.getpid()}.keras")
        model.save(partial)
        os.replace(partial, keras_file)
        print_fn(f"exported: {keras_file}")
    return {
        "test_accuracy": test_accuracy,
        "history": history.history,
        "train_secs": train_secs,
        "keras_file": keras_file,
    }


def run(config: JobConfig, spec: spec_lib.ModelSpec, print_fn=console.echo):
    """This process's part of a Keras 3 job (`tf_distbelief.job.run`'s roles).

    Args:
      config: the job; checked by `check_config` before any server starts.
      spec: the model (Keras 3) and its data.
      print_fn: where progress lines go.

    Returns:
      On the chief, `train`'s result; on ps and worker tasks, None.

    Raises:
      ValueError: a setting the Keras 3 path lacks, or a bad cluster.
    """
    check_config(config)
    resolver = cluster.resolve_cluster()
    if resolver is None:
        with cluster.LocalCluster(
            config.num_workers, config.num_ps, gpus_per_worker=config.gpus_per_worker
        ) as local:
            print_fn(
                f"local cluster: {config.num_workers} workers, {config.num_ps} ps "
                f"(Keras {keras.__version__})"
            )
            return train(config, spec, local.resolver, print_fn)
    logging.info("Task %s:%s", resolver.task_type, resolver.task_id)
    if resolver.task_type in cluster.SERVER_JOBS:
        cluster.run_server(resolver, chief_gone_secs=config.chief_gone_secs)
        return None
    if resolver.task_type != "chief":
        raise cluster_config.ClusterConfigError(
            f"`TF_CONFIG` task type must be chief, worker or ps with Keras 3. "
            f"Received: {resolver.task_type!r}"
        )
    return train(config, spec, resolver, print_fn)
