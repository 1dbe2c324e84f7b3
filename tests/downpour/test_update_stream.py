"""The NumPy reference of compressed outer pushes with update-stream fetches.

`downpour.update_stream` (the compressed exchanges' variants) against
`schedule.simulate` where they must agree, and against rounds written out by
hand where they differ; `downpour.position_codes`' byte counts against
hand-counted codes.
Pure: no cluster.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.fixtures.downpour import _softmax_grad
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import position_codes, schedule, update_stream

Config = downpour_config.DownpourConfig
Exchange = update_stream.Exchange
OUTER = {"outer_learning_rate": 0.35, "outer_momentum": 0.9}


def _problem(replicas=2, steps=48, seed=0):
    """The softmax fixture's model on random data: params and batches of 4."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(replicas * steps * 4, 6))
    y = rng.integers(0, 3, size=len(x))
    params = [rng.normal(size=(6, 3)) * 0.1, rng.normal(size=3) * 0.1]
    batches = [
        [
            (x[i : i + 4], y[i : i + 4])
            for i in range(r * steps * 4, (r + 1) * steps * 4, 4)
        ]
        for r in range(replicas)
    ]
    return params, batches


def _run(exchange, params, batches, config, **kwargs):
    return update_stream.simulate(
        params, _softmax_grad, batches, config, exchange, ps_learning_rate=0.2, **kwargs
    )


# --- Agreement with `schedule.simulate` ----------------------------------------


@pytest.mark.parametrize(
    "local, rules",
    [
        ("adagrad", {}),
        ("sgd", {}),
        ("adagrad", {"stale_damping": 0.0}),
        ("adagrad", {"stale_damping": 0.0, "staleness_scaled": True}),
    ],
    ids=["adagrad", "sgd", "undamped", "staleness_scaled"],
)
def test_defaults_are_schedule_simulate_with_the_outer_rule(local, rules):
    """The outer rule's defaults (stale pushes damped), undamped, and with
    the step scaled by the staleness: 3 replicas in turn, so that each push
    is 2 pushes stale, which each rule acts on."""
    params, batches = _problem(replicas=3)
    config = Config(4, 4, local_optimizer=local, **OUTER, **rules)
    want, want_stats = schedule.simulate(
        params, _softmax_grad, batches, config, schedule.adagrad_ps(0.2)
    )
    got, stats = _run(Exchange(), params, batches, config)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    # Each differs from the plain outer rule: the rules act.
    plain = Config(4, 4, local_optimizer=local, stale_damping=0.0, **OUTER)
    if config != plain:
        other, _ = _run(Exchange(), params, batches, plain)
        assert max(np.abs(g - p).max() for g, p in zip(got, other)) > 1e-6
    for w, s in zip(want_stats, stats):
        assert (s.steps, s.fetches, s.pushes) == (w.steps, w.fetches, w.pushes)
        assert (s.bytes_pushed, s.bytes_fetched) == (w.bytes_pushed, w.bytes_fetched)


def test_top_k_and_quantiser_with_reset_are_todays_rule():
    params, batches = _problem()
    compressed = {"top_k_fraction": 0.2, "quantize_bits": 2, "quantize_chunk": 4}
    want, want_stats = schedule.simulate(
        params,
        _softmax_grad,
        batches,
        Config(4, 4, **OUTER, **compressed),
        schedule.adagrad_ps(0.2),
    )
    exchange = Exchange(fraction=0.2, bits=2, quantize_chunk=4, positions="wire")
    got, stats = _run(exchange, params, batches, Config(4, 4, **OUTER))
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)
    assert [s.bytes_pushed for s in stats] == [w.bytes_pushed for w in want_stats]


