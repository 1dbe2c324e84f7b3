"""`benchmarks/downpour_bench.py` against the number of replicas (`--num_workers`).

The tables from fixed rows (no cluster), then the benchmark itself on two
worker counts of a real local cluster (slow): its rows, speed-ups, Downpour
staleness, chief CPU per scheduled function and task memory.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import os
import subprocess
import sys
import types

import pytest
from absl import flags

from benchmarks import cluster_counts, downpour_figures, downpour_tables
from tests.fixtures.launch import ROOT

_PATH = os.path.join(ROOT, "benchmarks", "downpour_bench.py")
if "downpour_bench" not in sys.modules:  # Loaded once, for its dataclasses.
    _spec = importlib.util.spec_from_file_location("downpour_bench", _PATH)
    sys.modules["downpour_bench"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["downpour_bench"])
bench = sys.modules["downpour_bench"]


def _row(name, workers, rate, staleness=math.nan, ps=4):
    return downpour_tables.Row(
        model="speech",
        name=name,
        examples_per_sec=rate,
        socket_bytes_per_example=100.0,
        tensor_bytes_per_example=100.0,
        cpu_ms_per_step={"chief": 1.0},
        test_accuracy=0.2,
        test_loss=1.0,
        wall_secs=1.0,
        num_workers=workers,
        num_ps=ps,
        staleness_mean=staleness,
        staleness_max=2 * staleness,
        chief_cpu_ms_per_function=12.5,
        memory_mb={"chief": 900.0, "ps": 300.0, "worker": 400.0},
    )


def test_speedup_is_over_the_same_row_at_the_fewest_workers():
    rows = [
        _row("single", 1, 3000.0),
        _row("stock", 4, 400.0),
        _row("stock", 2, 200.0),
        _row("n=64+outer", 2, 1000.0, 0.5),
        _row("n=64+outer", 4, 1500.0, 1.5),
        _row("stock", 4, 900.0, ps=1),
    ]
    result = downpour_tables.replica_rows(rows)
    assert [(r.name, r.num_ps, r.num_workers, r.replica_speedup) for r in result] == [
        ("stock", 4, 2, 1.0),
        ("stock", 4, 4, 2.0),
        ("n=64+outer", 4, 2, 1.0),
        ("n=64+outer", 4, 4, 1.5),
        ("stock", 1, 4, 1.0),
    ]
    lines = downpour_tables.format_replicas(result, "header").splitlines()
    assert lines[0] == "header"
    cells = [c.strip() for c in lines[-2].strip("|").split("|")]
    # model, nic, ps, row, workers, ex/s, x fewest, secs, examples, staleness
    # mean and max, B/ex, chief CPU ms/function, chief, ps, worker MB.
    assert cells[:7] == ["speech", "unlimited", "4", "n=64+outer", "4", "1500", "1.50"]
    assert cells[9:] == ["1.50", "3", "100", "12.5", "900", "300", "400"]
    stock = [c.strip() for c in lines[4].strip("|").split("|")]
    assert stock[9:11] == ["-", "-"]  # No Downpour, no push staleness.


def test_replica_csv_and_figure(tmp_path):
    rows = downpour_tables.replica_rows(
        [_row("stock", w, 100.0 * w**0.5) for w in (1, 2, 4)]
    )
    path = downpour_tables.write_replicas_csv(str(tmp_path / "r.csv"), rows)
    with open(path, newline="") as f:
        table = list(csv.DictReader(f))
    assert [t["num_workers"] for t in table] == ["1", "2", "4"]
    assert float(table[2]["x_fewest_workers"]) == pytest.approx(2.0)
    assert table[0]["worker_pss_mb"] == "400.0"
    png = downpour_figures.speedup_figure(str(tmp_path / "s.png"), rows)
    assert os.path.getsize(png) > 1000


def test_evaluation_steps_scale_with_the_workers():
    f = types.SimpleNamespace(
        eval_every=None, steps=None, quick=False, steps_per_execution=20
    )
    # Each worker runs as many steps as at 2 workers (speech: 160 / 2).
    assert [bench._eval_every(f, "speech", w) for w in (1, 2, 8)] == [80, 160, 640]
    assert bench._intervals(f, "speech", 8) == bench._intervals(f, "speech") == 10
    assert bench._clusters(
        types.SimpleNamespace(num_workers=["1", "4"], num_ps=["2", "4"])
    ) == [(1, 2), (4, 2), (1, 4), (4, 4)]


@pytest.mark.parametrize("values", [["0"], ["2", "x"], ["2", "2"], []])
def test_bad_worker_counts_are_refused_when_the_flags_are_parsed(values):
    with pytest.raises(
        flags.ValidationError, match=r"--num_workers must list integers >= 1, each once"
    ):
        cluster_counts.check_counts("num_workers")(values)


def test_sandblaster_scaling_table():
    from benchmarks import sandblaster_bench

    def run(workers, straggler, secs):
        return {
            "workers": workers,
            "ps": 2,
            "straggler": straggler,
            "secs_per_iter": secs,
            "evals_per_iter": 1.25,
            "ps_trips_per_iter": 15.0,
            "functions_per_iter": 20.0,
            "cpu_ms_per_iter": 90.0,
            "loss": 0.5,
        }

    header, rows = sandblaster_bench._scaling_table(
        [run(1, None, 2.0), run(2, None, 1.0), run(2, 5.0, 1.6)]
    )
    assert header[3:6] == ["secs/iter", "x fewest", "x no straggler"]
    assert [r[1:6] for r in rows] == [
        ["1", "-", "2.000", "1.00", "-"],
        ["2", "-", "1.000", "2.00", "-"],
        ["2", "last 5x slower", "1.600", "1.25", "1.60"],
    ]
    with pytest.raises(flags.ValidationError, match=r"--num_ps must list .* 1,0"):
        cluster_counts.check_counts("num_ps")(["1", "0"])


@pytest.mark.slow
def test_the_benchmark_on_one_and_two_workers(tmp_path):
    """Digits, stock and Downpour, on 1 and then 2 workers (1 ps), a few steps."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            _PATH,
            "--models=digits",
            "--rows=stock,n=4+outer",
            "--num_workers=1,2",
            "--num_ps=1",
            "--rounds=1",
            "--eval_every=40",
            "--steps=80",
            "--steps_per_execution=10",
            "--target_accuracy=0.5",
            "--throughput_table=false",
            f"--out_dir={out}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "speed-up against replicas" in proc.stdout
    with open(out / "downpour_replicas.csv", newline="") as f:
        table = {(t["row"], int(t["num_workers"])): t for t in csv.DictReader(f)}
    assert sorted(table) == [
        ("n=4+outer", 1),
        ("n=4+outer", 2),
        ("stock", 1),
        ("stock", 2),
    ]
    for (name, workers), t in table.items():
        assert float(t["examples_per_sec"]) > 0, t
        assert float(t["socket_bytes_per_example"]) > 0, t
        # One function per 10 steps: the chief spends some CPU on each.
        assert 0 < float(t["chief_cpu_ms_per_function"]) < 1000, t
        for kind in ("chief", "ps", "worker"):
            assert float(t[f"{kind}_pss_mb"]) > 10, (kind, t)
        speedup = float(t["x_fewest_workers"])
        assert speedup == 1.0 if workers == 1 else speedup > 0, t
        mean, most = float(t["staleness_mean"]), float(t["staleness_max"])
        if name == "stock":
            assert math.isnan(mean) and math.isnan(most), t
        elif workers == 1:
            assert mean == most == 0, t  # No other replica pushes.
        else:
            assert 0 <= mean <= most, t
    for workers in (1, 2):
        folder = out / f"workers_{workers}_ps_1"
        assert (folder / "downpour_time_to_accuracy.csv").is_file()
    assert (out / "downpour_digits_replicas_unlimited_ps1.png").is_file()
