"""Compressed Downpour pushes with error feedback: top-k and the quantiser.

The NumPy reference (`push_rules.reference.compress`, `schedule.simulate`)
against computations written out here, then the trainer on a real cluster
against the reference: one worker, and two workers whose steps are run one
at a time with the order they ran in read back from their step counters.
The resume of a replica with a non-zero residual is in
tests/downpour/test_downpour_resume.py.
"""

from __future__ import annotations

import math
import uuid

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures import launch
from tests.fixtures.downpour import (
    BATCH_SIZE,
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
from tf_distbelief import downpour
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import schedule
from tf_distbelief.downpour.push_rules import compression
from tf_distbelief.downpour.push_rules import reference as push_reference

Config = downpour_config.DownpourConfig


# --- Pure: config errors, the reference ---------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            {"top_k_fraction": 0.0},
            ValueError,
            r"`top_k_fraction` must be in \(0, 1\].*or None \(off\). Received: 0.0",
        ),
        (
            {"top_k_fraction": 1.5},
            ValueError,
            r"`top_k_fraction` must be in \(0, 1\].*or None \(off\). Received: 1.5",
        ),
        ({"top_k_fraction": "0.1"}, TypeError, r"`top_k_fraction` must be a float"),
        (
            {"top_k_chunk": -1},
            ValueError,
            r"`top_k_chunk` must be >= 0 \(0: the whole tensor\). Received: -1",
        ),
        (
            {"top_k_chunk": 2.0},
            TypeError,
            r"`top_k_chunk` must be an integer.*Received: 2.0",
        ),
        (
            {"quantize_bits": 4},
            ValueError,
            r"`quantize_bits` must be one of 0 \(off\), 2, 8. Received: 4",
        ),
        ({"quantize_bits": True}, TypeError, r"`quantize_bits` must be an integer"),
        (
            {"quantize_bits": 8, "quantize_chunk": 0},
            ValueError,
            r"`quantize_chunk` must be >= 1 \(values per scale\). Received: 0",
        ),
        (
            {"n_push": 2, "top_k_fraction": 0.1},
            ValueError,
            r"`top_k_fraction` needs `adagrad_accumulator` 'mean' or 'sum' when "
            r"`n_push` > 1.*adagrad_accumulator='squares', n_push=2",
        ),
        (
            {"n_push": 4, "quantize_bits": 2},
            ValueError,
            r"`quantize_bits` needs `adagrad_accumulator` 'mean' or 'sum'",
        ),
    ],
)
def test_config_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        Config(**kwargs)


def test_compression_combines_with_the_outer_rule_and_each_other():
    config = Config(
        4, 4, outer_learning_rate=0.7, top_k_fraction=0.1, quantize_bits=8
    )  # Deltas: no squares pushed, so 'squares' is accepted.
    assert config.push_rules == (
        "outer_learning_rate",
        "quantize_bits",
        "stale_damping",
        "top_k_fraction",
    )
    assert Config().push_rules == ()
    assert (Config().top_k_chunk, Config().quantize_chunk) == (0, 256)


def _top_k_written_out(x, fraction, chunk):
    """Top-k of each chunk of `x` (flat), entries kept in sending order."""
    chunk = chunk or x.size
    kept = []
    for start in range(0, x.size, chunk):
        positions = range(start, min(start + chunk, x.size))
        k = max(1, round(fraction * len(positions)))
        kept += sorted(positions, key=lambda i: (-abs(x[i]), i))[:k]
    return kept


def _quantized_written_out(values, bits, chunk):
    levels = {8: 127, 2: 1}[bits]
    out = []
    for start in range(0, len(values), chunk):
        part = values[start : start + chunk]
        scale = max(abs(v) for v in part)
        for v in part:
            q = round(v / scale * levels) if scale else 0  # Half to even.
            out.append(q * scale / levels)
    return out


def _compressed_written_out(x, fraction=None, chunk=0, bits=0, quantize_chunk=256):
    flat = x.reshape(-1)
    kept = (
        list(range(flat.size))
        if fraction is None
        else _top_k_written_out(flat, fraction, chunk)
    )
    values = [float(flat[i]) for i in kept]
    if bits:
        values = _quantized_written_out(values, bits, quantize_chunk)
    sent = np.zeros_like(flat)
    sent[kept] = values
    return sent.reshape(x.shape)


