"""The tables of `benchmarks/downpour_bench.py`: its rows, medians over rounds, formats.

Pure functions of the rows (no TensorFlow, no cluster), tested from small fixed
tables (tests/bench/test_downpour_bench.py). A row is one configuration (the
`single`, `stock`, `n=<n>[+rule]` rows of the benchmark) at one NIC rate
(`nic`, `"unlimited"` on the bare loopback).
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


def _median_reached(values: list[float]) -> float:
    """Median where NaN (not reached) counts as slower than any round; NaN if so."""
    value = statistics.median(math.inf if math.isnan(v) else v for v in values)
    return math.nan if math.isinf(value) else value


def median_rows(rows: list[Row]) -> list[Row]:
    """One row per `(model, nic, name)`, first-seen order: medians over rounds.

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
