"""The tables of `benchmarks/downpour_bench.py`: its rows, medians over rounds, formats.

Pure functions of the rows (no TensorFlow, no cluster), tested from small fixed
tables (tests/bench/test_downpour_bench.py, test_downpour_replicas.py). A row
is one configuration (the `single`, `stock`, `n=<n>[+rule]` rows of the
benchmark) at one NIC rate (`nic`, `"unlimited"` on the bare loopback) on one
cluster (`num_workers`, `num_ps`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from benchmarks import downpour_figures, plots

UNLIMITED = "unlimited"


@dataclasses.dataclass
class Row:
    """One row's measurements (one round, or medians over rounds)."""

    model: str
    name: str
    examples_per_sec: float  # Median over the evaluation intervals after the first.
    socket_bytes_per_example: float
    tensor_bytes_per_example: float
    cpu_ms_per_step: dict  # {"chief"|"worker"|"ps": CPU ms per step}.
    test_accuracy: float  # After all steps: equal examples for every row.
    test_loss: float
    wall_secs: float
    # Examples/s over the same round's stock row, median over rounds (set by
    # `median_rows`); None: the ratio of the rates.
    speedup: float | None = None
    # `(training secs, test accuracy)` before training and after every
    # `--eval_every` steps; the seconds leave the evaluations out (medians
    # over rounds after `median_rows`).
    curve: list = dataclasses.field(default_factory=list)
    # Training seconds and examples to first reach `target` (linear between
    # evaluations; NaN: not reached), medians over rounds after `median_rows`
    # (a round that did not reach it counts as the slowest).
    target: float = math.nan
    secs_to_target: float = math.nan
    examples_to_target: float = math.nan
    # After `median_rows`: `{field: (min, max)}` over rounds of
    # `secs_to_target`, `examples_to_target`, `test_accuracy`; and the
    # rounds that reached the target.
    spread: dict = dataclasses.field(default_factory=dict)
    reached: int = 0
    rounds: int = 1
    # The NIC rate of every task (`--nic_rates`), `"unlimited"`: no shaping.
    nic: str = UNLIMITED
    # Trainable parameters of the model (float32), for the planner.
    num_params: int = 0
    # `--max_row_secs`: the training seconds at which the row was cut off
    # (after the evaluation interval that passed the limit); NaN: ran all steps.
    cut_off_secs: float = math.nan
    # The cluster (`--num_workers`, `--num_ps`); `single` has 1 worker, no ps.
    num_workers: int = 2
    num_ps: int = 1
    # Downpour's push staleness (ps updates by other replicas between a
    # replica's fetch and its push, `ReplicaStats`): the mean over the pushes
    # of the measured window, the largest of the whole row; NaN for a row
    # without Downpour.
    staleness_mean: float = math.nan
    staleness_max: float = math.nan
    # The chief's CPU milliseconds (evaluations left out) per function the
    # coordinator ran on the workers in the measured window; NaN for `single`.
    chief_cpu_ms_per_function: float = math.nan
    # `{"chief"|"ps"|"worker": MB}`: the largest proportional set size of a
    # task of each kind at the end of the row (`benchmarks.task_memory`).
    memory_mb: dict = dataclasses.field(default_factory=dict)
    # Examples/s over the same row's (model, NIC, ps, name) at the fewest
    # workers of the run (set by `replica_rows`; NaN before).
    replica_speedup: float = math.nan


def to_target(curve, examples_per_point: float, target: float) -> tuple[float, float]:
    """`(secs, examples)` to first reach `target` on `curve` (NaN: never).

    Args:
      curve: `[(training secs, test accuracy)]`, point k after
        `k * examples_per_point` training examples.
      examples_per_point: examples between two points.
      target: the test accuracy to reach.

    Returns:
      Seconds and examples, each linearly interpolated between the two points
      around the first crossing (`plots.time_to_target`).
    """
    accs = [a for _, a in curve]
    secs = plots.time_to_target([t for t, _ in curve], accs, target)
    examples = plots.time_to_target(
        [k * examples_per_point for k in range(len(curve))], accs, target
    )
    return secs, examples


