"""The emulated network of `benchmarks/downpour_bench.py`: rates, planner, tables.

`--nic_rates` runs every row behind NICs of each rate (`LocalCluster(
nic_bandwidth=...)`, `tf_distbelief.cluster.network.emulated`); this module reads the
rates, decides before TensorFlow loads whether the benchmark must enter the
private network namespace, and sets the planner's prediction
(`tf_distbelief.planner.cost_model`) next to each measured row.

Calibration: the planner's compute time of a worker step is taken from the
same configuration's measured examples/s on the unshaped loopback: what is
left of its step once its transfers at the loopback's own TCP rate
(`loopback_rate_bits`, about 10 Gbit/s here; bytes are not free there) are
taken out, so the `unlimited` rows' predictions equal their measurements by
construction and only the shaped rows test the model; a shaped NIC runs at
most at the loopback's rate. Without a loopback rate, `compute_secs =
workers * batch / ex/s` (unlimited taken as infinite). Without an
`unlimited` row it is the `single` row's (`workers * batch / single ex/s`:
the workers share the cores single-process training used), which the tables
also show for every row as a second prediction.

No TensorFlow: tested from fixed rows (tests/bench/test_downpour_network.py).
"""

from __future__ import annotations

import dataclasses
import math
import socket
import threading
import time
from collections.abc import Sequence

from benchmarks import plots
from benchmarks.downpour_tables import UNLIMITED
from tf_distbelief.cluster.network import emulated
from tf_distbelief.planner import cost_model, records

RATES_FLAG = "nic_rates"
PS_RATE_FLAG = "ps_nic_rate"


def rate_bits(nic: str) -> int | None:
    """Bits/s of a `--nic_rates` entry; None for `unlimited`.

    Raises:
      ValueError: naming `--nic_rates` and the value.
    """
    if nic == UNLIMITED:
        return None
    return emulated.parse_rate(nic, f"--{RATES_FLAG}")


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


