"""Prints the planner's table: examples/s and bottleneck of each setting.

  python -m tf_distbelief.planner --params=42M --workers=200 --ps=8 \
      --nic=10gbit --step_ms=100

For stock parameter-server training and Downpour with n = n_fetch = n_push in
1, 4, 16, 64 (with and without the outer rule): the predicted examples/s, the
resource that saturates first, the bytes of a step, and the fewest ps tasks
that keep the workers busy; then the rows of `--settings` (compressed pushes
among them); then the smallest n and ps count that do (`cost_model.plan`).
No TensorFlow.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence

from tf_distbelief import checks
from tf_distbelief.cluster.network import emulated
from tf_distbelief.planner import cost_model, records

__all__ = ["format_table", "main", "parse_args"]


# `Cluster`'s fields as the command line names them, for the messages.
_FLAGS = {
    "num_params": "--params",
    "num_workers": "--workers",
    "num_ps": "--ps",
    "compute_secs": "--step_ms",
    "batch_size": "--batch",
    "function_secs": "--function_ms",
    "step_jitter_secs": "--step_jitter_ms",
    "host_cores": "--host_cores",
    "cores_per_worker": "--cores_per_worker",
}


def _rate(value: str, name: str) -> float | None:
    if value in ("unlimited", "none", ""):
        return None
    return emulated.parse_rate(value, name)


def _describe(bits_per_sec: float | None) -> str:
    return "unlimited" if bits_per_sec is None else emulated.describe_rate(bits_per_sec)


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line; `SystemExit` (status 2) names a bad argument."""
    parser = argparse.ArgumentParser(
        prog="python -m tf_distbelief.planner",
        description="Predicted examples/s of parameter-server training and "
        "Downpour SGD, and the resource that limits each.",
    )
    parser.add_argument("--params", required=True, help="Parameters: 42M, 2.4M.")
    parser.add_argument("--workers", type=int, required=True, help="Workers.")
    parser.add_argument("--ps", type=int, default=1, help="ps tasks.")
    parser.add_argument(
        "--nic", default="10gbit", help="Each task's NIC: 10gbit, 1gbit, unlimited."
    )
    parser.add_argument("--ps_nic", default=None, help="ps NICs (default --nic).")
    parser.add_argument(
        "--step_ms", type=float, required=True, help="One worker's compute per step."
    )
    parser.add_argument("--batch", type=int, default=records.DEFAULT_BATCH_SIZE)
    parser.add_argument(
        "--steps_per_execution",
        type=int,
        default=records.DEFAULT_STEPS_PER_EXECUTION,
        help="Steps per scheduled function.",
    )
    parser.add_argument(
        "--function_ms",
        type=float,
        default=records.DEFAULT_FUNCTION_SECS * 1e3,
        help="The chief's cost per scheduled function.",
    )
    parser.add_argument(
        "--overhead_bytes",
        type=float,
        default=records.DEFAULT_OVERHEAD_BYTES,
        help="Fixed bytes per exchange per ps, each way.",
    )
    parser.add_argument(
        "--steps_between_joins",
        type=int,
        default=None,
        help="Steps each worker runs between two joins of the coordinator "
        "(model.fit: steps_per_epoch / workers); default: no joins.",
    )
    parser.add_argument(
        "--step_jitter_ms",
        type=float,
        default=None,
        help="Standard deviation of a worker step's time (with "
        "--steps_between_joins: how fast workers in step after a join drift "
        "apart); default: only the first exchange after a join in step.",
    )
    parser.add_argument(
        "--host_cores",
        type=int,
        default=None,
        help="The cores of the one host every task shares (a local emulation; "
        "--step_ms is then the single process's step on the whole host); "
        "default: a host per task.",
    )
    parser.add_argument(
        "--cores_per_worker",
        type=int,
        default=None,
        help="With --host_cores: the cores one worker computes with (its "
        "intra-op threads); default: all of them.",
    )
    parser.add_argument(
        "--accumulator", default="squares", choices=records.ACCUMULATORS
    )
    parser.add_argument(
        "--busy",
        type=float,
        default=0.9,
        help="Workers are busy at this share of their compute-only rate.",
    )
    parser.add_argument(
        "--settings",
        default="",
        help="More rows, comma-separated names: n=16+outer+topk=0.01+q2 "
        "(compressed pushes: top 1%% of each push in 2 bits, and with the "
        "outer rule update-stream fetches), n=32, n=8+outer.",
    )
    args = parser.parse_args(argv)
    for flag in ("step_ms", "function_ms", "step_jitter_ms"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value >= 0):
            parser.error(
                f"`--{flag}` must be a finite number >= 0. Received: {value!r}"
            )
    try:
        nic = _rate(args.nic, "--nic")
        ps_nic = nic if args.ps_nic is None else _rate(args.ps_nic, "--ps_nic")
        args.cluster = records.Cluster(
            num_params=cost_model.parse_count(args.params, "params"),
            num_workers=args.workers,
            num_ps=args.ps,
            worker_bits_per_sec=nic,
            ps_bits_per_sec=ps_nic,
            compute_secs=args.step_ms / 1e3,
            batch_size=args.batch,
            steps_per_execution=args.steps_per_execution,
            function_secs=args.function_ms / 1e3,
            overhead_bytes=args.overhead_bytes,
            steps_between_joins=args.steps_between_joins,
            step_jitter_secs=(
                None if args.step_jitter_ms is None else args.step_jitter_ms / 1e3
            ),
            host_cores=args.host_cores,
            cores_per_worker=args.cores_per_worker,
        )
        if not 0 < args.busy <= 1:
            raise checks.argument_error("busy", "in (0, 1]", args.busy)
    except (TypeError, ValueError) as e:
        message = str(e).replace("Argument `", "`--")
        for field, flag in _FLAGS.items():
            message = message.replace(f"`--{field}`", f"`{flag}`")
        parser.error(message)
    args.settings = _settings(parser, args.settings, args.accumulator)
    return args


