"""Argument checks: the one owner of what counts as an int, a number, seconds.

No TensorFlow. The predicates (`is_int`, `is_number`) are the rules every
module applies (a bool is never an int here, though Python says it is; NumPy
scalars count); the `check_*` functions raise with the house message: the
argument in backticks, the rule, and the value received. A module whose
message says more (why the rule, what to do) applies the predicate and
raises its own.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """True for an int or a NumPy integer, False for a bool or anything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def is_number(value: Any) -> bool:
    """True for an int or float (NumPy scalars too), False for a bool."""
    return is_int(value) or isinstance(value, (float, np.floating))


def check_int(name: str, value: Any, minimum: int, rule: str | None = None) -> None:
    """Raises unless `value` is an int (not a bool) of at least `minimum`.

    Args:
      name: the argument's name, for the message.
      value: the value received.
      minimum: the smallest value allowed.
      rule: the rule as the message states it; None means `"positive"` for a
        `minimum` of 1 and `">= minimum"` otherwise.

    Raises:
      TypeError: `value` is not an int.
      ValueError: `value < minimum`.
    """
    if not is_int(value):
        raise TypeError(f"Argument `{name}` must be an int. Received: {value!r}")
    if value < minimum:
        if rule is None:
            rule = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"Argument `{name}` must be {rule}. Received: {value!r}")


def check_nonnegative(name: str, value: Any) -> None:
    """Raises `ValueError` unless `value` is a number >= 0."""
    if not (is_number(value) and value >= 0):
        raise ValueError(
            f"Argument `{name}` must be a number >= 0. Received: {value!r}"
        )


def check_positive_secs(name: str, value: Any) -> float:
    """Returns `value` as a float.

    Raises:
      ValueError: `value` is not a finite number of seconds > 0 (the message
        names argument `name`).
    """
    if not (is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(
            f"Argument `{name}` must be a finite number of seconds > 0. "
            f"Received: {value!r}"
        )
    return float(value)


def check_checkpoint_cadence(model_dir: Any, checkpoint_every_steps: Any) -> None:
    """Checks `fit`'s `checkpoint_every_steps` against its `model_dir`.

    Raises:
      ValueError: `checkpoint_every_steps` is not an int >= 0 (0: checkpoints
        at epoch ends only), or is > 0 without a `model_dir`.
    """
    if not is_int(checkpoint_every_steps) or checkpoint_every_steps < 0:
        raise ValueError(
            "Argument `checkpoint_every_steps` must be an int >= 0 (0: at "
            f"epoch ends only). Received: {checkpoint_every_steps!r}"
        )
    if checkpoint_every_steps and not model_dir:
        raise ValueError(
            "Argument `checkpoint_every_steps` needs `model_dir` (where the "
            f"checkpoints go). Received: {checkpoint_every_steps!r} and "
            "model_dir=None"
        )