@pytest.mark.parametrize(
    "settings",
    [
        dict(fraction=0.25),
        dict(fraction=0.3, chunk=4),
        dict(bits=8, quantize_chunk=5),
        dict(bits=2, quantize_chunk=3),
        dict(fraction=0.5, chunk=5, bits=2, quantize_chunk=4),
    ],
    ids=["top_k", "top_k_chunks", "q8", "q2", "top_k_q2"],
)
def test_reference_compress_is_the_rules_written_out(settings):
    x = np.random.default_rng(1).normal(size=(6, 7))
    x[0, :3] = [0.5, -0.5, 0.0]  # Ties in magnitude: the lower position first.
    config = Config(
        top_k_fraction=settings.get("fraction"),
        top_k_chunk=settings.get("chunk", 0),
        quantize_bits=settings.get("bits", 0),
        quantize_chunk=settings.get("quantize_chunk", 256),
    )
    (got,) = push_reference.compress(config.rules, [x])
    want = _compressed_written_out(x, **settings)
    np.testing.assert_array_equal(got, want)
    if "fraction" in settings:
        count = len(
            _top_k_written_out(
                x.reshape(-1), settings["fraction"], settings.get("chunk", 0)
            )
        )
        assert np.count_nonzero(got) <= count < x.size


def test_push_nbytes():
    kernel, bias = np.zeros((6, 3)), np.zeros(3, np.float32)
    # 4 of 18 and 1 of 3: each value and its 2-byte position (one chunk of
    # 65,536: no count).
    top_k = Config(top_k_fraction=0.25)
    assert push_reference.push_nbytes(top_k.rules, [kernel, bias]) == 4 * 10 + 1 * 6
    both = Config(top_k_fraction=0.5, quantize_bits=2, quantize_chunk=4)
    # Kernel: 9 values, 3 bytes of codes, 3 float64 scales, 9 positions; bias:
    # 2 values (round(1.5) == 2), 1 byte, 1 float32 scale, 2 positions.
    assert push_reference.push_nbytes(both.rules, [kernel, bias]) == (
        3 + 24 + 18 + 1 + 4 + 4
    )
    assert push_reference.push_nbytes(Config().rules, [kernel]) is None


def test_reference_error_feedback_written_out():
    """One replica, a push per step, no local step, SGD on the ps: each push
    sends C(g + e) and keeps the rest in e."""
    x, y, params = _softmax_data(seed=2)
    settings = dict(fraction=0.3, bits=8, quantize_chunk=4)
    config = Config(
        1,
        1,
        local_learning_rate=0.0,
        top_k_fraction=0.3,
        quantize_bits=8,
        quantize_chunk=4,
    )
    got, (stats,) = schedule.simulate(
        params, _softmax_grad, [_batches(x, y)], config, schedule.sgd_ps(0.5)
    )
    want = [p.copy() for p in params]
    residual = [np.zeros_like(p) for p in params]
    for batch in _batches(x, y):
        unsent = [g + e for g, e in zip(_softmax_grad(want, batch), residual)]
        sent = [_compressed_written_out(u, **settings) for u in unsent]
        residual = [u - s for u, s in zip(unsent, sent)]
        want = [w - 0.5 * s for w, s in zip(want, sent)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-12)
    assert np.abs(residual[0]).max() > 1e-3  # Something was held back.
    # 18 + 3 entries: 5 + 1 kept, coded in 8 bits with a scale per 4, and
    # their 2-byte positions.
    assert stats.bytes_pushed == STEPS * ((5 + 2 * 8 + 5 * 2) + (1 + 8 + 2))


# --- The trainer on a cluster against the reference ---------------------------

