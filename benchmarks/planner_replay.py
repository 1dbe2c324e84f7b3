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
"""

from __future__ import annotations

import csv
import math
import os
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import downpour_network  # noqa: E402
from benchmarks.downpour_tables import Row  # noqa: E402
from tf_distbelief.cluster.network import emulated  # noqa: E402  (no TensorFlow)


def _define_flags() -> None:
    flags.DEFINE_string("csv", None, "A recorded downpour_bandwidth.csv.")
    flags.DEFINE_integer("params", None, "Trainable parameters of the model.")
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
    flags.mark_flags_as_required(["csv", "params"])


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


def main(argv) -> None:
    del argv
    f = flags.FLAGS
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
    )
    print(downpour_network.format_bandwidth(rows, predicted))
    sys.stdout.flush()


if __name__ == "__main__":
    _define_flags()
    app.run(main)
