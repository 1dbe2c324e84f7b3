"""`benchmarks/digits_replicas.py`'s table from fixed runs; no cluster."""

from __future__ import annotations

from benchmarks import digits_replicas


def _run(workers, seed, acc, left=0):
    return {
        "workers": workers,
        "staleness_power": 0.75,
        "seed": seed,
        "acc": acc,
        "train s": 20.0 + seed,
        "start-up s": 10.0,
        "wall s": 60.0,
        "chief MB": 400 + seed,
        "ps MB": 150,
        "worker MB": 140,
        "worker RSS MB": 450,
        "left": left,
    }


def _cells(line):
    assert line.startswith("| ") and line.endswith(" |"), line
    return line[2:-2].split(" | ")


def test_header_separator_and_rows_have_one_cell_per_column():
    rows = [_run(2, 0, 0.973), _run(2, 1, None), _run(8, 0, 0.956, left=1)]
    lines = digits_replicas.table(rows, [2, 8], [0.75])
    header, separator, *body = lines
    assert tuple(_cells(header)) == digits_replicas.COLUMNS
    assert len(_cells(separator)) == len(digits_replicas.COLUMNS)
    assert len(body) == 2
    for line in body:
        assert len(_cells(line)) == len(digits_replicas.COLUMNS), line
    two = dict(zip(digits_replicas.COLUMNS, _cells(body[0])))
    assert two["acc (each run)"] == "0.973, failed"
    assert two["min acc"] == "0.973"
    assert two["train s"] == "20.5"
    assert two["chief MB"] == "401"
    assert two["worker RSS MB"] == "450"
    assert two["left"] == "0"
    assert dict(zip(digits_replicas.COLUMNS, _cells(body[1])))["left"] == "1"
