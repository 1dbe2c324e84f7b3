"""The tables of `benchmarks/downpour_bench.py`: medians, ratios, rows; no cluster.

Its socket counters are `benchmarks.traffic`'s
(tests/cluster/test_traffic.py).
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import types

import pytest
from absl import flags

from tests.fixtures.launch import ROOT

_PATH = os.path.join(
    ROOT,
    "benchmarks",
    "downpour_bench.py",
)
_spec = importlib.util.spec_from_file_location("downpour_bench", _PATH)
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("downpour_bench", bench)  # For its dataclasses.
_spec.loader.exec_module(bench)


def _row(name, rate, sock, acc, model="speech"):
    return bench.Row(
        model=model,
        name=name,
        examples_per_sec=rate,
        socket_bytes_per_example=sock,
        tensor_bytes_per_example=sock,
        cpu_ms_per_step={"worker": 1.0, "ps": 0.5},
        test_accuracy=acc,
        test_loss=1.0,
        wall_secs=2.0,
    )


def test_median_rows_and_table_ratios():
    rows = [
        _row("stock", 100, 1000, 0.90),
        _row("n=16", 250, 60, 0.89),
        _row("stock", 120, 1000, 0.92),
        _row("n=16", 200, 70, 0.88),
        _row("stock", 80, 1000, 0.91),
        _row("n=16", 300, 65, 0.87),
    ]
    stock, n16 = bench.median_rows(rows)
    assert (stock.name, stock.examples_per_sec, stock.test_accuracy) == (
        "stock",
        100,
        0.91,
    )
    assert (n16.examples_per_sec, n16.socket_bytes_per_example) == (250, 65)
    assert n16.wall_secs == 6.0
    lines = bench.format_table([stock, n16], "header").splitlines()
    assert lines[0] == "header"
    assert lines[1].split()[:4] == ["model", "config", "ex/s", "x"]
    fields = lines[3].split()
    # ex/s, x stock, sock B/ex, tensor B/ex, B x stock, CPU ms/step.
    assert fields[:8] == ["speech", "n=16", "250", "2.50", "65", "65", "0.065", "1.5"]


def test_table_without_stock_has_no_byte_ratio_to_a_single_row():
    """Without a stock row each row is its own base; `single` moves no bytes:
    its `B x stock` is "-", not a division by zero."""
    single, n16 = _row("single", 300, 0, 0.9), _row("n=16", 250, 65, 0.89)
    lines = bench.format_table([single, n16], "header").splitlines()
    assert lines[2].split()[:7] == ["speech", "single", "300", "1.00", "0", "0", "-"]
    assert lines[3].split()[:7] == [
        "speech",
        "n=16",
        "250",
        "1.00",
        "65",
        "65",
        "1.000",
    ]


def test_speedup_is_the_median_of_per_round_ratios():
    """Round by round: 2.6, 2.0, 3.0 (median 2.6); the medians' ratio is 2.4."""
    rows = []
    for stock_rate, rate in ((100, 260), (120, 240), (80, 240)):
        rows += [_row("stock", stock_rate, 1000, 0.9), _row("n=4", rate, 250, 0.9)]
    stock, n4 = bench.median_rows(rows)
    assert stock.speedup == 1.0
    assert n4.speedup == pytest.approx(2.6)
    assert n4.examples_per_sec / stock.examples_per_sec == pytest.approx(2.4)
    fields = bench.format_table([stock, n4], "header").splitlines()[3].split()
    assert fields[:4] == ["speech", "n=4", "240", "2.60"]


def test_to_target_interpolates_seconds_and_examples():
    curve = [(0.0, 0.0), (2.0, 0.25), (6.0, 0.75), (7.0, 0.5)]
    secs, examples = bench.to_target(curve, 100, 0.5)
    # Halfway between the points at 2 s (100 examples) and 6 s (200).
    assert (secs, examples) == (4.0, 150.0)
    secs, examples = bench.to_target(curve, 100, 0.76)
    assert math.isnan(secs) and math.isnan(examples)


def test_median_rows_time_to_target_counts_unreached_rounds_as_slowest():
    rows = []
    for secs in (10.0, math.nan, 20.0):
        r = _row("n=16", 100, 60, 0.2)
        r.secs_to_target = secs
        r.examples_to_target = secs * 100
        r.reached = int(not math.isnan(secs))
        r.target = 0.15
        rows.append(r)
    (row,) = bench.median_rows(rows)
    # Sorted 10, 20, not reached: the median is 20.
    assert row.secs_to_target == 20.0
    assert row.examples_to_target == 2000.0
    assert (row.reached, row.rounds, row.target) == (2, 3, 0.15)
    low, high = row.spread["secs_to_target"]
    assert low == 10.0 and math.isnan(high)
    # Two rounds of three not reached: the median is not reached.
    rows[0].secs_to_target = math.nan
    assert math.isnan(bench.median_rows(rows)[0].secs_to_target)