def test_one_replica_parameter_residual_uncompressed_is_the_outer_rule():
    params, batches = _problem(replicas=1)
    config = Config(4, 4, **OUTER)
    want, _ = schedule.simulate(
        params, _softmax_grad, batches, config, schedule.adagrad_ps(0.2)
    )
    exchange = Exchange(residual="parameter", fetch="stream")
    got, (stats,) = _run(exchange, params, batches, config)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)
    # One replica replays only its own updates: 8 bytes each.
    assert stats.whole_fetches == 1
    assert stats.updates_replayed == stats.pushes - 1
    model_bytes = sum(p.nbytes for p in params)
    # The first fetch sends no momentum: the ps has applied nothing yet.
    assert stats.bytes_fetched == model_bytes + 8 * stats.updates_replayed


# --- The update stream ---------------------------------------------------------


@pytest.mark.parametrize("residual", ["reset", "parameter"])
def test_stream_fetches_give_the_replica_what_the_ps_holds(residual):
    params, batches = _problem(replicas=3)
    config = Config(4, 4, **OUTER)
    after = []  # The ps values after each step, and whose step comes next.
    seen = []  # The cache each gradient is taken at.

    def grad_fn(p, batch):
        seen.append([v.copy() for v in p])
        return _softmax_grad(p, batch)

    def record(done, ps, stats):
        after.append([v.copy() for v in ps])

    exchange = Exchange(fraction=0.2, bits=2, residual=residual, fetch="stream")
    got, stats = update_stream.simulate(
        params,
        grad_fn,
        batches,
        config,
        exchange,
        ps_learning_rate=0.2,
        after_step=record,
    )
    whole, _ = _run(
        Exchange(fraction=0.2, bits=2, residual=residual), params, batches, config
    )
    for w, g in zip(whole, got):
        np.testing.assert_array_equal(g, w)  # Replay is exact.
    if residual == "reset":
        # Round robin over 3 replicas: each 4th local step of a replica, step
        # `12 * i + r` overall, starts with a fetch: its cache is the ps's.
        for step in range(12, len(seen), 12):
            for r in range(3):
                for c, p in zip(seen[step + r], after[step + r - 1]):
                    np.testing.assert_array_equal(c, p)
    assert all(s.whole_fetches == 1 for s in stats)
    assert all(s.updates_replayed == 3 * (s.fetches - 1) for s in stats)


def test_stream_fetch_bytes_are_the_others_pushes():
    params, batches = _problem(replicas=2, steps=3)
    config = Config(2, 2, **OUTER)
    _, stats = _run(Exchange(fetch="stream"), params, batches, config)
    model_bytes = sum(p.nbytes for p in params)
    # Replica 0: a whole fetch at step 0 (no momentum yet), then at step 2
    # its own update (its id) and replica 1's (dense: the model's bytes, and
    # its id).
    assert stats[0].bytes_fetched == model_bytes + 8 + (model_bytes + 8)
    assert stats[0].bytes_pushed == model_bytes


def test_a_replica_behind_the_window_gets_a_whole_fetch():
    params, batches = _problem(replicas=2)
    config = Config(4, 4, **OUTER)
    _, stats = _run(Exchange(fetch="stream", window=1), params, batches, config)
    # Two updates land between a replica's fetches: one more than the window.
    assert all(s.whole_fetches == s.fetches for s in stats)
    # Each whole fetch after the first sends the momentum too.
    model_bytes = sum(p.nbytes for p in params)
    assert [s.bytes_fetched for s in stats] == [
        (2 * s.fetches - 1) * model_bytes for s in stats
    ]
    _, stats = _run(Exchange(fetch="stream", window=2), params, batches, config)
    assert all(s.whole_fetches == 1 for s in stats)


# --- Rounds by hand: one replica, 4 entries, gradients that ignore the point ---

GRADS = [[4.0, 1, 0, 0], [0, 1, 0, 2], [0, 0, 1, 0], [0, 0, 1, 0]]


def _by_hand(exchange, momentum=0.5):
    """Two rounds of 2 SGD steps (lr 1) of `GRADS`, top 1 of 4, outer lr 1."""
    seen = []

    def grad_fn(p, batch):
        seen.append(p[0].copy())
        return [np.array(batch)]

    config = Config(
        2,
        2,
        local_optimizer="sgd",
        local_learning_rate=1.0,
        outer_learning_rate=1.0,
        outer_momentum=momentum,
    )
    got, (stats,) = update_stream.simulate(
        [np.zeros(4)], grad_fn, [GRADS], config, exchange
    )
    return got[0], seen, stats


