"""A push rule is one file: a toy rule defined here, registered for a test.

`ScaledPush` multiplies each pushed gradient by a constant. Registered with
`rule.registered`, it is a `DownpourConfig` keyword argument, `simulate`
applies its NumPy reference, and the trainer on a real cluster applies its
TF update on the ps, matching the reference exactly (as
tests/test_downpour_push_rules.py checks the package's rules); no library
file names it.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.downpour import (
    BATCH_SIZE,
    LEARNING_RATE,
    STEPS,
    _batches,
    _ps_params,
    _softmax_data,
    _softmax_grad,
    _softmax_model,
    _strategy,
)
from tf_distbelief import downpour
from tf_distbelief.downpour import config_fields, schedule
from tf_distbelief.downpour.config import DownpourConfig
from tf_distbelief.downpour.push_rules import rule


class ScaledPush(rule.PushRule):
    """Each pushed gradient times `push_scale` (a float > 0; None: off)."""

    name = "push_scale"
    title = "the scaled push"
    settings = (rule.Setting("push_scale", None, "float", "Pushes times this.", 0.0),)

    def __init__(self, config):
        super().__init__(config)
        self.factor = float(config.push_scale)

    @classmethod
    def is_on(cls, config) -> bool:
        return config.push_scale is not None

    @classmethod
    def check(cls, config) -> None:
        if config.push_scale is not None:
            rule.check_float("push_scale", config.push_scale, "None (off)", "> 0")

    def reference_correct(self, grads, params, fetched, staleness):
        return [g * self.factor for g in grads]

    def correct(self, grad, variable, fetched, staleness):
        return grad * tf.cast(self.factor, variable.dtype)


@pytest.fixture
def scaled_push():
    with rule.registered(ScaledPush) as registered:
        yield registered


# --- The registry ---------------------------------------------------------------


def test_registered_only_inside_the_block():
    builtins = rule.rules()
    with rule.registered(ScaledPush):
        assert rule.rules() == (*builtins, ScaledPush)
        assert "push_scale" in DownpourConfig.setting_names()
        config = DownpourConfig(3, 2, push_scale=0.5, staleness_scaled=True)
        assert config.push_rules == ("staleness_scaled", "push_scale")
        assert config.push_scale == 0.5
        assert DownpourConfig().push_scale is None
        with pytest.raises(ValueError, match=r"`push_scale` must be finite and > 0"):
            DownpourConfig(push_scale=-1.0)
        with pytest.raises(ValueError, match=r"new, distinct names.*push_scale"):
            rule.register(ScaledPush)
    assert rule.rules() == builtins
    with pytest.raises(TypeError, match=r"unexpected keyword arguments: push_scale"):
        DownpourConfig(push_scale=0.5)
    with pytest.raises(ValueError, match=r"is not registered"):
        rule.unregister(ScaledPush)


def test_delay_compensation_refuses_a_registered_rule_pushing_deltas():
    """A rule whose pushes are deltas meets the package's refusal."""

    class DeltaPush(ScaledPush):
        pushes_deltas = True

    with rule.registered(DeltaPush):
        with pytest.raises(
            ValueError,
            match=r"`push_scale` and `delay_compensation` cannot be combined: "
            r"delay compensation corrects a gradient, and with the scaled push",
        ):
            DownpourConfig(push_scale=0.5, delay_compensation=1.0)


def test_register_refuses_a_rule_named_after_no_setting():
    class Unnamed(rule.PushRule):
        name = "unnamed"

    with pytest.raises(ValueError, match=r"`name` must be one of its settings"):
        rule.register(Unnamed)
    with pytest.raises(TypeError, match=r"must be a PushRule subclass"):
        rule.register(object)


def test_register_refuses_a_setting_named_after_a_config_field():
    class Cadence(rule.PushRule):
        name = "n_push"
        settings = (rule.Setting("n_push", None, "int", "Taken.", 1),)

    with pytest.raises(ValueError, match=r"new, distinct names.*taken: n_push"):
        rule.register(Cadence)


def test_the_config_declares_the_fields_the_registry_keeps_free():
    declared = [f.name for f in dataclasses.fields(DownpourConfig)]
    assert declared == [*config_fields.FIELDS, "rule_settings"]


# --- The reference, then the trainer on a cluster against it --------------------


def test_reference_scales_each_push(scaled_push):
    """One replica, a push per step, no local step: SGD with the rate times
    the factor."""
    x, y, params = _softmax_data(seed=0)
    config = DownpourConfig(1, 1, local_learning_rate=0.0, push_scale=0.25)
    got, _ = schedule.simulate(
        params, _softmax_grad, [_batches(x, y)], config, schedule.sgd_ps(0.4)
    )
    want = [p.copy() for p in params]
    for batch in _batches(x, y):
        want = [w - 0.1 * g for w, g in zip(want, _softmax_grad(want, batch))]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_fetch": 3, "n_push": 2},  # AdaGrad's pushed squares, unscaled.
        {
            "n_fetch": 2,
            "n_push": 3,
            "local_optimizer": "sgd",
            "local_learning_rate": 0.05,
            "adagrad_accumulator": "mean",
        },
    ],
    ids=["squares", "sgd_mean"],
)
def test_trainer_matches_reference(local_cluster, scaled_push, kwargs):
    config = DownpourConfig(**kwargs, push_scale=3.0)
    x, y, params = _softmax_data(seed=5)
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)

    def dataset():
        return tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH_SIZE)

    iterator = iter(trainer.per_worker_dataset(dataset))
    for _ in range(STEPS):
        trainer.step(iterator)
    trainer.join()
    want, (want_stats,) = schedule.simulate(
        params,
        _softmax_grad,
        [_batches(x, y)],
        config,
        schedule.adagrad_ps(LEARNING_RATE),
    )
    plain, _ = schedule.simulate(
        params,
        _softmax_grad,
        [_batches(x, y)],
        DownpourConfig(**kwargs),
        schedule.adagrad_ps(LEARNING_RATE),
    )
    for got, w, p in zip(_ps_params(model), want, plain):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
        assert np.abs(w - p).max() > 1e-3  # The rule changed the result.
    (stats,) = trainer.stats()
    assert (stats.fetches, stats.pushes, stats.bytes_pushed) == (
        want_stats.fetches,
        want_stats.pushes,
        want_stats.bytes_pushed,
    )
