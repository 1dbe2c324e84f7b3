"""The chief's part of a Keras 3 job (`launch/train.py --keras=3`): `TRAINER`.

The job itself is `tf_distbelief.job.runner.run`'s, as for tf_keras (a local
cluster without `TF_CONFIG`; with it, ps/worker tasks serve; the model_dir's
lock and the goodput line), with the same strategy
(`runner.connect_strategy`), the same ps recovery
(`faults.recovery.run_with_ps_recovery`: a lost ps task is recovered from the
last checkpoint in `model_dir`) and the same export folder
(`fit.export.export_keras3_model`: a SavedModel with `serving_default` and
`model.keras`); what differs is the training loop, `tf_distbelief.keras3.fit`
(its checkpoints: `keras3.checkpoints`). Settings that loop does not have are
refused, naming the setting, before any server starts.
"""

from __future__ import annotations

import time

import keras
import numpy as np
import tensorflow as tf

from tf_distbelief import checks, console
from tf_distbelief.faults import goodput, recovery
from tf_distbelief.fit import export
from tf_distbelief.job import runner
from tf_distbelief.job import spec as spec_lib
from tf_distbelief.job.config import JobConfig
from tf_distbelief.keras3 import checkpoints, training
from tf_distbelief.keras3 import optimizer as optimizer_lib

# JobConfig fields the Keras 3 path does not have, with their allowed values
# and why.
_UNSUPPORTED = (
    (
        "optimizer",
        ("adagrad", "sgd"),
        "AdaGrad and SGD on the ps are the Keras 3 path's optimizers",
    ),
)


def check_config(config: JobConfig) -> None:
    """Raises ConfigError naming a `config` setting the Keras 3 path lacks."""
    config.validate()
    for name, allowed, why in _UNSUPPORTED:
        value = getattr(config, name)
        if value not in allowed:
            shown = " or ".join(repr(a) for a in allowed)
            raise checks.argument_error(
                name, f"{shown} with Keras 3 (`--keras=3`): {why}", value, setting=True
            )
    if config.downpour is not None and config.optimizer != "adagrad":
        raise checks.argument_error(
            "optimizer",
            "'adagrad' with Keras 3 and `downpour`: a Keras 3 model's Downpour pushes "
            "to AdaGrad on the ps",
            config.optimizer,
            setting=True,
        )