def test_headline_ratios_to_stock_single_and_n1():
    rows = []
    for name, secs, rate, sock, acc in (
        ("single", 10.0, 4000, 0, 0.30),
        ("stock", 40.0, 1000, 1000, 0.28),
        ("n=1", 38.0, 1050, 1000, 0.27),
        ("n=16", 12.0, 3000, 100, 0.26),
    ):
        r = _row(name, rate, sock, acc)
        r.secs_to_target, r.examples_to_target, r.target = secs, secs * rate, 0.2
        r.reached = 1
        rows.append(r)
    rows = bench.median_rows(rows)
    lines = bench.format_headline(rows, "header").splitlines()
    assert lines[0] == "header"
    cells = [c.strip() for c in lines[-1].strip("|").split("|")]
    # model, row, target, secs [min-max], examples, reached, x stock, x single,
    # final acc, acc vs n=1, ex/s, x stock ex/s, x single ex/s, B/ex, B x stock.
    assert cells[:3] == ["speech", "n=16", "0.200"]
    assert cells[3] == "12.0 [12.0-12.0]"
    assert cells[5:8] == ["1/1", "0.30", "1.20"]
    assert cells[9:] == ["-1.0", "3000", "3.00", "0.75", "100", "0.100"]
    stock = [c.strip() for c in lines[-3].strip("|").split("|")]
    assert stock[6:8] == ["1.00", "4.00"]


@pytest.mark.parametrize(
    "name, kind",
    [
        ("single", ("single", None, None)),
        ("stock", ("stock", None, None)),
        ("n=4", ("downpour", 4, None)),
        ("n=16+outer", ("downpour", 16, "outer")),
        ("n=64+outer", ("downpour", 64, "outer")),
        ("n=16+outer+topk+q8", ("downpour", 16, "outer+topk+q8")),
    ],
)
def test_row_kind(name, kind):
    assert bench._row_kind(name) == kind
    assert name in bench._known_rows()


def test_compressed_rows_combine_their_rules():
    f = types.SimpleNamespace(
        outer_learning_rate=0.35,
        outer_momentum=0.9,
        delay_compensation=0.04,
        top_k_fraction=0.01,
        stale_damping=1.0,
        local_learning_rate=None,
        local_optimizer="adagrad",
        adagrad_accumulator="squares",
    )
    config = bench._downpour_config(16, "outer+topk+q8", f)
    assert config.push_rules == (
        "outer_learning_rate",
        "quantize_bits",
        "stale_damping",
        "top_k_fraction",
    )
    assert (config.top_k_fraction, config.quantize_bits) == (0.01, 8)
    assert bench._downpour_config(16, None, f).push_rules == ()
    damped = bench._downpour_config(16, "outer+damp", f)
    assert damped.push_rules == ("outer_learning_rate", "stale_damping")
    assert damped.stale_damping == 1.0
    undamped = bench._downpour_config(16, "outer+undamped", f)
    assert undamped.push_rules == ("outer_learning_rate",)


def test_unknown_rows_are_refused_when_the_flags_are_parsed():
    assert bench._check_rows(["single", "n=64+outer"])
    with pytest.raises(flags.ValidationError, match=r"unknown \['n=128'\]; known: "):
        bench._check_rows(["n=16", "n=128"])


def test_max_row_secs_for_every_row_and_per_row():
    assert bench._max_row_secs([]) == {}
    caps = bench._max_row_secs(["100", "stock=480", "n=64+outer=90.5"])
    assert caps == {"": 100.0, "stock": 480.0, "n=64+outer": 90.5}
    assert bench._check_max_row_secs(["100", "stock=480"])


@pytest.mark.parametrize(
    "entries, match",
    [
        (["0"], r"'0': SECS must be a number of seconds > 0"),
        (["stock=x"], r"'stock=x': SECS must be a number"),
        (["stock=inf"], r"'stock=inf': SECS must be a number"),
        (["100", "200"], r"'200': SECS given twice"),
        (["stock=1", "stock=2"], r"'stock=2': stock given twice"),
        (["n=128=50"], r"unknown rows \['n=128'\]"),
    ],
)
def test_bad_max_row_secs_are_refused_when_the_flags_are_parsed(entries, match):
    with pytest.raises(flags.ValidationError, match=match):
        bench._check_max_row_secs(entries)


