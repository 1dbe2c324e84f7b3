"""What a training job needs to know about a model and its data: `ModelSpec`.

The job (`tf_distbelief.job.runner`) knows no model: the launch command passes
it a spec, either one of the demo models (`tf_distbelief.demos`) or a user's,
named on the command line as `package.module:function` (`load_spec`).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tf_distbelief import checks, errors


def sparse_categorical_crossentropy():
    """The default loss: `SparseCategoricalCrossentropy(from_logits=True)`."""
    import tf_keras

    return tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)


ArrayPair = tuple[np.ndarray, np.ndarray]
_REQUIRED = ("build_model", "loss")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model and its data, as a training job takes them.

    Attributes:
      name: a short name for logs, e.g. `"digits"`.
      build_model: `(devices) -> tf_keras.Model`, uncompiled, called under the
        strategy's scope. `devices` is None for a model on one device, or (with
        `model_parallel`) the device names one replica is split over, e.g.
        `["/device:CPU:0", "/device:CPU:1"]` (Dean et al. 2012, section 3).
      load_data: `() -> ((x_train, y_train), (x_test, y_test))`, NumPy arrays
        with one example per row of `x` (`[num_examples, ...]`) and integer
        class labels `y` (`[num_examples]`). Called on the chief and the
        evaluator only, never on ps or worker tasks. Optional with
        `dataset_fn`.
      loss: `() -> tf_keras loss`, a new loss object per call (default: sparse
        categorical cross-entropy on logits).
      metrics: the metrics `Model.compile` takes (default: accuracy).
      model_parallel: True when `build_model` accepts a list of devices.
      dataset_fn: `(batch_size, seed) -> DatasetCreator`, the training data
        when they are not `load_data`'s arrays, e.g. a
        `tf_distbelief.fit.data.FileInput` (TFRecord or CSV files, each worker
        reading its own). Called on the chief.
      eval_data: `() -> (x_test, y_test)`, the test arrays (default:
        `load_data`'s), e.g. `FileInput(...).read_arrays`.
    """

    name: str
    build_model: Callable[[Sequence[str] | None], Any]
    load_data: Callable[[], tuple[ArrayPair, ArrayPair]] | None = None
    loss: Callable[[], Any] = sparse_categorical_crossentropy
    metrics: tuple = ("accuracy",)
    model_parallel: bool = False
    dataset_fn: Callable[[int, int | None], Any] | None = None
    eval_data: Callable[[], ArrayPair] | None = None

    def __post_init__(self):
        for field in ("build_model", "load_data", "loss", "dataset_fn", "eval_data"):
            value = getattr(self, field)
            if not callable(value) and (value is not None or field in _REQUIRED):
                raise checks.argument_error(f"ModelSpec.{field}", "callable", value)
        if self.load_data is None and self.dataset_fn is None:
            raise ValueError(
                f"ModelSpec {self.name!r} has no training data: give `load_data` "
                "(arrays) or `dataset_fn` (e.g. tf_distbelief.fit.data.FileInput)."
            )

    def test_arrays(self) -> ArrayPair | None:
        """`(x_test, y_test)` from `eval_data` or `load_data`, or None."""
        if self.eval_data is not None:
            return self.eval_data()
        if self.load_data is not None:
            return self.load_data()[1]
        return None


def load_spec(reference: str) -> ModelSpec:
    """Imports the `ModelSpec` a `package.module:function` reference names.

    The module is imported as `python -m` would: from `sys.path` and the
    current working directory. The attribute is a `ModelSpec`, or a function
    of no arguments returning one.

    Args:
      reference: `"package.module:attribute"`, e.g. `"my_models:spec"`.

    Returns:
      The `ModelSpec`.

    Raises:
      ConfigError: `reference` is not of the form `module:attribute`, the module
        cannot be imported, or it has no such attribute.
      TypeError: the attribute is not a `ModelSpec` (or a function returning
        one).
    """
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute.isidentifier():
        raise checks.argument_error(
            "reference",
            "a model spec named `package.module:function` (a function of no "
            "arguments returning a tf_distbelief ModelSpec)",
            reference,
        )
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise errors.ConfigError(
            f"Cannot import module `{module_name}` of model spec {reference!r} "
            f"({e}). It must be importable from the working directory or "
            "PYTHONPATH."
        ) from e
    if not hasattr(module, attribute):
        raise errors.ConfigError(
            f"Module `{module_name}` has no attribute `{attribute}` (model spec "
            f"{reference!r})."
        )
    spec = getattr(module, attribute)
    if not isinstance(spec, ModelSpec) and callable(spec):
        spec = spec()
    if not isinstance(spec, ModelSpec):
        raise checks.argument_error(
            "reference",
            "a tf_distbelief ModelSpec or a function returning one",
            spec,
            fix=f"(model spec {reference!r})",
            shown=type(spec).__name__,
        )
    return spec
