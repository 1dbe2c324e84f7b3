"""Exact validation under parameter-server training: `ExactValidation`.

`Model.fit(validation_data=...)` under a ParameterServerStrategy hands the
validation batches to the workers: with a finite dataset it fails with
`CancelledError`, with `validation_steps` it runs but each worker reads its
own copy of the dataset, so `val_loss` is an average over whichever batches the
workers happened to take (about 5e-3 off the exact figure on 96 examples, issue
11), and `ReduceLROnPlateau` or `ModelCheckpoint(save_best_only=True)` act on
noise.

`ExactValidation` evaluates on the coordinator instead, every
`validation_freq` epochs: the model's forward pass reads the current ps values
(sharded variables whole), each validation example is seen exactly once, and
the loss and metrics are tf_keras's own `Model.evaluate` figures (the mean
over examples of the compiled loss, plus the regularization losses, as
tf_keras's `val_loss` has them; the compiled metrics). The figures go into
the epoch's logs as `val_<name>` before any later callback sees them:
`training.fit` places this callback first, so `ReduceLROnPlateau`,
`ModelCheckpoint`, `EarlyStopping`, TensorBoard and `History` read the exact
values.

How: the evaluation runs in a helper thread, because `fit` keeps the
strategy's scope entered on its own thread and a `Model.evaluate` inside it
would again be dispatched to the workers. In that thread there is no strategy:
a twin of the model (the same layers, so the same ps variables; compiled with
the model's loss and fresh copies of its metrics, their variables on the
coordinator) runs tf_keras's `evaluate`. The workers are idle meanwhile (`fit`
has joined them at the epoch end).
"""

from __future__ import annotations

import threading
from collections.abc import Collection

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief import checks, errors

# The compile arguments the twin takes over (not the optimizer: it never trains).
_COMPILE_ARGS = ("metrics", "loss_weights", "weighted_metrics")


# One evaluation's bound: an hour, far above any validation set this job
# evaluates on its coordinator, yet a hang ends with an error naming it.
DEFAULT_TIMEOUT_SECS = 3600.0


class InfiniteValidationDataError(errors.DistBeliefError, ValueError):
    """`validation_data` is an infinite dataset and `validation_steps` is None."""


def _check_freq(validation_freq):
    if checks.is_int(validation_freq):
        ok = validation_freq >= 1
    else:
        ok = isinstance(validation_freq, Collection) and all(
            checks.is_int(e) and e >= 1 for e in validation_freq
        )
    if not ok:
        raise checks.argument_error(
            "validation_freq",
            "an int >= 1 (validate every so many epochs) or a collection of epoch "
            "numbers >= 1 (as `Model.fit`)",
            validation_freq,
        )


def _unpack(validation_data):
    """`(x, y, sample_weight)` from a dataset or a tuple of arrays."""
    if isinstance(validation_data, tf.data.Dataset):
        return validation_data, None, None
    if isinstance(validation_data, (tuple, list)) and len(validation_data) in (2, 3):
        return (*validation_data, None)[:3]
    raise checks.argument_error(
        "validation_data",
        "a finite `tf.data.Dataset` of `(x, y)` or `(x, y, sample_weight)` batches, "
        "or a tuple `(x, y)` / `(x, y, sample_weight)` of arrays",
        type(validation_data),
    )


def _twin(model: tf_keras.Model) -> tf_keras.Model:
    """A model on the same layers (same variables), compiled like `model`,
    built with no strategy (call in a thread with no strategy scope)."""
    if getattr(model, "inputs", None) and getattr(model, "outputs", None):
        twin = tf_keras.Model(model.inputs, model.outputs, name=f"{model.name}_val")
    else:
        twin = _Wrapper(model)
    config = model.get_compile_config() or {}
    try:
        args = tf_keras.saving.deserialize_keras_object(
            {name: config.get(name) for name in _COMPILE_ARGS}
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            "Exact validation compiles a copy of the model's metrics from "
            "`model.get_compile_config()`: register a custom metric with "
            "`tf_keras.saving.register_keras_serializable` for that "
            f"({e})."
        ) from e
    twin.compile(loss=model.loss, **args)
    return twin


class _Wrapper(tf_keras.Model):
    """A subclassed model's twin: calls it, collects its losses."""

    def __init__(self, model):
        super().__init__(name=f"{model.name}_val")
        self.trained = model

    def call(self, inputs, training=False):
        del training  # Validation is always the inference pass.
        return self.trained(inputs, training=False)


