"""`checks`: one error type and one message form for a refused argument."""

import numpy as np
import pytest

import tf_distbelief as tfdb
from tf_distbelief import checks, errors


def test_an_argument_error_is_every_error_a_bad_argument_was():
    assert tfdb.ArgumentError is checks.ArgumentError
    for base in (errors.DistBeliefError, errors.ConfigError, ValueError, TypeError):
        assert issubclass(checks.ArgumentError, base), base


def test_the_message_names_the_argument_the_rule_and_the_value():
    error = checks.argument_error("m", ">= 1", 0)
    assert str(error) == "Argument `m` must be >= 1. Received: 0"
    error = checks.argument_error("d", "a directory", "x", fix="Choose another.")
    assert (
        str(error) == "Argument `d` must be a directory. Received: 'x' Choose another."
    )
    error = checks.argument_error("a", "1-D", (2, 2), what="shape")
    assert str(error) == "Argument `a` must be 1-D. Received shape: (2, 2)"
    error = checks.argument_error("s", "finite", np.nan, field="loss")
    assert str(error) == "Field `loss` of `s` must be finite. Received: nan"


def test_a_message_may_name_the_value_by_what_it_is():
    error = checks.argument_error("ps", "a list", 3, prefix="Job")
    assert str(error) == "Job `ps` must be a list. Received: 3"
    error = checks.argument_error(
        "TF_CONFIG", "a dict", 1, setting=True, clause="field `task`"
    )
    assert str(error) == "`TF_CONFIG` field `task` must be a dict. Received: 1"


def test_an_argument_error_may_be_a_subclass_callers_catch_by_name():
    from tf_distbelief.cluster import config as config_lib

    error = checks.argument_error(
        "TF_CONFIG", "a dict", 1, setting=True, error=config_lib.ClusterConfigError
    )
    assert type(error) is config_lib.ClusterConfigError
    assert isinstance(error, checks.ArgumentError)
    with pytest.raises(
        checks.ArgumentError,
        match=r"^Argument `error` must be an `ArgumentError` subclass\. "
        r"Received: <class 'ValueError'>$",
    ):
        checks.argument_error("x", "1", 0, error=ValueError)


@pytest.mark.parametrize(
    "check, args, match",
    [
        (
            checks.check_int,
            ("n", 1.5, 1),
            r"^Argument `n` must be an int\. Received: 1\.5$",
        ),
        (
            checks.check_int,
            ("n", True, 1),
            r"^Argument `n` must be an int\. Received: True$",
        ),
        (
            checks.check_int,
            ("n", 0, 1),
            r"^Argument `n` must be positive\. Received: 0$",
        ),
        (
            checks.check_int,
            ("n", 2.0, 1, None, "an integer"),
            r"^Argument `n` must be an integer\. Received: 2\.0$",
        ),
        (checks.check_nonnegative, ("x", -1), r"must be a number >= 0\. Received: -1$"),
        (
            checks.check_positive_secs,
            ("t", np.inf),
            r"must be a finite number of seconds > 0\. Received: inf$",
        ),
        (
            checks.check_one_of,
            ("k", "c", ("a", "b")),
            r"must be one of a, b\. Received: 'c'$",
        ),
        (
            checks.check_callable,
            ("f", 3),
            r"^Argument `f` must be callable\. Received: 3$",
        ),
        (
            checks.check_callable,
            ("f", 3, True),
            r"^Argument `f` must be callable or None\. Received: 3$",
        ),
        (checks.check_bool, ("b", 1), r"^Argument `b` must be a bool\. Received: 1$"),
        (
            checks.check_instance,
            ("o", "s", int, "an int object", None, lambda v: type(v).__name__),
            r"^Argument `o` must be an int object\. Received: str$",
        ),
    ],
)
def test_each_check_raises_an_argument_error_in_the_house_form(check, args, match):
    with pytest.raises(checks.ArgumentError, match=match):
        check(*args)


def test_a_good_value_passes():
    checks.check_int("n", np.int64(3), 1)
    checks.check_nonnegative("x", 0)
    assert checks.check_positive_secs("t", 2) == 2.0
    checks.check_one_of("k", "a", ("a", "b"))
    checks.check_callable("f", None, allow_none=True)
    checks.check_bool("b", False)
    checks.check_instance("o", 1, int, "an int object")
