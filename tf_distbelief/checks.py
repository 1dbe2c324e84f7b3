"""Argument checks shared by the pure Sandblaster modules (no TensorFlow).

Each error names the argument in backticks, states the rule and echoes the
value received (STYLE.md, habit 5).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np


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
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"Argument `{name}` must be an int. Received: {value!r}")
    if value < minimum:
        if rule is None:
            rule = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"Argument `{name}` must be {rule}. Received: {value!r}")


def check_nonnegative(name: str, value: Any) -> None:
    """Raises `ValueError` unless `value` is a number >= 0."""
    if not (isinstance(value, (int, float, np.floating)) and value >= 0):
        raise ValueError(
            f"Argument `{name}` must be a number >= 0. Received: {value!r}"
        )


def check_positive_secs(name: str, value: Any) -> None:
    """Raises `ValueError` unless `value` is a finite number of seconds > 0."""
    if not (
        isinstance(value, (int, float, np.integer, np.floating))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        raise ValueError(
            f"Argument `{name}` must be a finite number of seconds > 0. "
            f"Received: {value!r}"
        )


def check_wolfe_constants(c1: float, c2: float) -> None:
    """Raises `ValueError` unless `0 < c1 < c2 < 1` (strong Wolfe conditions)."""
    if not 0.0 < c1 < c2 < 1.0:
        raise ValueError(
            "Arguments `c1` and `c2` must satisfy 0 < c1 < c2 < 1 (Nocedal & Wright "
            f"use c1=1e-4, c2=0.9). Received: c1={c1!r}, c2={c2!r}"
        )