class ExactValidation(tf_keras.callbacks.Callback):
    """Adds exact `val_*` figures to the epoch logs, computed on the coordinator.

    Put it first in the callback list (`training.fit` does, for its
    `validation_data`): later callbacks see the figures.

    Args:
      validation_data: a finite `tf.data.Dataset` of batches `(x, y)` or `(x,
        y, sample_weight)`; or a tuple `(x, y)` / `(x, y, sample_weight)` of
        NumPy arrays (`[num_examples, ...]`). Each example counts once.
      validation_freq: validate after every so many epochs (int >= 1), or
        after the epochs (1-based) in a collection, as `Model.fit`.
      validation_steps: batches to evaluate (None: the whole dataset or all
        the arrays). An infinite dataset needs it.
      batch_size: examples per forward pass for arrays (default 32, as
        tf_keras).
      timeout_secs: the longest one evaluation may take, > 0 (a dataset of
        unknown size may never end); then `TimeoutError`.

    Raises:
      InfiniteValidationDataError: an infinite dataset without
        `validation_steps`.
      ValueError: a bad `validation_data`, `validation_freq`,
        `validation_steps` or `timeout_secs`.
    """

    def __init__(
        self,
        validation_data,
        validation_freq: int | Collection[int] = 1,
        validation_steps: int | None = None,
        batch_size: int | None = None,
        timeout_secs: float = DEFAULT_TIMEOUT_SECS,
    ):
        super().__init__()
        self._x, self._y, self._sample_weight = _unpack(validation_data)
        _check_freq(validation_freq)
        checks.check_optional_int(
            "validation_steps",
            validation_steps,
            1,
            "an int >= 1 or None (the whole validation set)",
        )
        if (
            isinstance(self._x, tf.data.Dataset)
            and validation_steps is None
            and self._x.cardinality() == tf.data.INFINITE_CARDINALITY
        ):
            raise InfiniteValidationDataError(
                "Argument `validation_data` is an infinite dataset (it repeats) "
                "and `validation_steps` is None: validation would never end. "
                "Pass the finite dataset (without `.repeat()`), or set "
                "`validation_steps` to the batches to evaluate."
            )
        if not timeout_secs > 0:
            raise checks.argument_error("timeout_secs", "> 0", timeout_secs)
        self.timeout_secs = timeout_secs
        self.validation_freq = validation_freq
        self.validation_steps = validation_steps
        self.batch_size = batch_size
        self._twin = None
        # Workers never read batch logs here: allowed under the coordinator.
        self._supports_tf_logs = True

    def should_validate(self, epoch: int) -> bool:
        """Whether 0-based `epoch` is validated (`Model._should_eval`'s rule)."""
        if isinstance(self.validation_freq, (int, np.integer)):
            return (epoch + 1) % self.validation_freq == 0
        return epoch + 1 in self.validation_freq

    def evaluate(self) -> dict[str, float]:
        """The exact figures now, without the `val_` prefix.

        Returns:
          `{"loss": float, <metric name>: float, ...}`, as tf_keras's
          `Model.evaluate(return_dict=True)`.
        """
        result: dict = {}

        def run():
            try:
                if self._twin is None:
                    self._twin = _twin(self.model)
                result["logs"] = self._twin.evaluate(
                    self._x,
                    self._y,
                    sample_weight=self._sample_weight,
                    batch_size=None if self._y is None else self.batch_size,
                    steps=self.validation_steps,
                    verbose=0,
                    return_dict=True,
                )
            except BaseException as e:  # Re-raised on the caller's thread.
                result["error"] = e

        thread = threading.Thread(target=run, name="tfdb-exact-validation", daemon=True)
        thread.start()
        thread.join(self.timeout_secs)
        if thread.is_alive():
            raise TimeoutError(
                f"Exact validation did not finish within timeout_secs="
                f"{self.timeout_secs}: the validation set is larger than that "
                "allows, or a dataset of unknown size never ends. Raise "
                "`timeout_secs` or set `validation_steps`."
            )
        if "error" in result:
            raise result["error"]
        return {name: float(value) for name, value in result["logs"].items()}

    def on_epoch_end(self, epoch, logs=None):
        if not self.should_validate(epoch):
            return
        values = self.evaluate()
        if logs is not None:
            logs.update({f"val_{name}": value for name, value in values.items()})
