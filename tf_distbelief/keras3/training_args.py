"""The arguments of `keras3.fit`: their record (`FitArgs`) and their checks.

Every check runs before anything is created on the cluster, so that a bad
argument costs nothing; the record then travels through the run's setup
(`training_setup`) and its epochs (`training_loop`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from tf_distbelief import checks
from tf_distbelief.faults import settings
from tf_distbelief.keras3 import optimizer as optimizer_lib


@dataclasses.dataclass(frozen=True)
class FitArgs:
    """What `keras3.fit` was asked to do, checked (see its Args)."""

    x: Any
    y: Any
    dataset: Any
    batch_size: int
    epochs: int
    steps_per_epoch: int
    steps_per_execution: int
    validation_data: Any
    initial_epoch: int
    verbose: int
    print_fn: Callable[[str], None]
    seed: int | None
    model_dir: str | None
    checkpoint_every_steps: int
    nonfinite: str
    log_every_steps: int

    @property
    def total_steps(self) -> int:
        """The global step training ends at."""
        return self.epochs * self.steps_per_epoch


def check(model, args: FitArgs) -> None:
    """Raises on the first argument of `args` (or `model`) that is wrong.

    Raises:
      TypeError: `model` is not a Keras 3 model.
      ValueError: naming the argument, the rule and the value.
    """
    _check_arguments(
        model,
        args.x,
        args.y,
        args.dataset,
        args.epochs,
        args.steps_per_epoch,
        args.batch_size,
    )
    checks.check_checkpoint_cadence(args.model_dir, args.checkpoint_every_steps)
    settings.check_nonfinite_mode(args.nonfinite)
    _check_validation_data(args.validation_data)
    if not checks.is_int(args.initial_epoch) or args.initial_epoch < 0:
        raise checks.argument_error("initial_epoch", "an int >= 0", args.initial_epoch)
    if not checks.is_int(args.log_every_steps) or args.log_every_steps < 0:
        raise checks.argument_error(
            "log_every_steps", "an int >= 0", args.log_every_steps
        )
    per_execution = args.steps_per_execution
    if (
        not checks.is_int(per_execution)
        or per_execution < 1
        or args.steps_per_epoch % per_execution
    ):
        raise checks.argument_error(
            "steps_per_execution",
            f"an int >= 1 that divides `steps_per_epoch` ({args.steps_per_epoch})",
            per_execution,
        )


def _check_arguments(model, x, y, dataset, epochs, steps_per_epoch, batch_size):
    if not isinstance(model, keras.Model):
        raise checks.argument_error(
            "model",
            "a Keras 3 `keras.Model` (tf_keras models train with "
            "`tf_distbelief.fit.training.fit`)",
            type(model),
        )
    for name, value in (
        ("epochs", epochs),
        ("steps_per_epoch", steps_per_epoch),
        ("batch_size", batch_size),
    ):
        checks.check_int(name, value, 1, "an int >= 1", "an int >= 1")
    if (dataset is None) == (x is None):
        raise ValueError(
            "Pass either `x` and `y` (NumPy arrays) or `dataset` (a batched "
            "`tf.data.Dataset` of `(x, y)`). Received: "
            f"x={'set' if x is not None else None}, dataset={dataset!r}"
        )
    if x is not None and (y is None or len(x) != len(y)):
        raise ValueError(
            "Arguments `x` and `y` must have one label per example. Received: "
            f"{len(x)} examples and {None if y is None else len(y)} labels"
        )


def _check_validation_data(validation_data) -> None:
    if validation_data is None:
        return
    ok = isinstance(validation_data, (tuple, list)) and len(validation_data) == 2
    if ok:
        x_val, y_val = validation_data
        ok = len(x_val) == len(y_val) and len(x_val) > 0
    if not ok:
        shown = (
            f"{len(validation_data)} items"
            if isinstance(validation_data, (tuple, list))
            else repr(type(validation_data))
        )
        if isinstance(validation_data, (tuple, list)) and len(validation_data) == 2:
            shown = (
                f"{len(validation_data[0])} examples, {len(validation_data[1])} labels"
            )
        raise checks.argument_error(
            "validation_data",
            "`(x_val, y_val)`: two arrays with one label per example, at least one",
            validation_data,
            shown=shown,
        )


def loss_function(model, loss):
    """The loss to train with: `loss`, else the one `model` was compiled with.

    Raises:
      ValueError: neither is given.
    """
    loss = loss if loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise checks.argument_error(
            "loss",
            "a Keras 3 loss, its name or a function, or the model compiled with one",
            None,
        )
    return keras.losses.get(loss) if isinstance(loss, str) else loss


def metric(value, y) -> keras.metrics.Metric:
    """A Keras 3 `Metric` for `value` (a Metric, a name or a function)."""
    if isinstance(value, keras.metrics.Metric):
        return value
    if value in ("accuracy", "acc"):
        # As Keras 3's `compile` resolves it for integer class labels.
        if y is not None and np.issubdtype(np.asarray(y).dtype, np.integer):
            return keras.metrics.SparseCategoricalAccuracy(name="accuracy")
        return keras.metrics.CategoricalAccuracy(name="accuracy")
    fn = keras.metrics.get(value)
    if isinstance(fn, keras.metrics.Metric):
        return fn
    name = value if isinstance(value, str) else getattr(fn, "__name__", "metric")
    return keras.metrics.MeanMetricWrapper(fn, name=name)


def check_downpour(model, rule, optimizer, ps_weights, downpour, steps_per_execution):
    """Raises when Downpour (`downpour`, a `DownpourConfig`) cannot train `model`.

    Raises:
      ValueError: naming the argument, the rule and the value.
    """
    if model.non_trainable_variables or ps_weights:
        raise ValueError(
            "Argument `downpour` needs a model without non-trainable "
            "weights and no `ps_weights`. Received: non-trainable "
            f"{[v.path for v in model.non_trainable_variables]}, "
            f"ps_weights={ps_weights!r}"
        )
    if not isinstance(rule, optimizer_lib.Adagrad):
        raise checks.argument_error(
            "optimizer",
            "AdaGrad with `downpour`: a Keras 3 model's Downpour pushes to "
            "AdaGrad on the ps",
            optimizer,
        )
    if steps_per_execution > 1 and not downpour.runs_segments:
        raise checks.argument_error(
            "steps_per_execution",
            "1 with Downpour unless it runs in segments (n_fetch > 1, "
            "n_push > 1, no warm start)",
            steps_per_execution,
            fix=f"({downpour})",
        )