def _optimizer(config: JobConfig):
    """The ps optimizer of `config.optimizer` (plain SGD as in a tf_keras job)."""
    if config.optimizer == "sgd":
        return optimizer_lib.SGD(config.learning_rate)
    return optimizer_lib.Adagrad(
        config.learning_rate,
        config.initial_accumulator_value,
        config.epsilon,
        config.staleness_power,
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

    A lost ps task is recovered from the last checkpoint in `model_dir`
    (`recovery.run_with_ps_recovery`: each attempt connects a new strategy
    and builds the model anew; `keras3.fit` restores and verifies).

    Args:
      config: a `JobConfig` that passes `check_config`.
      spec: `build_model(None)` returns a built Keras 3 model; `load_data`
        gives the arrays.
      cluster_resolver: the chief's ClusterResolver.
      print_fn: where progress lines go.

    Returns:
      `{"test_accuracy": float, "history": {name: [per epoch]}, "train_secs":
      float, "initial_step": int, "steps": int, "export": ExportPaths or
      None, "ps_recoveries": int}`.

    Raises:
      TypeError: `spec.build_model` did not return a Keras 3 model.
      recovery.PsLostError: a ps task was lost and could not be recovered.
    """
    return recovery.run_with_ps_recovery(
        # `keras3.fit` verifies every restore itself.
        lambda: _train_attempt(config, spec, cluster_resolver, print_fn),
        cluster_resolver.cluster_spec().job_tasks("ps"),
        config.model_dir,
        config.ps_recovery_secs,
        print_fn,
    )


def _steps_per_execution(config: JobConfig) -> int:
    """Steps per scheduled function: the largest divisor of `steps_per_epoch`
    up to `config.steps_per_execution` (`keras3.fit` runs whole functions in
    an epoch; tf_keras runs a shorter last one), 1 for Downpour that does not
    run in segments (`n_fetch` or `n_push` 1, or a warm start)."""
    if config.downpour and not config.downpour.runs_segments:
        return 1
    wanted = min(config.steps_per_execution, config.steps_per_epoch)
    return max(n for n in range(1, wanted + 1) if config.steps_per_epoch % n == 0)


def _train_attempt(config, spec, cluster_resolver, print_fn) -> dict:
    """One attempt of `train`: a new strategy and model, resumed from `model_dir`."""
    strategy = runner.connect_strategy(config, cluster_resolver)
    # Outside the strategy's scope: the model's own variables stay on the
    # chief; `fit` puts their ps copies on the ps. Connected first: a
    # model-parallel model's devices are the workers'.
    model = runner.build_model(config, spec)
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
        steps_per_execution=_steps_per_execution(config),
        loss=_loss(spec),
        optimizer=_optimizer(config),
        downpour=config.downpour,
        verbose=1,
        print_fn=print_fn,
        seed=config.seed,
        model_dir=config.model_dir,
        checkpoint_every_steps=config.checkpoint_every_steps,
        nonfinite=config.nonfinite,
        log_every_steps=config.log_every_steps,
        goodput=goodput.current(),  # The job's accountant (`runner.run`).
    )
    train_secs = time.monotonic() - start
    predictions = model.predict(x_test, batch_size=256, verbose=0)
    test_accuracy = float(np.mean(predictions.argmax(-1) == y_test))
    counters = None if history.downpour is None else history.downpour.stats()
    steps = history.steps - history.initial_step
    for line in runner.closing_lines(counters, history.nonfinite_skipped, steps):
        print_fn(line)
    print_fn(f"test accuracy: {test_accuracy:.4f}")
    written = None
    if config.export_dir:
        # `serving_default` takes the test features' dtype and shape.
        input_spec = tf.TensorSpec([None, *x_test.shape[1:]], tf.as_dtype(x_test.dtype))
        written = export.export_keras3_model(
            _plain_copy(config, spec, model), config.export_dir, input_spec
        )
        print_fn(written.line(config.export_dir))
    return {
        "test_accuracy": test_accuracy,
        "history": history.history,
        "train_secs": train_secs,
        "initial_step": history.initial_step,
        "steps": history.steps,
        "export": written,
    }


def _plain_copy(config: JobConfig, spec: spec_lib.ModelSpec, model):
    """`model` for export: itself, or for a model-parallel model a copy with
    its weights whose partitions all run on `CPU:0`, so that the SavedModel
    and `model.keras` name no device a serving process may lack."""
    if config.devices_per_replica == 1:
        return model
    plain = runner.build_model(
        config, spec, devices=["/device:CPU:0"] * config.devices_per_replica
    )
    plain.set_weights(model.get_weights())
    return plain


def evaluate_checkpoints(
    config: JobConfig, spec: spec_lib.ModelSpec, print_fn=console.echo
) -> dict[int, dict[str, float]]:
    """The `evaluator` task of a Keras 3 job: every checkpoint, in order.

    As a tf_keras job's (`runner.evaluate_checkpoints`): each checkpoint in
    `model_dir` is loaded into the spec's Keras 3 model on this task
    (`keras3.checkpoints.read_weights`), evaluated on the test set, printed
    with its path and written to `model_dir/tensorboard/eval` at its global
    step, up to the checkpoint of `config.epochs` epochs.

    Returns:
      `{step: {metric: value}}`.

    Raises:
      ValueError: `config.model_dir` is not set, or the spec has no test set.
      TimeoutError: no new checkpoint for an hour before the last one.
    """
    test_set = runner.evaluator_test_set(config, spec)
    # The evaluator has one device: the same partitions (hence the same
    # checkpointed weights) on CPU:0.
    model = runner.build_model(
        config, spec, devices=["/device:CPU:0"] * config.devices_per_replica
    )
    model.compile(loss=_loss(spec), metrics=list(spec.metrics))
    return runner.run_evaluator(
        config,
        model,
        test_set,
        print_fn,
        read_checkpoint=lambda path: checkpoints.read_weights(model, path),
    )


def _check(config: JobConfig, spec: spec_lib.ModelSpec) -> None:
    check_config(config)
    # A model-parallel model for `devices_per_replica` > 1; the rest of a
    # Keras 3 spec is checked when its model is built.
    runner.check_spec(config, spec)


TRAINER = runner.Trainer(
    "Keras " + keras.__version__, _check, train, evaluate_checkpoints
)
