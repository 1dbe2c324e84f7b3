"""The planner's prediction next to the examples/s of a recorded bandwidth run.

`downpour_bench.py --nic_rates=...` writes `downpour_bandwidth.csv` (measured
examples/s per row and NIC rate, and the prediction of the planner of its
day). This prints the table again with the planner as it is now, calibrated
as the benchmark does (`downpour_network.predict_rows`): on the row's
unshaped rate when the run has one, else on the `single` row's. No
TensorFlow, no cluster:

  python benchmarks/planner_replay.py \
      --csv=benchmarks/results/downpour_bandwidth.csv --params=2415616

`--params` is the model's trainable parameter count (the speech model:
2,415,616); the cluster flags default to the benchmark's defaults and must
be the recorded run's.

`--replicas_csv` replays a replica sweep instead (`downpour_bench.py
--num_workers=1,2,4,8`, `downpour_replicas.csv`), with no calibration on any
of its rows: the planner's compute is the single-process step of the `single`
row of `--single_csv` (the same model and batch on the same host), its
workers share the host's `--host_cores` cores (`tf_distbelief.planner.host`)
with `--task_intra_op_threads` cores each, and the worker and ps counts come
from each row:

  python benchmarks/planner_replay.py \
      --replicas_csv=benchmarks/results/downpour_replicas.csv \
      --single_csv=benchmarks/results/downpour_bandwidth.csv --params=2415616 \
      --steps_per_execution=16 --eval_every=64 --step_jitter_ms=6.7 --host_cores=2
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import downpour_network  # noqa: E402
from benchmarks.downpour_tables import Row  # noqa: E402
from tf_distbelief.cluster.network import emulated  # noqa: E402  (no TensorFlow)
from tf_distbelief.planner import cost_model, records  # noqa: E402


def _define_flags() -> None:
    flags.DEFINE_string("csv", None, "A recorded downpour_bandwidth.csv.")
    flags.DEFINE_string(
        "replicas_csv",
        None,
        "A recorded downpour_replicas.csv (instead of --csv): predicted from "
        "the single-process step of --single_csv's `single` row alone.",
    )
    flags.DEFINE_string(
        "single_csv",
        None,
        "With --replicas_csv: a recorded downpour_bandwidth.csv whose `single` "
        "row (same model, batch and host) gives the single-process step.",
    )
    flags.DEFINE_integer(
        "host_cores",
        None,
        "With --replicas_csv: the cores of the host every task of the recorded "
        "run shared; default: a host per task.",
        lower_bound=1,
    )
    flags.DEFINE_integer(
        "task_intra_op_threads",
        1,
        "With --replicas_csv and --host_cores: the recorded run's "
        "--task_intra_op_threads, the cores one worker computes with (0: all).",
        lower_bound=0,
    )
    flags.DEFINE_integer("params", None, "Trainable parameters of the model.")
    flags.DEFINE_float(
        "top_k_fraction",
        0.01,
        "The recorded run's --top_k_fraction (its `+topk` rows).",
    )
    flags.DEFINE_integer("num_workers", 2, "Workers of the recorded run.")
    flags.DEFINE_integer("num_ps", 1, "Ps tasks of the recorded run.")
    flags.DEFINE_integer("batch_size", 32, "Batch of the recorded run.")
    flags.DEFINE_integer(
        "steps_per_execution", 20, "Steps per function of the recorded run."
    )
    flags.DEFINE_enum(
        "adagrad_accumulator",
        "squares",
        ["squares", "mean", "sum"],
        "The recorded run's --adagrad_accumulator.",
    )
    flags.DEFINE_string(
        "ps_nic_rate", None, "The recorded run's --ps_nic_rate (default: none)."
    )
    flags.DEFINE_integer(
        "eval_every",
        160,
        "The recorded run's steps between evaluations, all workers together "
        "(the benchmark's default for speech: 160); each evaluation joins "
        "the workers.",
        lower_bound=1,
    )
    flags.DEFINE_float(
        "step_jitter_ms",
        None,
        "The standard deviation of a worker step's time in the recorded run's "
        "cluster (benchmarks/step_jitter.py); default: the planner's (None).",
        lower_bound=0,
    )
    flags.DEFINE_string(
        "loopback_rate",
        None,
        "The host's loopback TCP rate (e.g. 10.8gbit; the benchmark measures "
        "and prints it): the NIC of the unlimited rows; default: infinite.",
    )
    flags.mark_flags_as_required(["params"])
    flags.mark_flags_as_mutual_exclusive(["csv", "replicas_csv"], required=True)


def read_rows(path: str, num_params: int) -> list[Row]:
    """The rows of a recorded bandwidth CSV, as the benchmark's `Row`s.

    Args:
      path: the CSV (`downpour_bench.py`'s `downpour_bandwidth.csv`).
      num_params: the model's trainable parameters.

    Returns:
      One `Row` per line: model, row name, NIC rate, examples/s, seconds to
      the target (NaN where not reached) and cut-off; the other measurements
      are not in the CSV and are left empty.
    """
    rows = []
    with open(path, newline="") as f:
        for line in csv.DictReader(f):
            rows.append(
                Row(
                    model=line["model"],
                    name=line["row"],
                    examples_per_sec=float(line["examples_per_sec"]),
                    socket_bytes_per_example=math.nan,
                    tensor_bytes_per_example=math.nan,
                    cpu_ms_per_step={},
                    test_accuracy=math.nan,
                    test_loss=math.nan,
                    wall_secs=math.nan,
                    target=float(line["target"]),
                    secs_to_target=float(line["secs_to_target"]),
                    nic=line["nic"],
                    num_params=num_params,
                    cut_off_secs=float(line["cut_off_secs"]),
                )
            )
    return rows


@dataclasses.dataclass(frozen=True)
class ReplicaRow:
    """One line of a recorded replica sweep (`downpour_replicas.csv`).

    Attributes:
      model, nic, name: the model, the NIC rate (`100mbit`) and the row
        (`stock`, `n=64+outer`).
      num_workers, num_ps: the cluster's.
      examples_per_sec: measured, all workers together.
    """

    model: str
    nic: str
    name: str
    num_workers: int
    num_ps: int
    examples_per_sec: float


def read_replica_rows(path: str) -> list[ReplicaRow]:
    """The rows of a recorded `downpour_replicas.csv`, in the file's order."""
    with open(path, newline="") as f:
        return [
            ReplicaRow(
                model=line["model"],
                nic=line["nic"],
                name=line["row"],
                num_workers=int(line["num_workers"]),
                num_ps=int(line["num_ps"]),
                examples_per_sec=float(line["examples_per_sec"]),
            )
            for line in csv.DictReader(f)
        ]


def steps_between_joins(eval_every: int, num_workers: int) -> int:
    """Steps each worker runs between two evaluations of a replica sweep.

    `downpour_bench.py`'s `--eval_every` is for 2 workers; with `W` the
    interval is `ceil(eval_every * W / 2)` steps of all workers together,
    which `fit` spreads over the `W` workers.
    """
    return max(1, -(-eval_every * num_workers // 2) // num_workers)


def predict_replicas(
    rows: list[ReplicaRow],
    *,
    num_params: int,
    single_examples_per_sec: float,
    batch_size: int,
    steps_per_execution: int,
    eval_every: int,
    step_jitter_secs: float | None,
    host_cores: int | None,
    cores_per_worker: int | None,
    accumulator: str = "squares",
    ps_nic_rate: str | None = None,
) -> list[cost_model.Prediction]:
    """The planner's prediction of each row, with no calibration on any row.

    Args:
      rows: the sweep (`read_replica_rows`).
      num_params: the model's trainable parameters.
      single_examples_per_sec: plain `fit` in one process on the same host
        and batch: its step, `batch_size / single_examples_per_sec`, is the
        planner's compute (a single process moves nothing).
      batch_size, steps_per_execution: the recorded run's.
      eval_every: the recorded run's `--eval_every` (for 2 workers; each
        evaluation joins the workers, `steps_between_joins`).
      step_jitter_secs: the standard deviation of a worker step's time
        (`benchmarks/step_jitter.py`); None: the planner's default.
      host_cores: the cores every task shared; None: a host per task.
      cores_per_worker: the cores one worker computes with (its intra-op
        threads); None: all `host_cores`.
      accumulator: the recorded run's `--adagrad_accumulator`.
      ps_nic_rate: the recorded run's `--ps_nic_rate`; None: the row's NIC.

    Returns:
      One `Prediction` per row, in order.
    """
    predictions = []
    for r in rows:
        worker = downpour_network.rate_bits(r.nic)
        ps = worker if ps_nic_rate is None else downpour_network.rate_bits(ps_nic_rate)
        cluster = records.Cluster(
            num_params=num_params,
            num_workers=r.num_workers,
            num_ps=r.num_ps,
            worker_bits_per_sec=worker,
            ps_bits_per_sec=ps,
            compute_secs=batch_size / single_examples_per_sec,
            batch_size=batch_size,
            steps_per_execution=steps_per_execution,
            steps_between_joins=steps_between_joins(eval_every, r.num_workers),
            step_jitter_secs=step_jitter_secs,
            host_cores=host_cores,
            cores_per_worker=None if host_cores is None else cores_per_worker,
        )
        predictions.append(
            cost_model.predict(
                cluster, downpour_network.row_setting(r.name, accumulator)
            )
        )
    return predictions


def format_replicas(rows: list[ReplicaRow], predictions: list) -> str:
    """Markdown: measured against predicted examples/s, row by worker count."""
    lines = [
        "| model | nic | ps | row | workers | measured ex/s | predicted ex/s "
        "| pred / meas | bottleneck | compute ms | transfer ms | queueing ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, p in zip(rows, predictions):
        cells = [
            r.model, r.nic, str(r.num_ps), r.name, str(r.num_workers),
            f"{r.examples_per_sec:.0f}", f"{p.examples_per_sec:.0f}",
            f"{p.examples_per_sec / r.examples_per_sec:.2f}", p.bottleneck,
            f"{p.compute_secs * 1e3:.1f}", f"{p.transfer_secs * 1e3:.1f}",
            f"{p.queue_secs * 1e3:.1f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _single_examples_per_sec(path: str) -> float:
    """The `single` row's examples/s of a recorded bandwidth CSV.

    Raises:
      app.UsageError: naming `--single_csv` when it has no `single` row.
    """
    with open(path, newline="") as f:
        for line in csv.DictReader(f):
            if line["row"] == "single":
                return float(line["examples_per_sec"])
    raise app.UsageError(f"--single_csv: no `single` row in {path!r}.")


def _main_replicas(f) -> None:
    if f.single_csv is None:
        raise app.UsageError("--replicas_csv needs --single_csv.")
    rows = read_replica_rows(f.replicas_csv)
    predictions = predict_replicas(
        rows,
        num_params=f.params,
        single_examples_per_sec=_single_examples_per_sec(f.single_csv),
        batch_size=f.batch_size,
        steps_per_execution=f.steps_per_execution,
        eval_every=f.eval_every,
        step_jitter_secs=None if f.step_jitter_ms is None else f.step_jitter_ms / 1e3,
        host_cores=f.host_cores,
        cores_per_worker=f.task_intra_op_threads or None,
        accumulator=f.adagrad_accumulator,
        ps_nic_rate=f.ps_nic_rate,
    )
    print(format_replicas(rows, predictions))
    sys.stdout.flush()


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    if f.replicas_csv is not None:
        _main_replicas(f)
        return
    rows = read_rows(f.csv, f.params)
    predicted = downpour_network.predict_rows(
        rows,
        num_workers=f.num_workers,
        num_ps=f.num_ps,
        batch_size=f.batch_size,
        steps_per_execution=f.steps_per_execution,
        accumulator=f.adagrad_accumulator,
        ps_nic_rate=f.ps_nic_rate,
        steps_between_joins={
            r.model: max(1, f.eval_every // f.num_workers) for r in rows
        },
        step_jitter_secs=(
            None
            if f.step_jitter_ms is None
            else {r.model: f.step_jitter_ms / 1e3 for r in rows}
        ),
        loopback_bits_per_sec=(
            None
            if f.loopback_rate is None
            else emulated.parse_rate(f.loopback_rate, "--loopback_rate")
        ),
        top_k_fraction=f.top_k_fraction,
    )
    print(downpour_network.format_bandwidth(rows, predicted))
    sys.stdout.flush()


if __name__ == "__main__":
    _define_flags()
    app.run(main)
