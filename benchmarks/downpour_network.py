"""The emulated network of `benchmarks/downpour_bench.py`: rates, planner, tables.

`--nic_rates` runs every row behind NICs of each rate (`LocalCluster(
nic_bandwidth=...)`, `tf_distbelief.cluster.network`); this module reads the
rates, decides before TensorFlow loads whether the benchmark must enter the
private network namespace, and sets the planner's prediction
(`tf_distbelief.planner.cost_model`) next to each measured row.

Calibration: the planner's compute time of a worker step is taken from the
same configuration's measured examples/s on the unshaped loopback
(`compute_secs = workers * batch / ex/s`): what its workers, ps and chief
cost on these cores when bytes are free, so the `unlimited` rows' predictions
equal their measurements by construction and only the shaped rows test the
model. Without an `unlimited` row it is the `single` row's (`workers * batch
/ single ex/s`: the workers share the cores single-process training used),
which the tables also show for every row as a second prediction.

No TensorFlow: tested from fixed rows (tests/bench/test_downpour_network.py).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from benchmarks import plots
from benchmarks.downpour_tables import UNLIMITED
from tf_distbelief.cluster import network
from tf_distbelief.planner import cost_model

RATES_FLAG = "nic_rates"
PS_RATE_FLAG = "ps_nic_rate"


def rate_bits(nic: str) -> int | None:
    """Bits/s of a `--nic_rates` entry; None for `unlimited`.

    Raises:
      ValueError: naming `--nic_rates` and the value.
    """
    if nic == UNLIMITED:
        return None
    return network.parse_rate(nic, f"--{RATES_FLAG}")


def check_rates(values: Sequence[str]) -> bool:
    """absl validator of `--nic_rates`: known rates, no repeats, at least one."""
    from absl import flags

    try:
        bits = [rate_bits(v) for v in values]
    except ValueError as e:
        raise flags.ValidationError(str(e)) from None
    if not values or len(set(bits)) != len(bits):
        raise flags.ValidationError(
            f"--{RATES_FLAG}: one or more distinct rates (unlimited, 10gbit, "
            f"1gbit, 100mbit, ...). Received: {list(values)}"
        )
    return True


def shaped_in_argv(argv: Sequence[str]) -> bool:
    """True when `argv` asks for a shaped NIC (`--nic_rates` other than unlimited).

    Read before TensorFlow loads and before absl parses the flags (as
    `isolation.flag_value` reads `--isolate_network`); a bad value is left to
    the full parse, which reports it.
    """
    from absl import flags

    values = flags.FlagValues()
    flags.DEFINE_list(RATES_FLAG, [UNLIMITED], "", flag_values=values)
    try:
        values(list(argv), known_only=True)
    except flags.Error:
        return False
    return any(v != UNLIMITED for v in values[RATES_FLAG].value)


@dataclasses.dataclass(frozen=True)
class Predicted:
    """The planner's prediction for one measured row.

    Attributes:
      examples_per_sec: calibrated on the row's own unshaped rate (else single).
      bottleneck: the resource that sets it.
      calibration: `"row@unlimited"` or `"single"`.
      single_examples_per_sec: calibrated on the single row (NaN without one).
    """

    examples_per_sec: float
    bottleneck: str
    calibration: str
    single_examples_per_sec: float


def _setting(name: str, accumulator: str) -> cost_model.Setting:
    """The planner's setting of a row; `+dc` and `+stale` push as plain
    Downpour, `+outer0` as `+outer`, and `+topk`, `+q8`, `+q2`, `+sparse` are
    predicted uncompressed (the planner does not model compressed pushes or
    sparse fetches); a `/straggler=<k>` row as the row without
    it (the planner assumes equal workers)."""
    name = name.partition("/")[0]
    if name == "stock":
        return cost_model.Setting(accumulator=accumulator)
    n, _, rules = name.partition("+")
    n = int(n[len("n=") :])
    outer = any(r in ("outer", "outer0") for r in rules.split("+"))
    return cost_model.Setting(n, n, outer, accumulator)


def predict_rows(
    rows,
    *,
    num_workers: int,
    num_ps: int,
    batch_size: int,
    steps_per_execution: int,
    accumulator: str = "squares",
    ps_nic_rate: str | None = None,
    steps_between_joins: dict | None = None,
) -> dict:
    """`{(model, nic, name): Predicted}` for every cluster row (not `single`).

    Args:
      rows: the benchmark's rows (`downpour_tables.Row`, medians over rounds).
      num_workers, num_ps, batch_size, steps_per_execution: the cluster's.
      accumulator: `--adagrad_accumulator`.
      ps_nic_rate: `--ps_nic_rate` (applies to shaped rows only); None: the
        row's NIC rate.
      steps_between_joins: `{model: steps}` each worker runs between two
        joins (the benchmark joins at every evaluation: `--eval_every` over
        the workers); a model not in it, or None: no joins.
    """
    by_key = {(r.model, r.nic, r.name): r for r in rows}
    singles = {r.model: r for r in rows if r.name == "single"}
    result = {}
    for r in rows:
        if r.name == "single" or not r.examples_per_sec or not r.num_params:
            continue
        worker = rate_bits(r.nic)
        ps = worker if worker is None or ps_nic_rate is None else rate_bits(ps_nic_rate)
        cluster = cost_model.Cluster(
            num_params=r.num_params,
            num_workers=num_workers,
            num_ps=num_ps,
            worker_bits_per_sec=worker,
            ps_bits_per_sec=ps,
            compute_secs=0.0,
            batch_size=batch_size,
            steps_per_execution=steps_per_execution,
            steps_between_joins=(steps_between_joins or {}).get(r.model),
        )
        setting = _setting(r.name, accumulator)

        def predict(rate, cluster=cluster, setting=setting):
            compute = num_workers * batch_size / rate
            return cost_model.predict(cluster.replace(compute_secs=compute), setting)

        single = singles.get(r.model)
        by_single = predict(single.examples_per_sec) if single else None
        unshaped = by_key.get((r.model, UNLIMITED, r.name))
        if unshaped is not None and unshaped.examples_per_sec:
            own, calibration = predict(unshaped.examples_per_sec), "row@unlimited"
        elif by_single is not None:
            own, calibration = by_single, "single"
        else:
            continue
        result[(r.model, r.nic, r.name)] = Predicted(
            own.examples_per_sec,
            own.bottleneck,
            calibration,
            by_single.examples_per_sec if by_single else math.nan,
        )
    return result


def secs_counted(r) -> float:
    """Seconds to the target; a row cut off before it counts as its cut-off."""
    if math.isnan(r.secs_to_target) and not math.isnan(r.cut_off_secs):
        return r.cut_off_secs
    return r.secs_to_target


def _secs_text(r) -> str:
    if math.isnan(r.secs_to_target):
        if math.isnan(r.cut_off_secs):
            return "not reached"
        return f"not reached in {r.cut_off_secs:.0f} s"
    return f"{r.secs_to_target:.1f}"


def _secs_with_unit(r) -> str:
    text = _secs_text(r)
    return text if text.startswith("not") else f"{text} s"


def _ratio(r, base) -> str:
    """`r`'s seconds over `base`'s; `<=` where base was cut off, `>=` where r."""
    if base is None:
        return "-"
    top, bottom = secs_counted(r), secs_counted(base)
    if math.isnan(top) or math.isnan(bottom) or not bottom:
        return "-"
    cut_top = math.isnan(r.secs_to_target)
    cut_bottom = math.isnan(base.secs_to_target)
    if cut_top and cut_bottom:
        return "-"
    prefix = ">=" if cut_top else "<=" if cut_bottom else ""
    return f"{prefix}{top / bottom:.2f}"


def format_bandwidth(rows, predicted: dict) -> str:
    """Markdown: time to target and measured vs predicted ex/s, row by NIC rate."""
    lines = [
        "| model | nic | row | secs to target | x stock | x single | measured ex/s "
        "| predicted ex/s | pred / meas | bottleneck | predicted (single cal.) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stocks = {(r.model, r.nic): r for r in rows if r.name == "stock"}
    singles = {r.model: r for r in rows if r.name == "single"}
    for r in rows:
        p = predicted.get((r.model, r.nic, r.name))
        cells = [
            r.model,
            "-" if r.name == "single" else r.nic,
            r.name,
            _secs_text(r),
            _ratio(r, stocks.get((r.model, r.nic))),
            _ratio(r, singles.get(r.model)),
            f"{r.examples_per_sec:.0f}",
        ]
        if p is None:
            cells += ["-"] * 4
        else:
            cells += [
                f"{p.examples_per_sec:.0f}",
                f"{p.examples_per_sec / r.examples_per_sec:.2f}",
                p.bottleneck,
                "-"
                if math.isnan(p.single_examples_per_sec)
                else f"{p.single_examples_per_sec:.0f}",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_downpour_lines(rows) -> list[str]:
    """Per model and NIC: the fastest Downpour row to the target vs stock, single."""
    lines = []
    singles = {r.model: r for r in rows if r.name == "single"}
    keys = list(dict.fromkeys((r.model, r.nic) for r in rows if r.name != "single"))
    for model, nic in keys:
        group = [r for r in rows if (r.model, r.nic) == (model, nic)]
        stock = next((r for r in group if r.name == "stock"), None)
        reached = [
            r
            for r in group
            if r.name.startswith("n=") and not math.isnan(r.secs_to_target)
        ]
        if not reached:
            lines.append(f"{model} nic={nic}: no Downpour row reached the target")
            continue
        best = min(reached, key=lambda r: r.secs_to_target)
        lines.append(
            f"{model} nic={nic}: best Downpour row {best.name}, "
            f"{best.secs_to_target:.1f} s to {best.target:.3f}: "
            f"{_ratio(best, stock)}x stock "
            f"({'-' if stock is None else _secs_with_unit(stock)}), "
            f"{_ratio(best, singles.get(model))}x single"
        )
    return lines


def write_bandwidth_csv(path: str, rows, predicted: dict) -> str:
    """The bandwidth table as CSV, one line per row and NIC rate."""
    header = [
        "model", "nic", "nic_bits_per_sec", "row", "target", "secs_to_target",
        "cut_off_secs", "examples_per_sec", "predicted_examples_per_sec",
        "bottleneck", "calibration", "predicted_single_calibrated",
    ]  # fmt: skip
    lines = []
    for r in rows:
        p = predicted.get((r.model, r.nic, r.name))
        bits = rate_bits(r.nic)
        lines.append(
            [
                r.model, r.nic, "" if bits is None else bits, r.name, r.target,
                r.secs_to_target, r.cut_off_secs, r.examples_per_sec,
                p.examples_per_sec if p else math.nan, p.bottleneck if p else "",
                p.calibration if p else "",
                p.single_examples_per_sec if p else math.nan,
            ]
        )  # fmt: skip
    return plots.write_csv(path, header, lines)
