"""Downpour's push rules (issue 14): outer Nesterov, delay compensation, staleness.

The NumPy reference (`schedule.simulate`) against computations written out
here, then the trainer on a real cluster against the reference, exactly: one
worker, and two workers whose steps are run one at a time with the order
they ran in read back from their step counters.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures import launch
from tests.fixtures.downpour import (
    STEPS,
    _batches,
    _dataset,
    _ps_params,
    _reference,
    _softmax_data,
    _softmax_grad,
    _softmax_model,
    _steps_one_at_a_time,
    _strategy,
)
from tf_distbelief import adagrad, downpour
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import schedule as downpour_schedule
from tf_distbelief.downpour.push_rules import outer_nesterov as push_rules
from tf_distbelief.fit import training

Config = downpour_config.DownpourConfig


# --- Pure: config errors, the reference ---------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"outer_learning_rate": 0.0, "n_fetch": 2, "n_push": 2},
            ValueError,
            r"`outer_learning_rate` must be finite and > 0.*Received: 0.0",
        ),
        (
            {"outer_learning_rate": "0.7"},
            TypeError,
            r"`outer_learning_rate` must be a float.*'0.7'",
        ),
        (
            {"outer_learning_rate": 0.7},
            ValueError,
            r"needs `n_fetch` and `n_push` >= 2.*n_fetch=1, n_push=1",
        ),
        (
            {"outer_learning_rate": 0.7, "n_fetch": 4, "n_push": 4},
            None,
            None,
        ),
        (
            {
                "outer_learning_rate": 0.7,
                "n_fetch": 4,
                "n_push": 4,
                "local_learning_rate": 0.0,
            },
            ValueError,
            r"needs a local step.*local_learning_rate=0",
        ),
        (
            {
                "outer_learning_rate": 0.7,
                "n_fetch": 4,
                "n_push": 4,
                "delay_compensation": 0.5,
            },
            ValueError,
            r"`outer_learning_rate` and `delay_compensation` cannot be combined",
        ),
        ({"outer_momentum": 1.0}, ValueError, r"`outer_momentum` must be in \[0, 1\)"),
        ({"outer_momentum": float("nan")}, ValueError, r"`outer_momentum`.*nan"),
        (
            {"delay_compensation": -0.1},
            ValueError,
            r"`delay_compensation` must be finite and >= 0.*-0.1",
        ),
        ({"staleness_scaled": 1}, TypeError, r"`staleness_scaled` must be a bool"),
        (
            {"stale_damping": -1.0},
            ValueError,
            r"`stale_damping` must be finite and >= 0.*Received: -1.0",
        ),
        ({"stale_damping": "1"}, TypeError, r"`stale_damping` must be a float.*'1'"),
        (
            {"stale_damping": 1.0, "n_fetch": 4, "n_push": 4},
            ValueError,
            r"`stale_damping` needs `outer_learning_rate` set: the stale-push "
            r"damping reads its ps state. Received: stale_damping=1.0, "
            r"outer_learning_rate=None",
        ),
    ],
)
def test_config_errors(kwargs, error, match):
    if error is None:  # The outer rule, its momentum damped by default.
        assert Config(**kwargs).push_rules == ("outer_learning_rate", "stale_damping")
        return
    with pytest.raises(error, match=match):
        Config(**kwargs)


def test_push_rules_default_off():
    config = Config()
    assert config.push_rules == ()
    assert (config.outer_learning_rate, config.delay_compensation) == (None, 0.0)
    assert not config.staleness_scaled
    assert config.stale_damping is None
    damped = Config(3, 3, outer_learning_rate=0.7, stale_damping=1.0)
    assert damped.push_rules == ("outer_learning_rate", "stale_damping")
    # Unset: on with the outer rule's momentum (lambda 1), off without it.
    default = Config(3, 3, outer_learning_rate=0.7)
    assert default.push_rules == ("outer_learning_rate", "stale_damping")
    assert default.rules[1].lam == 1.0
    no_momentum = Config(3, 3, outer_learning_rate=0.7, outer_momentum=0.0)
    assert no_momentum.push_rules == ("outer_learning_rate",)
    off = Config(3, 3, outer_learning_rate=0.7, stale_damping=0.0)
    assert off.push_rules == ("outer_learning_rate",)
    both = Config(3, 2, delay_compensation=0.5, staleness_scaled=True)
    assert both.push_rules == ("delay_compensation", "staleness_scaled")


def test_outer_nesterov_is_keras_sgd_nesterov():
    """The reference's update equals tf_keras `SGD(nesterov=True)`'s (rates
    exact in float32, as tf_keras keeps them)."""
    rng = np.random.default_rng(0)
    w0, deltas = rng.normal(size=5), [rng.normal(size=5) for _ in range(4)]
    variable = tf.Variable(w0)
    sgd = tf_keras.optimizers.SGD(0.5, momentum=0.75, nesterov=True)
    params, momentums = [w0], [np.zeros(5)]
    for d in deltas:
        sgd.apply_gradients([(tf.constant(d), variable)])
        params, momentums = push_rules.nesterov(params, momentums, [d], 0.5, 0.75)
    np.testing.assert_allclose(params[0], variable.numpy(), rtol=0, atol=1e-12)


def test_reference_outer_sgd_lr_1_no_momentum_is_local_training():
    """With one replica, eta = 1 and mu = 0 the ps takes the cache's value at
    each push: plain SGD, one batch at a time."""
    x, y, params = _softmax_data()
    config = Config(
        4,
        4,
        local_learning_rate=0.3,
        local_optimizer="sgd",
        outer_learning_rate=1.0,
        outer_momentum=0.0,
    )
    got, _ = downpour_schedule.simulate(
        params, _softmax_grad, [_batches(x, y)], config, downpour_schedule.sgd_ps(9.0)
    )
    want = [p.copy() for p in params]
    for batch in _batches(x, y):
        want = [w - 0.3 * g for w, g in zip(want, _softmax_grad(want, batch))]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)


def _sgd_with_delay_compensation(params, batches, lam, n_fetch):
    """One replica, `n_push = 1`, no local step: SGD on the ps with DC-ASGD's
    correction toward the values fetched, written out."""
    ps = [p.copy() for p in params]
    for t, batch in enumerate(batches):
        if t % n_fetch == 0:
            fetched = [p.copy() for p in ps]
        g = _softmax_grad(fetched, batch)
        g = [gi + lam * gi * gi * (w - f) for gi, w, f in zip(g, ps, fetched)]
        ps = [w - 0.1 * gi for w, gi in zip(ps, g)]
    return ps


def test_reference_delay_compensation():
    x, y, params = _softmax_data()
    config = Config(3, 1, local_learning_rate=0.0, delay_compensation=5.0)
    got, _ = downpour_schedule.simulate(
        params, _softmax_grad, [_batches(x, y)], config, downpour_schedule.sgd_ps(0.1)
    )
    want = _sgd_with_delay_compensation(params, _batches(x, y), 5.0, 3)
    plain = _sgd_with_delay_compensation(params, _batches(x, y), 0.0, 3)
    for g, w, p in zip(got, want, plain):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
        assert np.abs(w - p).max() > 1e-6  # The correction is not nothing.


def test_reference_staleness_scaled_divides_the_step():
    """Three replicas in turn, `n_fetch = n_push = 3`, no local step: all fetch
    the initial values, then push with staleness 0, 1 and 2; the SGD step of
    the last push is halved."""
    x, y, params = _softmax_data()
    thirds = [_batches(x, y)[i::3] for i in range(3)]
    config = Config(3, 3, local_learning_rate=0.0, staleness_scaled=True)
    got, stats = downpour_schedule.simulate(
        params, _softmax_grad, thirds, config, downpour_schedule.sgd_ps(0.1)
    )
    want = [p.copy() for p in params]
    for r, scale in enumerate([1.0, 1.0, 0.5]):
        for batch in thirds[r][:3]:
            g = _softmax_grad(params, batch)
            want = [w - 0.1 * scale * gi for w, gi in zip(want, g)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    assert [s.max_staleness_seen for s in stats] == [0, 1, 2]


def test_reference_stale_damping_written_out():
    """Three replicas in turn, `n_fetch = n_push = 3`, SGD inner steps: all
    fetch the initial values, then push with staleness 0, 1 and 2. Before the
    outer step, the entries of a push whose step goes the way of the outer
    momentum are divided by `1 + lambda * s`."""
    x, y, params = _softmax_data()
    thirds = [_batches(x, y)[i::3] for i in range(3)]
    lr, eta, mu, lam = 0.2, 0.7, 0.9, 2.0
    outer = dict(
        local_learning_rate=lr,
        local_optimizer="sgd",
        outer_learning_rate=eta,
        outer_momentum=mu,
    )
    config = Config(3, 3, stale_damping=lam, **outer)
    got, stats = downpour_schedule.simulate(
        params, _softmax_grad, thirds, config, downpour_schedule.sgd_ps(9.0)
    )
    want, m = [p.copy() for p in params], [np.zeros_like(p) for p in params]
    damped = 0
    for r, s in enumerate([0, 1, 2]):
        cache = [p.copy() for p in params]
        for batch in thirds[r][:3]:
            cache = [c - lr * g for c, g in zip(cache, _softmax_grad(cache, batch))]
        d = [p - c for p, c in zip(params, cache)]
        along = [np.sign(-di) * np.sign(mi) > 0 for di, mi in zip(d, m)]
        damped += s * sum(int(a.sum()) for a in along)
        d = [np.where(a, di / (1 + lam * s), di) for a, di in zip(along, d)]
        for k in range(2):
            m[k] = mu * m[k] - eta * d[k]
            want[k] = want[k] + mu * m[k] - eta * d[k]
    assert damped > 0  # Some entries were damped.
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    assert [s.max_staleness_seen for s in stats] == [0, 1, 2]
    plain, _ = downpour_schedule.simulate(
        params,
        _softmax_grad,
        thirds,
        Config(3, 3, **outer),
        downpour_schedule.sgd_ps(9.0),
    )
    assert np.abs(plain[0] - got[0]).max() > 1e-6


def test_reference_rejects_row_sparse():
    x, y, params = _softmax_data()
    with pytest.raises(ValueError, match=r"staleness_scaled take no row-sparse"):
        downpour_schedule.simulate(
            params,
            _softmax_grad,
            [_batches(x, y)],
            Config(staleness_scaled=True),
            downpour_schedule.sgd_ps(0.1),
            row_sparse=[0],
            rows_fn=lambda batch: {0: [0]},
        )


# --- The trainer on a cluster against the reference ---------------------------

# One config per rule and its paths: the outer optimizer with each local step
# and with `n_fetch != n_push`; delay compensation with a cached and an
# uncached fetch (`n_fetch = 1`), and with AdaGrad's pushed squares; the
# staleness-scaled step with each AdaGrad accumulator mode.
CONFIGS = {
    "outer_adagrad": Config(3, 3, outer_learning_rate=0.7),
    "outer_sgd_2_4": Config(
        2, 4, local_learning_rate=0.05, local_optimizer="sgd", outer_learning_rate=0.5
    ),
    "outer_staleness": Config(
        3, 3, outer_learning_rate=0.7, outer_momentum=0.5, staleness_scaled=True
    ),
    "dc_4_2": Config(4, 2, delay_compensation=20.0),
    "dc_fetch_every_step": Config(1, 2, delay_compensation=20.0),
    "dc_sgd_mean": Config(
        3,
        2,
        local_learning_rate=0.05,
        local_optimizer="sgd",
        adagrad_accumulator="mean",
        delay_compensation=20.0,
    ),
    "outer_damped_2_4": Config(
        2, 4, outer_learning_rate=0.7, outer_momentum=0.5, stale_damping=1.0
    ),
    "staleness_squares": Config(3, 2, staleness_scaled=True),
    "staleness_sum": Config(3, 2, adagrad_accumulator="sum", staleness_scaled=True),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_trainer_matches_reference_one_worker(local_cluster, name):
    config = CONFIGS[name]
    x, y, params = _softmax_data(seed=5)
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y)))
    for _ in range(STEPS):
        trainer.step(iterator)
    trainer.join()
    want, (want_stats,) = _reference(params, [_batches(x, y)], config)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    assert np.abs(want[0] - params[0]).max() > 1e-3  # It trained.
    (stats,) = trainer.stats()
    assert (stats.fetches, stats.pushes, stats.bytes_pushed) == (
        want_stats.fetches,
        want_stats.pushes,
        want_stats.bytes_pushed,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["outer_staleness", "outer_damped_2_4", "dc_4_2", "staleness_squares"]
)
def test_trainer_matches_reference_two_workers(local_cluster, name):
    """Steps one at a time on whichever worker the coordinator picks; the
    order is read back from the per-worker step counters and replayed."""
    config = CONFIGS[name]
    x, y, params = _softmax_data(seed=6)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    order = _steps_one_at_a_time(trainer, iterator, 2 * STEPS)
    assert set(order) == {0, 1}  # Both workers ran (they alternate here).
    batches = [_batches(x, y) * 2] * 2  # Each worker reads the whole set.
    want, want_stats = _reference(params, batches, config, order=order)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    stats = trainer.stats()
    assert [s.staleness_sum for s in stats] == [s.staleness_sum for s in want_stats]
    assert [s.pushes for s in stats] == [s.pushes for s in want_stats]


def test_push_rules_reject_row_sparse_before_training(local_cluster):
    strategy = _strategy(local_cluster)
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.layers.InputLayer(input_shape=(2,), dtype="int64"),
                tf_keras.layers.Embedding(10, 3, name="table"),
                tf_keras.layers.Flatten(),
                tf_keras.layers.Dense(2),
            ]
        )
        model.compile(adagrad.Adagrad(0.1), loss="mse")
    config = Config(4, 4, delay_compensation=1.0)
    with pytest.raises(
        ValueError, match=r"delay_compensation take no row-sparse.*table"
    ):
        downpour.install(model, config)
    # The tables moved whole: accepted.
    state = downpour.install(model, config, row_sparse=[])
    assert len(state._exchange.rules.fetched) == len(model.trainable_variables)
    assert push_rules.MOMENTUM_SLOT == "outer_momentum"


# --- Launch flags ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--downpour", "--outer_learning_rate=0.7"],
            r"Downpour settings: `--outer_learning_rate` needs `--n_fetch` and "
            r"`--n_push` >= 2.*n_fetch=1, n_push=1.*",
        ),
        (
            ["--staleness_scaled"],
            r"--staleness_scaled: Downpour settings, ignored without --downpour: "
            r"add --downpour\.",
        ),
    ],
)
def test_bad_push_rule_flags_are_one_line_before_any_server(args, message):
    proc = launch._train(args, uuid.uuid4().hex, timeout=300)
    launch.assert_one_refusal_line(proc, message)


@pytest.mark.parametrize(
    "config",
    [
        Config(2, 4, outer_learning_rate=0.7, outer_momentum=0.5),
        Config(3, 3, outer_learning_rate=0.35),
    ],
    ids=["outer_2_4", "outer_3_3_damped"],
)
def test_the_last_round_averages_the_unsent_progress_into_the_ps(local_cluster, config):
    """After the last step, `finish` moves the ps by the mean of the
    replicas' steps since their last push, as the reference's final round;
    then each replica's next step starts from the ps (a refetch) and sends
    nothing twice: its next push holds only steps after the last round."""
    x, y, params = _softmax_data(seed=7)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    order = _steps_one_at_a_time(trainer, iterator, 2 * STEPS - 3)
    batches = [_batches(x, y) * 2] * 2
    before, _ = _reference(params, batches, config, order=order)
    np.testing.assert_allclose(_ps_params(model)[0], before[0], rtol=0, atol=1e-6)
    # Each replica stopped mid-round: it has unsent steps.
    counts = [order.count(w) for w in (0, 1)]
    assert any(c % config.n_push for c in counts)
    (line,) = trainer.finish()
    assert line == (
        "downpour: last round, 2 of 2 replicas' unsent progress averaged into the ps"
    )
    want, _ = _reference(params, batches, config, order=order, final_round=True)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    assert max(np.abs(w - b).max() for w, b in zip(want, before)) > 1e-4
    # Each replica's next step fetches (a new round from the ps) whatever
    # its cadence says.
    stats = trainer.stats()
    for _ in range(2):
        trainer.step(iterator)
        trainer.join()
    now = trainer.stats()
    stepped = [a.steps - b.steps for a, b in zip(now, stats)]
    fetched = [a.fetches - b.fetches for a, b in zip(now, stats)]
    assert sum(stepped) == 2
    assert all(f >= min(s, 1) for f, s in zip(fetched, stepped))


def test_fit_ends_with_the_last_round(local_cluster):
    """`training.fit` runs the last round after the job's last step: 10
    steps with a push every 3 leave 1 step unsent, which the ps gets, as in
    the reference's final round; the line says so."""
    config = Config(3, 3, outer_learning_rate=0.7, outer_momentum=0.5)
    x, y, params = _softmax_data(seed=5)
    model = _softmax_model(_strategy(local_cluster), params)
    with model.distribute_strategy.scope():
        downpour.install(model, config)
    steps = 10
    data = tf_keras.utils.experimental.DatasetCreator(lambda _: _dataset(x, y))
    lines = []
    training.fit(
        model, data, epochs=1, steps_per_epoch=steps, batch_size=4,
        print_fn=lines.append,
    )  # fmt: skip
    batches = _batches(x, y)[:steps]
    want, _ = _reference(params, [batches], config, final_round=True)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    without, _ = _reference(params, [batches], config)
    assert max(np.abs(w - b).max() for w, b in zip(want, without)) > 1e-4
    assert (
        "downpour: last round, 1 of 1 replicas' unsent progress averaged into the ps"
        in lines
    )