def test_parameter_residual_by_hand():
    got, seen, stats = _by_hand(Exchange(fraction=0.25, residual="parameter"))
    # Round 1: the cache walks to -[4, 2, 0, 2]; u = mirror - cache =
    # [4, 2, 0, 2] sends [4, 0, 0, 0] (residual [0, 2, 0, 2]), and the cache
    # gives the sent part back: [0, -2, 0, -2]. The ps: m = -[4, 0, 0, 0],
    # w = 0.5 m - D = [-6, 0, 0, 0].
    # Round 2: the fetch moves the cache as the mirror: [-6, -2, 0, -2] (the
    # mirror less the residual); two steps make it [-6, -2, -2, -2]; u =
    # [0, 2, 2, 2] sends [0, 2, 0, 0] (ties: the lower position); m =
    # 0.5 m - D = [-2, -2, 0, 0], w = [-6, 0, 0, 0] + 0.5 m - D = [-7, -3, 0, 0].
    np.testing.assert_array_equal(seen[2], [-6, -2, 0, -2])
    np.testing.assert_array_equal(got, [-7, -3, 0, 0])
    # Reset: the cache is the mirror at the fetch; the residual, added to the
    # round's sum [0, 0, 2, 0], makes the same `u` here (the gradients do not
    # read the point).
    got, seen, _ = _by_hand(Exchange(fraction=0.25))
    np.testing.assert_array_equal(seen[2], [-6, 0, 0, 0])
    np.testing.assert_array_equal(got, [-7, -3, 0, 0])
    # Each push: one float64 value and one int32 position.
    assert stats.bytes_pushed == 2 * (8 + 4)


def test_error_reset_drops_the_unsent_progress_by_hand():
    got, seen, _ = _by_hand(
        Exchange(fraction=0.25, residual="parameter", error_reset=1)
    )
    # After the first push the cache is the mirror, [0, 0, 0, 0], so the fetch
    # makes it [-6, 0, 0, 0]; round 2's u = [0, 0, 2, 0] sends itself: m =
    # [-2, 0, -2, 0], w = [-6, 0, 0, 0] + [-1, 0, -1, 0] - [0, 0, 2, 0].
    np.testing.assert_array_equal(seen[2], [-6, 0, 0, 0])
    np.testing.assert_array_equal(got, [-7, 0, -3, 0])


def test_dgc_momentum_correction_by_hand():
    got, seen, _ = _by_hand(Exchange(fraction=0.25, dgc_momentum=0.5), momentum=0)
    # Round 1: vel = v = [4, 2, 0, 2] sends [4, 0, 0, 0]; v = [0, 2, 0, 2],
    # vel masked where sent: [0, 2, 0, 2]; the ps (no momentum): w = -D.
    # Round 2: the sum [0, 0, 2, 0]; vel = 0.5 vel + sum = [0, 1, 2, 1];
    # v = [0, 3, 2, 3] sends [0, 3, 0, 0] (ties: the lower position).
    np.testing.assert_array_equal(seen[2], [-4, 0, 0, 0])
    np.testing.assert_array_equal(got, [-4, -3, 0, 0])


def test_density_warm_up():
    exchange = Exchange(fraction=0.01, warmup_pushes=2)
    assert exchange.fraction_at(0) == pytest.approx(0.1)
    assert exchange.fraction_at(1) == pytest.approx(0.01)
    assert exchange.fraction_at(7) == pytest.approx(0.01)
    assert Exchange(fraction=0.01).fraction_at(0) == 0.01
    # By hand: 4 entries at 0.25 over 2 pushes sends 2 entries, then 1.
    _, _, stats = _by_hand(Exchange(fraction=0.25, warmup_pushes=2))
    assert stats.bytes_pushed == 2 * 12 + 12