# What a `--settings` entry (or `--accumulator`) says for each `Setting` field
# its errors name.
_SETTING_PARTS = {
    "top_k_fraction": "+topk=<f>",
    "quantize_bits": "+q<bits>",
    "adagrad_accumulator": "--accumulator",
    "outer_learning_rate": "+outer",
    "n_fetch": "n",
    "n_push": "n",
}


def _settings(parser, text: str, accumulator: str) -> list[records.Setting]:
    """The rows `--settings` names, after the standard ones; refuses (exit 2)
    an empty entry, a row named twice or already standard, and a setting
    `Setting.parse` refuses, naming the entry as written."""
    standard = {s.name for s in cost_model.standard_settings(accumulator)}
    rows = []
    for name in text.split(",") if text else []:
        name = name.strip()
        if not name:
            parser.error(f"`--settings` has an empty entry: {text!r}")
        try:
            setting = records.Setting.parse(name, accumulator)
        except (TypeError, ValueError) as e:
            message = str(e).replace("Argument `", "`")
            for field, part in _SETTING_PARTS.items():
                message = message.replace(f"`{field}`", f"`{part}`")
            # `n_fetch` and `n_push` are both the entry's `n`.
            message = message.replace("`n` and `n`", "`n`")
            parser.error(f"`--settings` has {name!r}: {message}")
        if setting.name in standard or setting in rows:
            where = "a standard row" if setting.name in standard else "named twice"
            parser.error(f"`--settings` has {name!r}, {where} ({setting.name}).")
        rows.append(setting)
    return rows


def _fmt(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:,.0f}"


def format_table(
    cluster: records.Cluster,
    accumulator: str = "squares",
    busy: float = 0.9,
    settings: Sequence[records.Setting] = (),
) -> str:
    """The table `main` prints, one line per setting, then the plan lines.

    Args:
      cluster: the cluster.
      accumulator: the standard rows' `adagrad_accumulator`.
      busy: the share of the compute-only rate that counts as busy.
      settings: rows after the standard ones (`--settings`).
    """
    c = cluster
    rows = cost_model.standard_settings(accumulator) + list(settings)
    width = max(10, *(len(s.name) for s in rows))
    model_mb = c.num_params * records.BYTES_PER_PARAM / 1e6
    lines = [
        f"params={c.num_params:,} ({model_mb:.1f} MB float32) "
        f"workers={c.num_workers} ps={c.num_ps} "
        f"nic={_describe(c.worker_bits_per_sec)} ps_nic={_describe(c.ps_bits_per_sec)} "
        f"step={c.compute_secs * 1e3:g} ms batch={c.batch_size} "
        f"steps_per_execution={c.steps_per_execution} "
        f"function={c.function_secs * 1e3:g} ms accumulator={accumulator}"
        + (
            ""
            if c.steps_between_joins is None
            else f" joins=every {c.steps_between_joins} steps"
        )
        + (
            ""
            if c.step_jitter_secs is None
            else f" step_jitter={c.step_jitter_secs * 1e3:g} ms"
        )
        + ("" if c.host_cores is None else f" host_cores={c.host_cores}")
        + (
            ""
            if c.cores_per_worker is None
            else f" cores_per_worker={c.cores_per_worker}"
        ),
        f"{'row':{width}} {'ex/s':>10} {'bottleneck':16} {'workers':>10} "
        f"{'ps NIC':>10} {'chief':>10} {'MB/st fetch':>11} {'MB/st push':>10} "
        f"{'min ps':>6}",
    ]
    for setting in rows:
        p = cost_model.predict(c, setting)
        fewest = cost_model.smallest_ps(c, setting, busy)
        lines.append(
            f"{setting.name:{width}} {_fmt(p.examples_per_sec):>10} {p.bottleneck:16} "
            f"{_fmt(p.bounds['workers']):>10} {_fmt(p.bounds[cost_model.PS_NIC]):>10} "
            f"{_fmt(p.bounds[cost_model.CHIEF]):>10} "
            f"{p.traffic.to_worker_bytes / 1e6:11.3f} "
            f"{p.traffic.to_ps_bytes / 1e6:10.3f} "
            f"{'-' if fewest is None else fewest:>6}"
        )
    limit = cost_model.compute_only_rate(c) if c.compute_secs else 0
    lines.append(
        f"busy: at least {busy:.0%} of the workers' compute-only rate "
        f"({_fmt(limit)} ex/s); min ps: the fewest ps tasks that keep them busy"
    )
    for outer in (False, True):
        found = cost_model.plan(c, outer, accumulator, busy)
        rule = "with the outer rule" if outer else "without a push rule"
        if found is None:
            lines.append(f"plan {rule}: none (n <= 1024): the worker NIC limits")
        else:
            n, count = found
            lines.append(f"plan {rule}: n_fetch = n_push = {n}, num_ps = {count}")
    spe = cost_model.chief_steps_per_execution(c)
    if spe is not None:
        lines.append(
            f"chief: keeps up at steps_per_execution >= {spe} "
            f"(now {c.steps_per_execution})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    print(format_table(args.cluster, args.accumulator, args.busy, args.settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