def test_calibration_rows_are_the_unlimited_ones_but_single():
    f = types.SimpleNamespace(calibration_secs=60.0)
    assert bench._calibration(f, "unlimited", "stock")
    assert not bench._calibration(f, "unlimited", "single")
    assert not bench._calibration(f, "1gbit", "stock")
    assert not bench._calibration(
        types.SimpleNamespace(calibration_secs=None), "unlimited", "stock"
    )
    assert bench._check_calibration(
        {"calibration_secs": 60.0, "nic_rates": ["unlimited", "1gbit"]}
    )
    assert bench._check_calibration(
        {"calibration_secs": None, "nic_rates": ["unlimited"]}
    )


@pytest.mark.parametrize(
    "secs, rates, match",
    [
        (
            60.0,
            ["1gbit"],
            r"--calibration_secs=60.0 .* must hold unlimited and a shaped rate. "
            r"Received: 1gbit",
        ),
        (60.0, ["unlimited"], r"Received: unlimited$"),
        (0.0, ["unlimited", "1gbit"], r"> 0. Received: 0.0"),
        (math.inf, ["unlimited", "1gbit"], r"> 0. Received: inf"),
    ],
)
def test_bad_calibration_secs_are_refused_when_the_flags_are_parsed(secs, rates, match):
    with pytest.raises(flags.ValidationError, match=match):
        bench._check_calibration({"calibration_secs": secs, "nic_rates": rates})


@pytest.mark.parametrize(
    "name, base, slowdown",
    [
        ("n=16+outer", "n=16+outer", None),
        ("n=16+outer/straggler=4", "n=16+outer", 4.0),
        ("n=16+outer+damp/straggler=4", "n=16+outer+damp", 4.0),
        ("n=1/straggler=1.5", "n=1", 1.5),
    ],
)
def test_straggler_rows(name, base, slowdown):
    """A Downpour row with `/straggler=<k>`: the same row, its last worker `k`
    times slower."""
    assert bench._straggler(name) == (base, slowdown)
    assert bench._row_kind(name) == bench._row_kind(base)
    assert bench._check_rows([name])


@pytest.mark.parametrize(
    "name, match",
    [
        ("n=16/straggler=0.5", r"'n=16/straggler=0.5'.*must be a number >= 1.*'0.5'"),
        ("n=16/straggler=x", r"must be a number >= 1\. Received: 'x'"),
        ("n=16/straggler=inf", r"must be a number >= 1\. Received: 'inf'"),
        ("stock/straggler=4", r"only Downpour rows \(n=\.\.\.\) take /straggler="),
        ("n=128/straggler=4", r"unknown \['n=128/straggler=4'\]"),
    ],
)
def test_bad_straggler_rows_are_refused_when_the_flags_are_parsed(name, match):
    with pytest.raises(flags.ValidationError, match=match):
        bench._check_rows([name])


@pytest.mark.parametrize(
    "stop_at,epochs_run,stopped",
    [(0.2, 1, True), (0.5, 2, True), (0.95, 4, False), (None, 4, False)],
)
def test_a_row_stops_at_its_first_evaluation_at_the_target(
    stop_at, epochs_run, stopped
):
    import numpy as np
    import tf_keras

    # The accuracies the evaluation returns: before training, then after
    # each interval (epoch).
    accuracies = iter([0.1, 0.3, 0.6, 0.7, 0.9])
    probe = bench._Probe(False, [os.getpid()], lambda: next(accuracies), None, stop_at)
    model = tf_keras.Sequential([tf_keras.layers.Dense(2, input_shape=(3,))])
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 3)), rng.normal(size=(32, 2))
    history = model.fit(
        x,
        y,
        epochs=4,
        steps_per_epoch=2,
        batch_size=16,
        callbacks=[probe.callback],
        verbose=0,
    )
    assert len(history.epoch) == epochs_run
    assert len(probe.epoch_secs) == epochs_run
    assert probe.accuracies == [0.1, 0.3, 0.6, 0.7, 0.9][: epochs_run + 1]
    assert probe.stopped_at_target is stopped
    assert {"begin", "first", "last"} <= set(probe.snaps)
    if epochs_run == 1:
        # The window is the first interval, which no evaluation ran inside.
        assert probe.window() == (probe.snaps["begin"], probe.snaps["first"])
        assert all(secs == 0 for secs in probe.eval_cpu.values()), probe.eval_cpu
    # Time to accuracy reads the crossing off the curve.
    assert [a for _, a in probe.curve()] == probe.accuracies