def row_setting(
    name: str, accumulator: str, top_k_fraction: float | None = None
) -> records.Setting:
    """The planner's setting of a row. `+dc` and `+stale` push as plain
    Downpour; `+topk` (of `top_k_fraction`), `+q8` and `+q2` compress the
    pushes (the planner takes their bytes from the push rules, and with the
    outer rule predicts update-stream fetches); rows with `+sparse` (sparse
    fetches, `+outer0`) are predicted as the uncompressed `+outer` row (their
    fetches' bytes depend on the data); a `/straggler=<k>` row as the row
    without it (the planner assumes equal workers).

    Raises:
      ValueError: a `+topk` row without `top_k_fraction`.
    """
    name = name.partition("/")[0]
    if name == "stock":
        return records.Setting(accumulator=accumulator)
    n, _, rules = name.partition("+")
    n = int(n[len("n=") :])
    rules = rules.split("+")
    outer = any(r in ("outer", "outer0") for r in rules)
    if "sparse" in rules:
        return records.Setting(n, n, outer, accumulator)
    if "topk" in rules and top_k_fraction is None:
        raise ValueError(
            f"Row {name!r} keeps the top `top_k_fraction` of each push: pass it. "
            "Received: top_k_fraction=None"
        )
    bits = next((int(r[1:]) for r in rules if r in ("q2", "q8")), None)
    fraction = top_k_fraction if "topk" in rules else None
    return records.Setting(n, n, outer, accumulator, fraction, bits)


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
    step_jitter_secs: dict | None = None,
    loopback_bits_per_sec: float | None = None,
    top_k_fraction: float | None = None,
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
      step_jitter_secs: `{model: seconds}`, the standard deviation of a
        worker step's time (`benchmarks/step_jitter.py`); a model not in it,
        or None: the planner's default (`Cluster.step_jitter_secs`).
      top_k_fraction: the `+topk` rows' `--top_k_fraction` (`row_setting`).
      loopback_bits_per_sec: the host's loopback TCP rate
        (`loopback_rate_bits`), the NIC of an unlimited row: its compute time
        is what is left of its step after transfers at this rate, and a
        shaped row's NICs run at most at it. None: unlimited is infinite.
    """
    by_key = {(r.model, r.nic, r.name): r for r in rows}
    singles = {r.model: r for r in rows if r.name == "single"}
    result = {}
    for r in rows:
        if r.name == "single" or not r.examples_per_sec or not r.num_params:
            continue
        worker = _at_most(rate_bits(r.nic), loopback_bits_per_sec)
        ps = worker
        if rate_bits(r.nic) is not None and ps_nic_rate is not None:
            ps = _at_most(rate_bits(ps_nic_rate), loopback_bits_per_sec)
        cluster = records.Cluster(
            num_params=r.num_params,
            num_workers=num_workers,
            num_ps=num_ps,
            worker_bits_per_sec=worker,
            ps_bits_per_sec=ps,
            compute_secs=0.0,
            batch_size=batch_size,
            steps_per_execution=steps_per_execution,
            steps_between_joins=(steps_between_joins or {}).get(r.model),
            step_jitter_secs=(step_jitter_secs or {}).get(r.model),
        )
        setting = row_setting(r.name, accumulator, top_k_fraction)
        unlimited = cluster.replace(
            worker_bits_per_sec=loopback_bits_per_sec,
            ps_bits_per_sec=loopback_bits_per_sec,
        )

        def predict(compute, cluster=cluster, setting=setting):
            return cost_model.predict(cluster.replace(compute_secs=compute), setting)

        single = singles.get(r.model)
        # A single process moves nothing: its step is all compute.
        by_single = (
            predict(num_workers * batch_size / single.examples_per_sec)
            if single
            else None
        )
        unshaped = by_key.get((r.model, UNLIMITED, r.name))
        if unshaped is not None and unshaped.examples_per_sec:
            compute = _compute_secs(unlimited, setting, unshaped.examples_per_sec)
            own, calibration = predict(compute), "row@unlimited"
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


def loopback_rate_bits(total_bytes: int = 1 << 30, chunk_bytes: int = 1 << 20) -> float:
    """The host's TCP rate over 127.0.0.1, one flow, in bits per second.

    What an unshaped task's bytes cross on this host: `total_bytes` sent
    from a thread to this one in `chunk_bytes` writes (the kernel's copies;
    Python's cost per 1 MiB chunk is small). Run on idle cores.
    """
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        payload = bytes(chunk_bytes)

        def send():
            with socket.create_connection(("127.0.0.1", port)) as out:
                for _ in range(total_bytes // chunk_bytes):
                    out.sendall(payload)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        conn, _ = server.accept()
        buffer = bytearray(chunk_bytes)
        received, start = 0, time.perf_counter()
        with conn:
            while received < total_bytes // chunk_bytes * chunk_bytes:
                got = conn.recv_into(buffer)
                if not got:
                    break
                received += got
        secs = time.perf_counter() - start
        sender.join(timeout=60)
    return 8 * received / secs


def _at_most(bits: int | None, limit: float | None) -> float | None:
    """A NIC's rate capped by the host's loopback rate (None: unlimited)."""
    if limit is None:
        return bits
    return limit if bits is None else min(bits, limit)


def _compute_secs(unlimited, setting, examples_per_sec: float) -> float:
    """A worker step's compute time that makes the planner predict
    `examples_per_sec` on `unlimited` (the cluster at the loopback rate);
    the whole step when that rate is unlimited, 0 when the transfers alone
    take longer than the step."""
    step = unlimited.num_workers * unlimited.batch_size / examples_per_sec

    def rate(compute):
        return cost_model.predict(
            unlimited.replace(compute_secs=compute), setting
        ).examples_per_sec

    if unlimited.worker_bits_per_sec is None or rate(0.0) <= examples_per_sec:
        return step if unlimited.worker_bits_per_sec is None else 0.0
    low, high = 0.0, step  # rate(low) > measured >= rate(high).
    for _ in range(60):
        mid = (low + high) / 2
        if rate(mid) > examples_per_sec:
            low = mid
        else:
            high = mid
    return high


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