def _max_finite(values: list[float]) -> float:
    """The largest of `values` that is not NaN; NaN when all are."""
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _median_reached(values: list[float]) -> float:
    """Median where NaN (not reached) counts as slower than any round; NaN if so."""
    value = statistics.median(math.inf if math.isnan(v) else v for v in values)
    return math.nan if math.isinf(value) else value


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per `(model, nic, name)`, first-seen order: medians over rounds.

    The rows of one cluster (`num_workers`, `num_ps`); `replica_rows` takes
    rows of several.

    `speedup` is the median over rounds of each round's examples/s over that
    round's stock examples/s (the i-th row of a configuration is round i): the
    two ran side by side, so a load change between rounds cancels out. The
    time to the target is the median over rounds, a round that did not reach
    it counting as the slowest; `spread` holds min and max over rounds.
    """
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.nic, r.name), []).append(r)
    result = []
    for (model, nic, name), group in groups.items():
        stock = groups.get((model, nic, "stock"), group)
        speedup = statistics.median(
            r.examples_per_sec / s.examples_per_sec for r, s in zip(group, stock)
        )

        def med(key, group=group):
            return statistics.median(getattr(r, key) for r in group)

        def spread(key, group=group):
            values = [getattr(r, key) for r in group]
            finite = [v for v in values if not math.isnan(v)]
            high = max(finite) if len(finite) == len(values) else math.nan
            return (min(finite) if finite else math.nan, high)

        roles = {k for r in group for k in r.cpu_ms_per_step}
        result.append(
            Row(
                model=model,
                name=name,
                examples_per_sec=med("examples_per_sec"),
                socket_bytes_per_example=med("socket_bytes_per_example"),
                tensor_bytes_per_example=med("tensor_bytes_per_example"),
                cpu_ms_per_step={
                    k: statistics.median(r.cpu_ms_per_step.get(k, 0.0) for r in group)
                    for k in sorted(roles)
                },
                test_accuracy=med("test_accuracy"),
                test_loss=med("test_loss"),
                wall_secs=sum(r.wall_secs for r in group),
                speedup=speedup,
                curve=downpour_figures.median_curve([r.curve for r in group]),
                target=group[0].target,
                secs_to_target=_median_reached([r.secs_to_target for r in group]),
                examples_to_target=_median_reached(
                    [r.examples_to_target for r in group]
                ),
                spread={
                    k: spread(k)
                    for k in ("secs_to_target", "examples_to_target", "test_accuracy")
                },
                reached=sum(r.reached for r in group),
                rounds=len(group),
                nic=nic,
                num_params=group[0].num_params,
                cut_off_secs=max(r.cut_off_secs for r in group),
                num_workers=group[0].num_workers,
                num_ps=group[0].num_ps,
                staleness_mean=med("staleness_mean"),
                staleness_max=_max_finite([r.staleness_max for r in group]),
                chief_cpu_ms_per_function=med("chief_cpu_ms_per_function"),
                memory_mb={
                    k: max(r.memory_mb.get(k, 0.0) for r in group)
                    for k in sorted({k for r in group for k in r.memory_mb})
                },
            )
        )
    return result


def _fmt(value: float, fmt: str) -> str:
    return "not reached" if math.isnan(value) else format(value, fmt)


def _fmt_range(low: float, high: float, fmt: str) -> str:
    return f"{_fmt(low, fmt)}-{'n.r.' if math.isnan(high) else format(high, fmt)}"


def any_shaped(rows) -> bool:
    """True when some row ran behind an emulated NIC."""
    return any(r.nic != UNLIMITED for r in rows)


def _secs_to_target(r) -> str:
    if math.isnan(r.secs_to_target) and not math.isnan(r.cut_off_secs):
        return f"not reached in {r.cut_off_secs:.0f} s"
    return _fmt(r.secs_to_target, ".1f")


def format_headline(rows: list[Row], header: str) -> str:
    """The time-to-accuracy table, Markdown: medians over rounds, [min-max].

    `x stock`, `x single`: seconds to the target over the `stock` and `single`
    rows' (of the same model, medians); `B x stock`: socket bytes per example
    over stock's; `acc vs n=1`: final test accuracy minus the `n=1` row's, in
    points (equal examples). Stock and `n=1` are those of the row's NIC rate,
    `single` the model's (it has no network). With any NIC shaped a `nic`
    column follows `model`; a row cut off by `--max_row_secs` before the
    target reads "not reached in T s".
    """
    shaped = any_shaped(rows)
    lines = [
        header,
        "",
        "| model | "
        + ("nic | " if shaped else "")
        + "row | target | secs to target | examples to target | reached "
        "| x stock | x single | final acc | acc vs n=1 | ex/s | x stock ex/s "
        "| x single ex/s | B/ex | B x stock |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|" if shaped else ""),
    ]
    by_name = {(r.model, r.nic, r.name): r for r in rows}
    singles = {r.model: r for r in rows if r.name == "single"}
    for r in rows:
        stock = by_name.get((r.model, r.nic, "stock"))
        single = singles.get(r.model)
        n1 = by_name.get((r.model, r.nic, "n=1"))
        lo, hi = r.spread.get("secs_to_target", (r.secs_to_target,) * 2)
        elo, ehi = r.spread.get("examples_to_target", (r.examples_to_target,) * 2)
        alo, ahi = r.spread.get("test_accuracy", (r.test_accuracy,) * 2)

        def ratio(value, base, fmt=".2f"):
            if base is None or math.isnan(value) or math.isnan(base) or not base:
                return "-"
            return _fmt(value / base, fmt)

        diff = "-"
        if n1 is not None:
            diff = f"{100 * (r.test_accuracy - n1.test_accuracy):+.1f}"
        lines.append(
            "| "
            + " | ".join(
                [
                    r.model,
                    *([r.nic] if shaped else []),
                    r.name,
                    f"{r.target:.3f}",
                    f"{_secs_to_target(r)} [{_fmt_range(lo, hi, '.1f')}]",
                    f"{_fmt(r.examples_to_target, '.0f')} "
                    f"[{_fmt_range(elo, ehi, '.0f')}]",
                    f"{r.reached}/{r.rounds}",
                    ratio(r.secs_to_target, stock and stock.secs_to_target),
                    ratio(r.secs_to_target, single and single.secs_to_target),
                    f"{r.test_accuracy:.4f} [{alo:.4f}-{ahi:.4f}]",
                    diff,
                    f"{r.examples_per_sec:.0f}",
                    ratio(r.examples_per_sec, stock and stock.examples_per_sec),
                    ratio(r.examples_per_sec, single and single.examples_per_sec),
                    f"{r.socket_bytes_per_example:.0f}",
                    ratio(
                        r.socket_bytes_per_example,
                        stock and stock.socket_bytes_per_example,
                        ".3f",
                    ),
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def write_headline_csv(path: str, rows: list[Row]) -> str:
    """The headline table as CSV (one line per row, medians and min/max)."""
    fields = ("secs_to_target", "examples_to_target", "test_accuracy")
    return plots.write_csv(
        path,
        [
            "model",
            "nic",
            "row",
            "target",
            "secs_to_target",
            "secs_min",
            "secs_max",
            "examples_to_target",
            "examples_min",
            "examples_max",
            "test_accuracy",
            "acc_min",
            "acc_max",
            "reached",
            "rounds",
            "examples_per_sec",
            "socket_bytes_per_example",
            "cut_off_secs",
        ],
        [
            [
                r.model,
                r.nic,
                r.name,
                r.target,
                *[
                    v
                    for k in fields
                    for v in (getattr(r, k), *r.spread.get(k, (math.nan,) * 2))
                ],
                r.reached,
                r.rounds,
                r.examples_per_sec,
                r.socket_bytes_per_example,
                r.cut_off_secs,
            ]
            for r in rows
        ],
    )


def format_table(rows: list[Row], header: str) -> str:
    """The results table; ratios are to the `stock` row of the same model and NIC.

    `x stock` is `Row.speedup` where set, else the ratio of examples/s. With
    any NIC shaped a last column names the row's NIC rate.
    """
    shaped = any_shaped(rows)
    lines = [
        header,
        f"{'model':6} {'config':6} {'ex/s':>7} {'x stock':>7} {'sock B/ex':>10} "
        f"{'tensor B/ex':>11} {'B x stock':>9} {'CPU ms/step':>11} {'test acc':>8} "
        f"{'test loss':>9}" + (f" {'nic':>9}" if shaped else ""),
    ]
    stock = {(r.model, r.nic): r for r in rows if r.name == "stock"}
    for r in rows:
        base = stock.get((r.model, r.nic), r)
        speedup = r.speedup
        if speedup is None:
            speedup = r.examples_per_sec / base.examples_per_sec
        # "-" where the base moved no bytes (`single`, with no stock row).
        moved = base.socket_bytes_per_example
        ratio = f"{r.socket_bytes_per_example / moved:9.3f}" if moved else f"{'-':>9}"
        lines.append(
            f"{r.model:6} {r.name:6} {r.examples_per_sec:7.0f} {speedup:7.2f} "
            f"{r.socket_bytes_per_example:10.0f} {r.tensor_bytes_per_example:11.0f} "
            f"{ratio} "
            f"{sum(r.cpu_ms_per_step.values()):11.1f} {r.test_accuracy:8.4f} "
            f"{r.test_loss:9.3f}" + (f" {r.nic:>9}" if shaped else "")
        )
    return "\n".join(lines)


# --- Speed-up against replicas ---------------------------------------------------


def replica_rows(rows: list[Row]) -> list[Row]:
    """The cluster rows (not `single`) with `replica_speedup` set, in order.

    Args:
      rows: medians over rounds (`median_rows`) of one or more clusters.

    Returns:
      Copies of the rows but `single`, ordered by model, NIC, ps count, row
      name (first seen) and worker count; `replica_speedup` is each row's
      examples/s over those of the same model, NIC, ps count and name at the
      fewest workers (1.0 there).
    """
    rows = [r for r in rows if r.name != "single"]
    keys = list(dict.fromkeys((r.model, r.nic, r.num_ps, r.name) for r in rows))
    result = []
    for key in keys:
        group = sorted(
            (r for r in rows if (r.model, r.nic, r.num_ps, r.name) == key),
            key=lambda r: r.num_workers,
        )
        base = group[0].examples_per_sec
        for r in group:
            speedup = r.examples_per_sec / base if base else math.nan
            result.append(dataclasses.replace(r, replica_speedup=speedup))
    return result


_MEMORY_KINDS = ("chief", "ps", "worker")


def format_replicas(rows: list[Row], header: str) -> str:
    """The speed-up against replicas, Markdown: one line per row and worker count.

    Args:
      rows: `replica_rows`'s.
      header: the line above the table (the run's settings).

    Returns:
      Columns: the row's cluster and name; examples/s and `x fewest` (its
      `replica_speedup`); seconds and examples to the target, medians over
      rounds with [min-max]; Downpour's push staleness, mean and max ("-"
      without Downpour); socket bytes per example; the chief's CPU ms per
      scheduled function; the largest PSS (MB) of the chief, a ps task and a
      worker task.
    """
    lines = [
        header,
        "",
        "| model | nic | ps | row | workers | ex/s | x fewest | secs to target "
        "| examples to target | staleness mean | staleness max | B/ex "
        "| chief CPU ms/function | chief MB | ps MB | worker MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r.spread.get("secs_to_target", (r.secs_to_target,) * 2)
        elo, ehi = r.spread.get("examples_to_target", (r.examples_to_target,) * 2)
        stale = not math.isnan(r.staleness_mean)
        cpu = r.chief_cpu_ms_per_function
        cells = [
            r.model,
            r.nic,
            str(r.num_ps),
            r.name,
            str(r.num_workers),
            f"{r.examples_per_sec:.0f}",
            _fmt(r.replica_speedup, ".2f"),
            f"{_secs_to_target(r)} [{_fmt_range(lo, hi, '.1f')}]",
            f"{_fmt(r.examples_to_target, '.0f')} [{_fmt_range(elo, ehi, '.0f')}]",
            f"{r.staleness_mean:.2f}" if stale else "-",
            f"{r.staleness_max:.0f}" if stale else "-",
            f"{r.socket_bytes_per_example:.0f}",
            "-" if math.isnan(cpu) else f"{cpu:.1f}",
            *(
                f"{r.memory_mb[k]:.0f}" if k in r.memory_mb else "-"
                for k in _MEMORY_KINDS
            ),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_replicas_csv(path: str, rows: list[Row]) -> str:
    """`format_replicas`'s table as CSV (NaN where a figure does not apply)."""
    return plots.write_csv(
        path,
        [
            "model",
            "nic",
            "num_ps",
            "row",
            "num_workers",
            "examples_per_sec",
            "x_fewest_workers",
            "secs_to_target",
            "secs_min",
            "secs_max",
            "examples_to_target",
            "examples_min",
            "examples_max",
            "rounds",
            "staleness_mean",
            "staleness_max",
            "socket_bytes_per_example",
            "chief_cpu_ms_per_function",
            *(f"{k}_pss_mb" for k in _MEMORY_KINDS),
        ],
        [
            [
                r.model,
                r.nic,
                r.num_ps,
                r.name,
                r.num_workers,
                r.examples_per_sec,
                r.replica_speedup,
                r.secs_to_target,
                *r.spread.get("secs_to_target", (math.nan,) * 2),
                r.examples_to_target,
                *r.spread.get("examples_to_target", (math.nan,) * 2),
                r.rounds,
                r.staleness_mean,
                r.staleness_max,
                r.socket_bytes_per_example,
                r.chief_cpu_ms_per_function,
                *(r.memory_mb.get(k, math.nan) for k in _MEMORY_KINDS),
            ]
            for r in rows
        ],
    )