# --- Compression and positions -------------------------------------------------


def test_compress_keeps_the_largest_entries_and_codes_them():
    values = [np.array([[0.5, -4.0], [3.0, 0.25]])]
    sent, positions = update_stream.compress(values, Exchange(bits=2), 0.5)
    # Top 2: -4 and 3, in that order; 2 bits with scale 4: -4 and 4.
    np.testing.assert_array_equal(positions[0], [1, 2])
    np.testing.assert_array_equal(sent[0], [[0, -4], [4, 0]])
    sent, positions = update_stream.compress(values, Exchange(), None)
    assert positions == [None]
    np.testing.assert_array_equal(sent[0], values[0])


def test_position_bytes_by_hand():
    positions = np.array([5, 0, 1])
    # Gaps 0, 0, 3: Rice b = 0 takes 3 + 3 bits, b = 1 takes 1 + 6: one byte
    # after the 5-byte header.
    assert position_codes.rice_nbytes(positions) == 6
    assert position_codes.rice_nbytes(np.array([], int)) == 5
    want = {
        "int32": 12,
        "chunk12": 5 + 2 * 3,  # 36 bits; 3 chunks of 4,096 counted.
        "chunk16": 6,  # One chunk: no count.
        "bitmap": 1250,
        "rice": 6,
        "auto": 1 + 6,
    }
    assert {
        c: position_codes.position_nbytes(positions, 10_000, c) for c in want
    } == want
    # Every other entry: gaps of 1 take 2 bits each in Rice (1,255 bytes with
    # the header), a bitmap 1,250.
    every_other = np.arange(0, 10_000, 2)
    assert position_codes.position_nbytes(every_other, 10_000, "auto") == 1251
    # A run of entries: gaps of 0, a bit each.
    assert position_codes.position_nbytes(np.arange(5000), 10_000, "auto") == 631


def test_rice_is_about_a_byte_per_position_at_one_percent():
    rng = np.random.default_rng(0)
    positions = rng.choice(1_000_000, 10_000, replace=False)
    per_position = position_codes.rice_nbytes(positions) / positions.size
    assert 1.0 < per_position < 1.2


# --- Errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fraction": 0.0}, r"`fraction` must be in \(0, 1\] or None \(dense\)"),
        ({"bits": 4}, r"`bits` must be one of \(0, 2, 8\). Received: 4"),
        ({"residual": "x"}, r"`residual` must be one of reset, parameter"),
        ({"fetch": "sparse"}, r"`fetch` must be one of whole, stream"),
        ({"error_reset": 2}, r"`error_reset` must be 0 unless `residual` is"),
        ({"warmup_pushes": 3}, r"`warmup_pushes` must be 0 without a top-k"),
        (
            {"dgc_momentum": 0.9, "residual": "parameter"},
            r"`dgc_momentum` must be 0 unless `residual` is 'reset'",
        ),
        ({"dgc_momentum": 1.0}, r"`dgc_momentum` must be in \[0, 1\)"),
        ({"positions": "gzip"}, r"`positions` must be one of int32, chunk12"),
        ({"window": 0}, r"`window` must be"),
    ],
)
def test_exchange_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Exchange(**kwargs)


@pytest.mark.parametrize(
    "config, match",
    [
        (Config(4, 4), r"Field `outer_learning_rate` of `config` must be set"),
        (
            Config(4, 4, top_k_fraction=0.1, **OUTER),
            r"Field `rules` of `config` must be the outer rule, and no rule "
            r"that compresses.*"
            r"\['top_k_fraction'\]",
        ),
        (Config(4, 8, **OUTER), r"Field `n_fetch` of `config` must be `n_push` \(8\)"),
        (Config(4, 4, max_staleness=1, **OUTER), r"Field `max_staleness`"),
    ],
)
def test_config_errors(config, match):
    params, batches = _problem()
    with pytest.raises(ValueError, match=match):
        _run(Exchange(), params, batches, config)
