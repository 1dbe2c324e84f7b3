"""CSV tables and PNG figures of the benchmarks (matplotlib, Agg backend).

Every benchmark in this folder prints its table and, with `--out_dir` (default
`benchmarks/results/`), also writes its numbers as CSV and its figures as PNG
through these functions. They take plain tables (lists of rows or of points),
so that a figure can be redrawn from a CSV and tested from a small fixed
table (tests/bench/test_bench_plots.py).

The figures follow Dean et al. 2012, section 5: Figure 4 plots test accuracy
against wall-clock training time, one line per method; Figure 5 plots the time
to reach a fixed test accuracy against the resources used.
"""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Iterable, Mapping, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where the committed figures of README.md live.
DEFAULT_OUT_DIR = os.path.join(ROOT, "benchmarks", "results")
# Small files: 100 dpi at 6.4 x 4 inches is 640 x 400 pixels, about 30-60 KB.
_DPI = 100
_FIGSIZE = (6.4, 4.0)


def _pyplot():
    """matplotlib's pyplot on the Agg backend (no display, PNG only)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def write_csv(path: str, header: Sequence[str], rows: Iterable[Sequence]) -> str:
    """Writes `rows` under `header` as CSV; returns `path`.

    Floats are written with `repr` precision by the csv module; the folder is
    made if missing.

    Args:
      path: the CSV file to write (overwritten).
      header: column names.
      rows: one sequence per row, as long as `header`.

    Returns:
      `path`.

    Raises:
      ValueError: a row's length differs from the header's.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for row in rows:
            if len(row) != len(header):
                raise ValueError(
                    f"A CSV row must have {len(header)} cells ({list(header)}). "
                    f"Received {len(row)}: {list(row)!r}"
                )
            writer.writerow(row)
    return path


def line_plot(
    path: str,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    hline: tuple[float, str] | None = None,
    logy: bool = False,
    note: str = "",
    xticks: Sequence[float] | None = None,
    logx: bool = False,
    xticklabels: Sequence[str] | None = None,
) -> str:
    """One line with markers per series, in the given order; returns `path`.

    Args:
      path: the PNG to write (overwritten; the folder is made if missing).
      series: `{label: (xs, ys)}`, equal lengths per series.
      title, xlabel, ylabel: the figure's texts (units in the labels).
      hline: `(y, label)` of a dashed horizontal line (e.g. a target accuracy).
      logy: a logarithmic y axis.
      note: a small text under the plot (e.g. the machine's load).
      xticks: the x axis ticks, or None for matplotlib's.
      logx: a logarithmic x axis.
      xticklabels: with `xticks`, their labels.

    Returns:
      `path`.

    Raises:
      ValueError: `series` is empty or a series' xs and ys differ in length.
    """
    if not series:
        raise ValueError("Argument `series` must hold at least one line. Received: {}")
    for label, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(
                f"Series {label!r} must have as many x as y values. Received "
                f"{len(xs)} and {len(ys)}."
            )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    for label, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", markersize=3, label=label)
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    if logy:
        ax.set_yscale("log")
    if logx:
        ax.set_xscale("log")
    if xticks is not None:
        ax.set_xticks(list(xticks))
        if xticklabels is not None:
            ax.set_xticklabels(list(xticklabels))
            ax.minorticks_off()
    _finish(fig, ax, path, title, xlabel, ylabel, note)
    plt.close(fig)
    return path


