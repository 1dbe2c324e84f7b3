"""CSV and PNG output of `benchmarks/downpour_bench.py` (Dean et al. 2012, section 5).

Pure functions of the benchmark's rows (`downpour_bench.Row`: any object with
the fields `model`, `name`, `examples_per_sec`, `speedup`,
`socket_bytes_per_example`, `tensor_bytes_per_example`, `cpu_ms_per_step`,
`test_accuracy`, `test_loss` and `curve`), so that they run and are tested
without a cluster (tests/bench/test_bench_plots.py). Run as a script, it redraws the
figures from the CSVs of an earlier run:

  python benchmarks/downpour_figures.py [out_dir]
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import sys
import types
from collections.abc import Sequence

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import plots  # noqa: E402


def median_curve(curves: Sequence[Sequence[tuple[float, float]]]) -> list:
    """The point-by-point median of several rounds' curves.

    Args:
      curves: per round, `[(training secs, test accuracy), ...]` measured at the
        same epochs (round i's k-th point is after epoch k).

    Returns:
      `[(median secs, median accuracy), ...]`, as long as the shortest curve;
      `[]` for no curves.
    """
    curves = [c for c in curves if c]
    if not curves:
        return []
    length = min(len(c) for c in curves)
    return [
        (
            statistics.median(c[k][0] for c in curves),
            statistics.median(c[k][1] for c in curves),
        )
        for k in range(length)
    ]


def default_target(rows) -> float:
    """The best test accuracy every configuration reached (on its curve).

    A time to this accuracy exists for every configuration, so the Figure 5
    form compares them all. Rows without a curve count with their final
    accuracy.
    """
    return min(max((a for _, a in r.curve), default=r.test_accuracy) for r in rows)


def write_outputs(out_dir, rows, round_rows, header, target_accuracy=None):
    """Writes the CSVs and, per model, the three figures; returns their paths.

    Args:
      out_dir: the output folder (made if missing).
      rows: one row per `(model, configuration)` (`downpour_bench.median_rows`).
      round_rows: `[(round index, row), ...]`, every round's own row.
      header: the table's header line (machine, cluster, epochs), noted in
        the CSV's first column and under the figures.
      target_accuracy: the accuracy of the time-to-target figure: a float
        for every model, `{model: float}` per model, or None for
        `default_target` per model.

    Returns:
      The paths written: `downpour.csv`, `downpour_curves.csv`, then
      `downpour_<model>_{accuracy,time_to_target,bytes}.png` per model.
    """
    # The run's own machine and load, also when redrawn later from the CSVs.
    note = (
        header.split(" workers=")[0] + " (shared machine: noisy timings)"
        if header.startswith("cores=")
        else plots.machine_note()
    )
    models = list(dict.fromkeys(r.model for r in rows))
    targets = {
        m: (
            target_accuracy.get(m)
            if isinstance(target_accuracy, dict)
            else target_accuracy
        )
        or default_target([r for r in rows if r.model == m])
        for m in models
    }
    to_target = {
        (r.model, r.name): plots.time_to_target(
            [t for t, _ in r.curve], [a for _, a in r.curve], targets[r.model]
        )
        for r in rows
    }
    paths = [
        plots.write_csv(
            os.path.join(out_dir, "downpour.csv"),
            [
                "model",
                "config",
                "examples_per_sec",
                "x_stock",
                "socket_bytes_per_example",
                "tensor_bytes_per_example",
                "cpu_ms_per_step",
                "test_accuracy",
                "test_loss",
                "target_accuracy",
                "secs_to_target",
                "setup",
            ],
            [
                [
                    r.model,
                    r.name,
                    r.examples_per_sec,
                    r.speedup,
                    r.socket_bytes_per_example,
                    r.tensor_bytes_per_example,
                    sum(r.cpu_ms_per_step.values()),
                    r.test_accuracy,
                    r.test_loss,
                    targets[r.model],
                    to_target[(r.model, r.name)],
                    header,
                ]
                for r in rows
            ],
        ),
        plots.write_csv(
            os.path.join(out_dir, "downpour_curves.csv"),
            ["model", "config", "round", "epoch", "train_secs", "test_accuracy"],
            [
                [r.model, r.name, k, epoch, secs, acc]
                for k, r in round_rows
                for epoch, (secs, acc) in enumerate(r.curve)
            ],
        ),
    ]
    for model in models:
        model_rows = [r for r in rows if r.model == model]
        names = [r.name for r in model_rows]
        prefix = os.path.join(out_dir, f"downpour_{model}")
        paths.append(
            plots.line_plot(
                f"{prefix}_accuracy.png",
                {
                    r.name: ([t for t, _ in r.curve], [a for _, a in r.curve])
                    for r in model_rows
                },
                title=f"Downpour vs stock training, {model}: accuracy (Figure 4 form)",
                xlabel="training wall-clock seconds (evaluations left out)",
                ylabel="test accuracy",
                hline=(targets[model], f"target {targets[model]:.3f}"),
                note=note,
            )
        )
        paths.append(
            plots.bar_plot(
                f"{prefix}_time_to_target.png",
                names,
                {"secs": [to_target[(model, n)] for n in names]},
                title=(
                    f"{model}: seconds to test accuracy {targets[model]:.3f} "
                    "(Figure 5's measure)"
                ),
                xlabel="configuration (n = n_fetch = n_push)",
                ylabel="training seconds to target",
                note=note,
                value_format="{:.1f}",
            )
        )
        paths.append(
            plots.bar_plot(
                f"{prefix}_bytes.png",
                names,
                {
                    "sockets (gRPC)": [r.socket_bytes_per_example for r in model_rows],
                    "tensors": [r.tensor_bytes_per_example for r in model_rows],
                },
                title=f"{model}: worker<->ps bytes per training example",
                xlabel="configuration (n = n_fetch = n_push)",
                ylabel="bytes per example (log)",
                logy=True,
                note=note,
                value_format="{:,.0f}",
            )
        )
    return paths


def bandwidth_figure(path, rows, rate_bits, note=""):
    """Seconds to the target accuracy against the NIC rate, one line per row.

    Args:
      path: the PNG to write.
      rows: one model's rows (`downpour_tables.Row`) at several NIC rates;
        the `single` row (no network) is a dashed line.
      rate_bits: `nic -> bits/s or None` (`unlimited`, drawn right of the
        fastest rate, at 10 times it).
      note: the machine's line under the figure.

    Returns:
      `path`. A row cut off before the target (`cut_off_secs`) counts as its
      cut-off seconds: a lower bound, said in the title.
    """
    bits = {r.nic: rate_bits(r.nic) for r in rows if r.name != "single"}
    shaped = [b for b in bits.values() if b is not None]
    unlimited_x = 10 * max(shaped) if shaped else 1e11
    xs_of = {nic: unlimited_x if b is None else b for nic, b in bits.items()}
    series = {}
    for r in rows:
        if r.name == "single":
            continue
        secs = r.secs_to_target
        if math.isnan(secs):
            secs = r.cut_off_secs
        xs, ys = series.setdefault(r.name, ([], []))
        xs.append(xs_of[r.nic])
        ys.append(secs)
    cut = {}
    for r in rows:
        if r.name != "single" and math.isnan(r.secs_to_target):
            cut.setdefault(r.name, []).append(_rate_label(xs_of[r.nic]))
    labelled = {}
    for name, (xs, ys) in series.items():
        order = sorted(range(len(xs)), key=xs.__getitem__)
        label = name + (f" (cut off at {', '.join(cut[name])})" if name in cut else "")
        labelled[label] = ([xs[i] for i in order], [ys[i] for i in order])
    series = labelled
    single = next((r for r in rows if r.name == "single"), None)
    hline = None
    if single is not None and not math.isnan(single.secs_to_target):
        hline = (single.secs_to_target, f"single {single.secs_to_target:.1f} s")
    ticks = sorted(set(xs_of.values()))
    labels = [
        "unlimited" if x == unlimited_x and None in bits.values() else _rate_label(x)
        for x in ticks
    ]
    target = rows[0].target
    return plots.line_plot(
        path,
        series,
        title=f"{rows[0].model}: seconds to test accuracy {target:.3f} by NIC rate "
        "(cut off: at least)",
        xlabel="NIC rate of every task, bits/s (log)",
        ylabel="training seconds to target (log)",
        hline=hline,
        logx=True,
        logy=True,
        xticks=ticks,
        xticklabels=labels,
        note=note,
    )


def speedup_figure(path, rows, note=""):
    """Speed-up against model replicas, one line per row, the ideal line drawn.

    The form of Dean et al. 2012's Figure 3 (training speed-up against the
    machines per model instance).

    Args:
      path: the PNG to write.
      rows: one model's rows at one NIC rate and ps count, at several worker
        counts, `replica_speedup` set (`downpour_tables.replica_rows`).
      note: the machine's line under the figure.

    Returns:
      `path`. The ideal line is the worker count over the fewest drawn.
    """
    series = {}
    for r in rows:
        xs, ys = series.setdefault(r.name, ([], []))
        xs.append(r.num_workers)
        ys.append(r.replica_speedup)
    workers = sorted({r.num_workers for r in rows})
    series[f"ideal (workers / {workers[0]})"] = (
        workers,
        [w / workers[0] for w in workers],
    )
    first = rows[0]
    return plots.line_plot(
        path,
        series,
        title=f"{first.model}: speed-up against replicas (NIC {first.nic}, "
        f"{first.num_ps} ps)",
        xlabel="model replicas (workers)",
        ylabel=f"speed-up: examples/s over {workers[0]} worker{'s' * (workers[0] > 1)}",
        xticks=workers,
        note=note,
    )


def _rate_label(bits: float) -> str:
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {unit}"
    return f"{bits:g} bit/s"


def read_outputs(out_dir):
    """`(rows, round_rows, header)` back from `downpour.csv` and `downpour_curves.csv`.

    The rows are namespaces with `write_outputs`'s fields; each row's curve is
    the median of its rounds' curves, as `downpour_bench.median_rows` makes it.
    """
    with open(os.path.join(out_dir, "downpour.csv"), newline="") as f:
        table = list(csv.DictReader(f))
    with open(os.path.join(out_dir, "downpour_curves.csv"), newline="") as f:
        points = list(csv.DictReader(f))
    curves = {}
    for p in points:
        key = (p["model"], p["config"], int(p["round"]))
        curves.setdefault(key, []).append(
            (float(p["train_secs"]), float(p["test_accuracy"]))
        )
    rows, round_rows = [], []
    for t in table:
        own = {k[2]: c for k, c in curves.items() if k[:2] == (t["model"], t["config"])}
        row = types.SimpleNamespace(
            model=t["model"],
            name=t["config"],
            examples_per_sec=float(t["examples_per_sec"]),
            speedup=float(t["x_stock"]),
            socket_bytes_per_example=float(t["socket_bytes_per_example"]),
            tensor_bytes_per_example=float(t["tensor_bytes_per_example"]),
            cpu_ms_per_step={"all": float(t["cpu_ms_per_step"])},
            test_accuracy=float(t["test_accuracy"]),
            test_loss=float(t["test_loss"]),
            curve=median_curve([own[k] for k in sorted(own)]),
        )
        rows.append(row)
        round_rows += [
            (k, types.SimpleNamespace(model=row.model, name=row.name, curve=own[k]))
            for k in sorted(own)
        ]
    return rows, sorted(round_rows, key=lambda kr: kr[0]), table[0]["setup"]


if __name__ == "__main__":
    folder = sys.argv[1] if len(sys.argv) > 1 else plots.DEFAULT_OUT_DIR
    for path in write_outputs(folder, *read_outputs(folder)):
        print(f"wrote {path}")