# Each rule alone and combined, through each push path with error feedback: a
# push every step (uncached), pushes of summed gradients with AdaGrad's 'mean'
# and 'sum'. With the outer optimizer (and no sparse fetches) a compressed push
# is fetched as a stream and keeps no residual:
# tests/downpour/test_downpour_stream_fetch.py.
CONFIGS = {
    "top_k_mean": Config(3, 2, adagrad_accumulator="mean", top_k_fraction=0.25),
    "q2_every_step": Config(1, 1, quantize_bits=2, quantize_chunk=4),
    "top_k_chunks_q8_sum": Config(
        2,
        2,
        adagrad_accumulator="sum",
        top_k_fraction=0.5,
        top_k_chunk=4,
        quantize_bits=8,
        quantize_chunk=3,
    ),
}


def _uncompressed(config: Config) -> Config:
    off = dict(top_k_fraction=None, quantize_bits=0)
    kwargs = {n: getattr(config, n) for n in Config.setting_names()}
    return Config(**(kwargs | off))


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
    plain, (plain_stats,) = _reference(params, [_batches(x, y)], _uncompressed(config))
    for got, w, p in zip(_ps_params(model), want, plain):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
        assert np.abs(w - p).max() > 1e-4  # The compression changed the result.
    (stats,) = trainer.stats()
    assert (stats.fetches, stats.pushes, stats.bytes_pushed) == (
        want_stats.fetches,
        want_stats.pushes,
        want_stats.bytes_pushed,
    )
    assert stats.bytes_pushed < plain_stats.bytes_pushed
    # The encoded tensors' sizes are the reference's count.
    compressed = trainer.downpour._exchange.compression
    assert compressed.nbytes == push_reference.push_nbytes(config.rules, params)
    residuals = [r.read_all()[0].numpy() for r in compressed.residuals]
    assert max(np.abs(r).max() for r in residuals) > 0


def test_fit_in_segments_matches_reference(local_cluster):
    """`fit` runs the local steps between exchanges in segments
    (`Downpour.run_steps`): the same pushes and residuals."""
    config = Config(
        3, 2, 0.05, adagrad_accumulator="mean", top_k_fraction=0.4, quantize_bits=2
    )
    x, y, params = _softmax_data(seed=3)
    model = _softmax_model(_strategy(local_cluster), params, steps_per_execution=4)
    replicas = downpour.install(model, config)
    assert replicas.runs_segments
    model.fit(_dataset(x, y).repeat(), epochs=1, steps_per_epoch=STEPS, verbose=0)
    want, (want_stats,) = _reference(params, [_batches(x, y)], config)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    assert replicas.stats()[0].bytes_pushed == want_stats.bytes_pushed


@pytest.mark.slow
def test_trainer_matches_reference_two_workers(local_cluster):
    """Steps one at a time on whichever worker the coordinator picks; the
    order is read back from the per-worker step counters and replayed. With
    `max_staleness=0` the second of two pushes after a fetch is dropped, and
    leaves its replica's residual as it was."""
    config = Config(
        2,
        2,
        adagrad_accumulator="sum",
        max_staleness=0,
        top_k_fraction=0.5,
        top_k_chunk=4,
        quantize_bits=8,
        quantize_chunk=3,
    )
    x, y, params = _softmax_data(seed=6)
    model = _softmax_model(_strategy(local_cluster, num_workers=2), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    order = _steps_one_at_a_time(trainer, iterator, 2 * STEPS)
    assert set(order) == {0, 1}
    batches = [_batches(x, y) * 2] * 2  # Each worker reads the whole set.
    want, want_stats = _reference(params, batches, config, order=order)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    stats = trainer.stats()
    assert [s.pushes for s in stats] == [s.pushes for s in want_stats]
    assert [s.bytes_pushed for s in stats] == [s.bytes_pushed for s in want_stats]
    assert [s.dropped_pushes for s in stats] == [s.dropped_pushes for s in want_stats]
    assert sum(s.dropped_pushes for s in stats) > 0


def test_a_refused_push_leaves_the_residual_as_it_was(local_cluster):
    """A push with a NaN (`nonfinite="skip"`) is refused whole: neither the ps
    nor the replica's residual changes, and the next push goes on."""
    config = Config(1, 1, quantize_bits=2, quantize_chunk=4)
    x, y, params = _softmax_data(seed=7)
    x[2 * BATCH_SIZE, 0] = np.nan  # In the third batch.
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)
    trainer.downpour.nonfinite = "skip"
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y)))
    residuals = trainer.downpour._exchange.compression.residuals

    def state():
        trainer.join()
        return [r.read_all()[0].numpy() for r in residuals] + _ps_params(model)

    for _ in range(2):
        trainer.step(iterator)
    before = state()
    trainer.step(iterator)  # The NaN batch.
    after = state()
    for a, b in zip(after, before, strict=True):
        np.testing.assert_array_equal(a, b)
    assert all(np.isfinite(r).all() and np.abs(r).max() > 0 for r in after[:2])
    trainer.step(iterator)
    assert np.abs(state()[0] - after[0]).max() > 0
    assert trainer.stats()[0].nonfinite_pushes == 1


