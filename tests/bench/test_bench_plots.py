"""The benchmarks' CSV and PNG output (`benchmarks/plots.py`,
`benchmarks/downpour_figures.py`) from small fixed tables; no cluster."""

from __future__ import annotations

import csv
import dataclasses
import math
import struct

import pytest

pytest.importorskip("matplotlib")

from benchmarks import downpour_figures, plots  # noqa: E402

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path):
    """`(width, height)` from a PNG's IHDR chunk, after checking the signature."""
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == _PNG_SIGNATURE
    assert head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def test_line_plot_writes_a_png(tmp_path):
    path = plots.line_plot(
        str(tmp_path / "sub" / "curve.png"),
        {"stock": ([0, 1, 2], [0.1, 0.5, 0.9]), "n=4": ([0, 0.5], [0.1, 0.8])},
        title="t",
        xlabel="s",
        ylabel="acc",
        hline=(0.8, "target"),
        note="note",
    )
    assert _png_size(path) == (640, 400)


def test_bar_plot_draws_missing_values_and_log_axis(tmp_path):
    path = plots.bar_plot(
        str(tmp_path / "bars.png"),
        ["stock", "n=4"],
        {"a": [1000.0, float("nan")], "b": [10.0, 2.0]},
        title="t",
        xlabel="x",
        ylabel="y",
        logy=True,
    )
    assert _png_size(path) == (640, 400)


def test_scatter_plot_labels_points_with_budget_lines(tmp_path):
    path = plots.scatter_plot(
        str(tmp_path / "pareto.png"),
        {
            "after 960": [(37800.0, 0.0, "outer"), (900.0, -4.9, "ef1")],
            "after 2880": [(37800.0, 0.0, "outer"), (300.0, -1.2, "ps1")],
        },
        title="t",
        xlabel="B/ex",
        ylabel="gap",
        hline=(-1.0, "1 point"),
        vline=(1260.0, "budget"),
        logx=True,
    )
    assert _png_size(path) == (640, 400)
    with pytest.raises(ValueError, match=r"`groups` must hold at least one group"):
        plots.scatter_plot("unused.png", {}, title="", xlabel="", ylabel="")


def test_plots_name_the_bad_series():
    with pytest.raises(ValueError, match=r"Series 'a' must have as many x as y"):
        plots.line_plot("unused.png", {"a": ([1], [])}, title="", xlabel="", ylabel="")
    with pytest.raises(ValueError, match=r"Bars 'a' must have one value per group"):
        plots.bar_plot("unused.png", ["g"], {"a": []}, title="", xlabel="", ylabel="")


def test_write_csv_round_trips_and_checks_row_length(tmp_path):
    path = plots.write_csv(str(tmp_path / "t.csv"), ["a", "b"], [[1, 0.25], ["x", ""]])
    with open(path, newline="") as f:
        assert list(csv.reader(f)) == [["a", "b"], ["1", "0.25"], ["x", ""]]
    with pytest.raises(ValueError, match=r"must have 2 cells"):
        plots.write_csv(str(tmp_path / "u.csv"), ["a", "b"], [[1]])


@pytest.mark.parametrize(
    "secs, values, target, expected",
    [
        ([0, 10, 20], [0.1, 0.5, 0.9], 0.7, 15.0),  # Between 10 s and 20 s.
        ([0, 10, 20], [0.1, 0.5, 0.9], 0.5, 10.0),  # Exactly at a point.
        ([0, 10], [0.9, 0.95], 0.8, 0.0),  # Already there at the start.
        ([0, 10, 20], [0.1, 0.95, 0.5], 0.9, 10 * 0.8 / 0.85),  # First crossing.
    ],
)
def test_time_to_target_interpolates_the_first_crossing(secs, values, target, expected):
    assert plots.time_to_target(secs, values, target) == pytest.approx(expected)


def test_time_to_target_never_reached_is_nan():
    assert math.isnan(plots.time_to_target([0, 1], [0.1, 0.2], 0.5))


@dataclasses.dataclass
class _Row:
    model: str
    name: str
    curve: list
    test_accuracy: float
    examples_per_sec: float = 100.0
    speedup: float = 1.0
    socket_bytes_per_example: float = 1000.0
    tensor_bytes_per_example: float = 900.0
    cpu_ms_per_step: dict = dataclasses.field(default_factory=lambda: {"ps": 1.0})
    test_loss: float = 0.5


def test_median_curve_point_by_point_over_rounds():
    curves = [
        [(0, 0.1), (2, 0.5)],
        [(0, 0.2), (4, 0.7), (6, 0.8)],
        [(0, 0.3), (3, 0.6)],
    ]
    assert downpour_figures.median_curve(curves) == [(0, 0.2), (3, 0.6)]
    assert downpour_figures.median_curve([[], []]) == []


def test_downpour_outputs_from_a_fixed_table(tmp_path):
    stock = _Row("digits", "stock", [(0.0, 0.1), (2.0, 0.6), (4.0, 0.9)], 0.9)
    n4 = _Row("digits", "n=4", [(0.0, 0.1), (1.0, 0.5), (2.0, 0.8)], 0.8)
    paths = downpour_figures.write_outputs(
        str(tmp_path), [stock, n4], [(0, stock), (0, n4)], "header"
    )
    names = [p.rpartition("/")[2] for p in paths]
    assert names == [
        "downpour.csv",
        "downpour_curves.csv",
        "downpour_digits_accuracy.png",
        "downpour_digits_time_to_target.png",
        "downpour_digits_bytes.png",
    ]
    for path in paths[2:]:
        assert _png_size(path) == (640, 400)
    with open(paths[0], newline="") as f:
        table = list(csv.DictReader(f))
    # The target is the best accuracy both reached, 0.8: stock gets there
    # between 2 s (0.6) and 4 s (0.9), n=4 at 2 s.
    assert [float(r["target_accuracy"]) for r in table] == [0.8, 0.8]
    assert float(table[0]["secs_to_target"]) == pytest.approx(2 + 2 * 0.2 / 0.3)
    assert float(table[1]["secs_to_target"]) == pytest.approx(2.0)
    with open(paths[1], newline="") as f:
        assert len(list(csv.reader(f))) == 1 + 6
    # Redrawn from the CSVs: the same rows, curves and setup line.
    rows, round_rows, header = downpour_figures.read_outputs(str(tmp_path))
    assert [(r.name, r.curve, r.test_accuracy) for r in rows] == [
        ("stock", stock.curve, 0.9),
        ("n=4", n4.curve, 0.8),
    ]
    assert [(k, r.name) for k, r in round_rows] == [(0, "stock"), (0, "n=4")]
    assert header == "header"


def test_sandblaster_bench_reads_target_runs_and_names_a_bad_entry():
    from absl import flags

    from benchmarks import sandblaster_bench

    assert sandblaster_bench._parse_target_runs(["2x16", "1X4"]) == [(2, 16), (1, 4)]
    for bad in ["2", "2x", "0x4", "2x-1", "twox4", "2x4x1", ""]:
        with pytest.raises(flags.ValidationError, match=f"Received: '{bad}'"):
            sandblaster_bench._check_target_runs(["2x16", bad])
    with pytest.raises(flags.ValidationError, match="at least one"):
        sandblaster_bench._check_target_runs([])
