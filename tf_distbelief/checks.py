"""Argument checks: the one owner of what counts as an int, a number, seconds,
and of the error and message for an argument refused.

No TensorFlow. The predicates (`is_int`, `is_number`) are the rules every
module applies (a bool is never an int here, though Python says it is; NumPy
scalars count). Every refused argument is an `ArgumentError` with one message
form, "Argument `name` must be <rule>. Received: <value!r>", optionally
followed by why or what to do: the `check_*` functions apply a common rule,
and `argument_error` builds the error for a rule only its module states.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from tf_distbelief import errors


class ArgumentError(errors.ConfigError, TypeError):
    """An argument (or a setting passed as one) is refused.

    The message names the argument in backticks, states the rule, echoes the
    value received and may say what to do. A `ConfigError`, so that the launch
    script prints it as one line, and so a `ValueError`; also a `TypeError`,
    so that code that caught either for a value of the wrong type or out of
    range still catches it.
    """


def argument_error(
    name: str,
    rule: str,
    value: Any,
    fix: str | None = None,
    shown: str | None = None,
    what: str | None = None,
    field: str | None = None,
    setting: bool = False,
    described: str | None = None,
    prefix: str | None = None,
    clause: str | None = None,
    error: type[ArgumentError] = ArgumentError,
) -> ArgumentError:
    """Returns the `ArgumentError` for argument `name`, to raise.

    Args:
      name: the argument's name (a field: `config.field`).
      rule: what the argument must be, completing "must be ...".
      value: the value received, shown by its repr.
      fix: a sentence or more after the message: why the rule, what to do.
      shown: what to show instead of the repr (a type name, for a value whose
        repr is long or unreadable).
      what: what of the value is shown, when not the value itself
        ("Received shape: (2, 3)").
      field: the field of argument `name` refused, if the rule is a field's.
      setting: `name` is a job setting, a `JobConfig` field and the launch
        script's flag at once, and the message names it as both spell it
        ("`name` must be ...", printed as one line by the launch script).
      described: what was received, in words, where neither the value nor a
        part of it reads well alone ("Received blocks that make up ...").
      prefix: the words before the backticked name in place of "Argument",
        for a value named by what it is rather than as an argument ("Job",
        "Task index of").
      clause: words between the name and "must be": the part of it the rule
        is for ("field `task`"), or what it is, ending in "and" ("is where
        `pvc` is mounted and").
      error: the class of the error, an `ArgumentError` subclass that callers
        catch by name (e.g. `ClusterConfigError` for a `TF_CONFIG`).

    Returns:
      "Argument `name` must be <rule>. Received[ <what>]: <value!r>[ <fix>]",
      "Field `field` of `name` must be ..." for a field, "`name` must be
      ..." for a setting, or "<prefix> `name` must be ..." with a prefix.

    Raises:
      ArgumentError: `error` is not an `ArgumentError` subclass.
    """
    if not (isinstance(error, type) and issubclass(error, ArgumentError)):
        raise argument_error("error", "an `ArgumentError` subclass", error)
    received = repr(value) if shown is None else shown
    noun = f" {what}" if what else ""
    received = f"{noun}: {received}" if described is None else f" {described}"
    if field is not None:
        subject = f"Field `{field}` of `{name}`"
    elif prefix is not None:
        subject = f"{prefix} `{name}`"
    else:
        subject = f"`{name}`" if setting else f"Argument `{name}`"
    if clause:
        subject = f"{subject} {clause}"
    message = f"{subject} must be {rule}. Received{received}"
    return error(f"{message} {fix}" if fix else message)


def is_int(value: Any) -> bool:
    """True for an int or a NumPy integer, False for a bool or anything else."""
    return isinstance(value, (int, np.integer)) and not isinstance(
        value, (bool, np.bool_)
    )


def is_number(value: Any) -> bool:
    """True for an int or float (NumPy scalars too), False for a bool."""
    return is_int(value) or isinstance(value, (float, np.floating))


def check_int(
    name: str,
    value: Any,
    minimum: int,
    rule: str | None = None,
    type_rule: str = "an int",
) -> None:
    """Raises unless `value` is an int (not a bool) of at least `minimum`.

    Args:
      name: the argument's name, for the message.
      value: the value received.
      minimum: the smallest value allowed.
      rule: the rule as the message states it; None means `"positive"` for a
        `minimum` of 1 and `">= minimum"` otherwise.
      type_rule: the rule a value that is not an int breaks, as the message
        states it (`"an integer"`, `"an int >= 1"`).

    Raises:
      ArgumentError: `value` is not an int, or `value < minimum`.
    """
    if not is_int(value):
        raise argument_error(name, type_rule, value)
    if value < minimum:
        if rule is None:
            rule = "positive" if minimum == 1 else f">= {minimum}"
        raise argument_error(name, rule, value)


def check_optional_int(name: str, value: Any, minimum: int, rule: str) -> None:
    """Raises `ArgumentError` unless `value` is None or an int >= `minimum`.

    Args:
      name: the argument's name, for the message.
      value: the value received.
      minimum: the smallest int allowed.
      rule: the rule as the message states it, None's meaning included.
    """
    if value is not None and (not is_int(value) or value < minimum):
        raise argument_error(name, rule, value)


def check_nonnegative(name: str, value: Any) -> None:
    """Raises `ArgumentError` unless `value` is a number >= 0."""
    if not (is_number(value) and value >= 0):
        raise argument_error(name, "a number >= 0", value)


def check_positive_secs(name: str, value: Any) -> float:
    """Returns `value` as a float.

    Raises:
      ArgumentError: `value` is not a finite number of seconds > 0.
    """
    if not (is_number(value) and math.isfinite(value) and value > 0):
        raise argument_error(name, "a finite number of seconds > 0", value)
    return float(value)


def check_one_of(
    name: str, value: Any, allowed: Iterable[Any], fix: str | None = None
) -> None:
    """Raises `ArgumentError` unless `value` is one of `allowed`.

    The rule reads "one of a, b, c" (each allowed value as `str` shows it).
    """
    allowed = list(allowed)
    if value not in allowed:
        raise argument_error(
            name, f"one of {', '.join(str(a) for a in allowed)}", value, fix
        )


def check_callable(
    name: str, value: Any, allow_none: bool = False, fix: str | None = None
) -> None:
    """Raises `ArgumentError` unless `value` is callable (or None, if allowed)."""
    if not (callable(value) or (allow_none and value is None)):
        raise argument_error(
            name, "callable or None" if allow_none else "callable", value, fix
        )


def check_bool(name: str, value: Any) -> None:
    """Raises `ArgumentError` unless `value` is a Python bool."""
    if not isinstance(value, bool):
        raise argument_error(name, "a bool", value)


def check_instance(
    name: str,
    value: Any,
    types: type | tuple[type, ...],
    what: str,
    fix: str | None = None,
    shown: Callable[[Any], str] | None = None,
) -> None:
    """Raises `ArgumentError` unless `value` is an instance of `types`.

    Args:
      name: the argument's name.
      value: the value received.
      types: what `isinstance` accepts.
      what: the rule as the message states it ("a `VectorOps`").
      fix: why, or what to do.
      shown: maps the value to what the message shows (e.g. its type's name).
    """
    if not isinstance(value, types):
        raise argument_error(
            name, what, value, fix, None if shown is None else shown(value)
        )


def check_checkpoint_cadence(model_dir: Any, checkpoint_every_steps: Any) -> None:
    """Checks `fit`'s `checkpoint_every_steps` against its `model_dir`.

    Raises:
      ArgumentError: `checkpoint_every_steps` is not an int >= 0 (0:
        checkpoints at epoch ends only), or is > 0 without a `model_dir`.
    """
    if not is_int(checkpoint_every_steps) or checkpoint_every_steps < 0:
        raise argument_error(
            "checkpoint_every_steps",
            "an int >= 0 (0: at epoch ends only)",
            checkpoint_every_steps,
        )
    if checkpoint_every_steps and not model_dir:
        raise ArgumentError(
            "Argument `checkpoint_every_steps` needs `model_dir` (where the "
            f"checkpoints go). Received: {checkpoint_every_steps!r} and "
            "model_dir=None"
        )