def bar_plot(
    path: str,
    groups: Sequence[str],
    bars: Mapping[str, Sequence[float]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logy: bool = False,
    note: str = "",
    value_format: str = "{:.3g}",
) -> str:
    """Grouped bars: one group per `groups` entry, one bar per `bars` key.

    A NaN value draws no bar and writes "n/a" at its place (e.g. a target
    never reached). Each bar is labelled with its value.

    Args:
      path: the PNG to write (overwritten; the folder is made if missing).
      groups: the x tick labels.
      bars: `{label: values}`, one value per group.
      title, xlabel, ylabel: the figure's texts (units in the labels).
      logy: a logarithmic y axis.
      note: a small text under the plot.
      value_format: how a bar's value is written above it.

    Returns:
      `path`.

    Raises:
      ValueError: `bars` is empty or a value list's length differs from
        `groups`'.
    """
    if not bars:
        raise ValueError("Argument `bars` must hold at least one series. Received: {}")
    for label, values in bars.items():
        if len(values) != len(groups):
            raise ValueError(
                f"Bars {label!r} must have one value per group ({len(groups)}). "
                f"Received {len(values)}."
            )
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    width = 0.8 / len(bars)
    finite = [v for values in bars.values() for v in values if not _missing(v)]
    for k, (label, values) in enumerate(bars.items()):
        xs = [i + (k - (len(bars) - 1) / 2) * width for i in range(len(groups))]
        heights = [0.0 if _missing(v) else v for v in values]
        drawn = ax.bar(xs, heights, width, label=label if len(bars) > 1 else None)
        for x, v, rect in zip(xs, values, drawn):
            if _missing(v):
                rect.set_visible(False)
                y = min(finite) if (logy and finite) else 0.0
                ax.text(x, y, "n/a", ha="center", va="bottom", fontsize=8)
            else:
                ax.text(
                    x, v, value_format.format(v), ha="center", va="bottom", fontsize=8
                )
    ax.set_xticks(range(len(groups)), list(groups))
    if logy:
        ax.set_yscale("log")
    _finish(fig, ax, path, title, xlabel, ylabel, note, legend=len(bars) > 1)
    plt.close(fig)
    return path


def scatter_plot(
    path: str,
    groups: Mapping[str, Sequence[tuple[float, float, str]]],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    hline: tuple[float, str] | None = None,
    vline: tuple[float, str] | None = None,
    logx: bool = False,
    note: str = "",
) -> str:
    """Labelled points, one marker style per group (a Pareto figure); returns
    `path`.

    Args:
      path: the PNG to write (overwritten; the folder is made if missing).
      groups: `{group: [(x, y, label), ...]}`; each point is written with its
        label beside it.
      title, xlabel, ylabel: the figure's texts (units in the labels).
      hline: `(y, label)` of a dashed horizontal line (e.g. the largest gap
        allowed).
      vline: `(x, label)` of a dotted vertical line (e.g. a byte budget).
      logx: a logarithmic x axis.
      note: a small text under the plot.

    Returns:
      `path`.

    Raises:
      ValueError: `groups` is empty.
    """
    if not groups:
        raise ValueError("Argument `groups` must hold at least one group. Received: {}")
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=_FIGSIZE)
    for marker, (group, points) in zip("os^Dv<>", groups.items()):
        xs = [x for x, _, _ in points]
        ys = [y for _, y, _ in points]
        ax.scatter(xs, ys, marker=marker, s=18, label=group)
        for x, y, label in points:
            ax.annotate(
                label, (x, y), xytext=(3, 3), textcoords="offset points", fontsize=7
            )
    if hline is not None:
        ax.axhline(hline[0], color="grey", linestyle="--", linewidth=1, label=hline[1])
    if vline is not None:
        ax.axvline(vline[0], color="grey", linestyle=":", linewidth=1, label=vline[1])
    if logx:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter("")  # Labelled decades only: no overlaps.
    _finish(fig, ax, path, title, xlabel, ylabel, note)
    plt.close(fig)
    return path


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _finish(fig, ax, path, title, xlabel, ylabel, note, legend=True):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if legend and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    if note:
        fig.text(0.01, 0.01, note, fontsize=7, color="dimgrey")
    fig.tight_layout(rect=(0, 0.04 if note else 0, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=_DPI)


def time_to_target(
    secs: Sequence[float], values: Sequence[float], target: float
) -> float:
    """The first time a curve reaches `target`, linearly interpolated.

    The paper's Figure 5 measure: wall-clock time until the test accuracy first
    reaches a fixed value. Between two measured points the accuracy is taken
    to grow linearly.

    Args:
      secs: increasing times of the measurements, seconds.
      values: the accuracy measured at each time.
      target: the accuracy to reach.

    Returns:
      Seconds, or NaN when no point reaches `target`.

    Raises:
      ValueError: `secs` and `values` differ in length.
    """
    if len(secs) != len(values):
        raise ValueError(
            f"`secs` and `values` must have equal lengths. Received {len(secs)} "
            f"and {len(values)}."
        )
    for i, (t, v) in enumerate(zip(secs, values)):
        if v >= target:
            if i == 0 or values[i - 1] >= v:
                return float(t)
            t0, v0 = secs[i - 1], values[i - 1]
            return float(t0 + (t - t0) * (target - v0) / (v - v0))
    return float("nan")


def machine_note() -> str:
    """`cores=N load=a, b, c` of this machine, for a figure's note."""
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    return f"cores={os.cpu_count()} load={load} (shared machine: noisy timings)"