def test_compressed_push_sends_only_the_encoded_tensors():
    """The parts that cross to the ps: positions, codes and scales, sized as
    `push_nbytes` counts them; decoded, they are `reference.compress`."""
    config = Config(top_k_fraction=0.2, top_k_chunk=7, quantize_bits=2)
    variable = tf.Variable(np.zeros((5, 7)))
    push = compression.CompressedPush(config.rules, [variable])
    x = np.random.default_rng(3).normal(size=(5, 7))
    unsent, (parts,), (sent,) = push.encode(push.handles(), [tf.constant(x)])
    # Positions: uint16 offsets and int32 per-chunk counts (none: one chunk).
    assert [p.dtype for p in parts] == [tf.uint16, tf.int32, tf.uint8, tf.float64]
    assert parts[1].shape == [0]
    nbytes = sum(p.shape.num_elements() * p.dtype.size for p in parts)
    assert nbytes == push.nbytes == push_reference.push_nbytes(config.rules, [x])
    assert nbytes == 5 * 2 + math.ceil(5 / 4) + 8  # 1 of 7 per row, 5 rows.
    (want,) = push_reference.compress(config.rules, [x])
    np.testing.assert_array_equal(sent.numpy(), want)
    (decoded,), _ = push.to_ps([parts], [[0]])
    np.testing.assert_array_equal(decoded.numpy(), want)


# --- Launch flags ----------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--quantize_bits=4"],
            r"Downpour settings: `--quantize_bits` must be one of 0 \(off\).*",
        ),
        (  # absl's bounds would say [0, 1] and let 0 through to this check.
            ["--top_k_fraction=0"],
            r"Downpour settings: `--top_k_fraction` must be in \(0, 1\].*"
            r"Received: 0.0",
        ),
        (
            ["--top_k_fraction=2"],
            r"Downpour settings: `--top_k_fraction` must be in \(0, 1\].*"
            r"Received: 2.0",
        ),
        (  # A rule's own setting without the rule would do nothing.
            ["--top_k_chunk=5"],
            r"--top_k_chunk is a setting of --top_k_fraction and does nothing "
            r"without it: add --top_k_fraction or drop --top_k_chunk\.",
        ),
        (
            ["--quantize_chunk=64", "--outer_momentum=0.5"],
            r"--outer_momentum is a setting of --outer_learning_rate and does "
            r"nothing without it: add --outer_learning_rate or drop "
            r"--outer_momentum; --quantize_chunk is a setting of --quantize_bits "
            r"and does nothing without it: add --quantize_bits or drop "
            r"--quantize_chunk\.",
        ),
        (  # Update-stream fetches replay one round of pushes per fetch.
            ["--outer_learning_rate=0.35", "--top_k_fraction=0.01", "--n_fetch=8"],
            r"Downpour settings: `--top_k_fraction` with `--outer_learning_rate` "
            r"\(update-stream fetches\) needs `--n_fetch` equal to `--n_push`: .*"
            r"Received: n_fetch=8, n_push=4",
        ),
    ],
)
def test_bad_compression_flag_is_one_line_before_any_server(args, message):
    args = ["--downpour", "--n_push=4", "--adagrad_accumulator=mean", *args]
    proc = launch._train(args, uuid.uuid4().hex, timeout=300)
    launch.assert_one_refusal_line(proc, message)
