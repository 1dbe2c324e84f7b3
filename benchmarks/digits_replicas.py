r"""The README's digits job against the number of model replicas (workers).

Each run is the README's command, `launch/train.py --model=digits
--optimizer=adagrad`, with `--num_workers` taken from `--workers`, 4 ps, the
same number of steps whatever the worker count (asynchronous stock training:
every step is one replica's batch), and each `--staleness_power` of
`--powers` (0 is undamped AdaGrad; the default damps a gradient `tau`
updates stale by `max(1, tau)^power`, `tf_distbelief.adagrad.staleness`).
`--seeds` sets the model and data seed of each run; `--epochs` the epochs of
100 steps (5 unless told). `--consoles` keeps each run's console (loss per
epoch, goodput line) in a file named by its workers, power and seed.

Columns: `acc` test accuracy; `train s`, `start-up s` from the job's goodput
line; `wall s` the whole command; `chief MB`, `ps MB`, `worker MB` the largest
proportional set size (PSS) a task of that kind reached, sampled every 0.5 s
(`benchmarks.task_memory`: psutil, local tasks told apart by the task type in
their `TF_CONFIG`), and `worker RSS MB` a worker's largest resident memory,
shared pages counted whole; `left`
the processes of the run alive 10 s after it ended (found by a marker in
their environment) and the files left in its `TMPDIR` (a new empty folder).

Usage:
  python benchmarks/digits_replicas.py                      # 2, 8, 16 workers
  python benchmarks/digits_replicas.py --workers=8 --seeds=0 --powers=0,0.75
  python benchmarks/digits_replicas.py --powers=0.75 --epochs=10 --consoles=logs
"""

from __future__ import annotations

import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import psutil
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN = os.path.join(ROOT, "launch", "train.py")
sys.path.insert(0, ROOT)

from benchmarks import task_memory  # noqa: E402


def define_flags():
    flags.DEFINE_list("workers", ["2", "8", "16"], "Worker counts.")
    flags.DEFINE_list("powers", ["0", "0.75"], "Values of --staleness_power.")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Values of --seed, one run each.")
    flags.DEFINE_integer("num_ps", 4, "ps tasks.", lower_bound=1)
    flags.DEFINE_integer("epochs", 5, "Epochs of 100 steps.", lower_bound=1)
    flags.DEFINE_string("out", None, "Also write the rows as CSV here.")
    flags.DEFINE_string(
        "consoles", None, "Also write each run's console here, one file a run."
    )


def _marked(marker: str) -> list[int]:
    found = []
    for pid in psutil.pids():
        try:
            if psutil.Process(pid).environ().get("DIGITS_REPLICAS_MARKER") == marker:
                found.append(pid)
        except psutil.Error:
            continue
    return found


def _run(
    workers: int, power: str, seed: str, num_ps: int, epochs: int, consoles: str | None
) -> dict:
    args = [
        sys.executable,
        TRAIN,
        "--model=digits",
        "--optimizer=adagrad",
        f"--num_workers={workers}",
        f"--num_ps={num_ps}",
        f"--epochs={epochs}",
        f"--staleness_power={power}",
        f"--seed={seed}",
    ]
    marker, temp = uuid.uuid4().hex, tempfile.mkdtemp(prefix="digits_replicas_")
    env = dict(os.environ, DIGITS_REPLICAS_MARKER=marker, TMPDIR=temp)
    start = time.monotonic()
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    memory = task_memory.PeakMemory(proc.pid)
    memory.start()
    out = proc.communicate()[0]
    memory.done.set()
    wall = time.monotonic() - start
    time.sleep(10)
    left = len(_marked(marker)) + len(os.listdir(temp))
    if not os.listdir(temp):
        os.rmdir(temp)
    accuracy = re.search(r"^test accuracy: ([\d.]+)", out, re.M)
    train = re.findall(r"train ([\d.]+) s", out)
    startup = re.findall(r"start-up ([\d.]+) s", out)
    if consoles:
        os.makedirs(consoles, exist_ok=True)
        name = f"workers{workers}_power{power}_seed{seed}.log"
        with open(os.path.join(consoles, name), "a") as log:
            log.write(out)
    if proc.returncode or not accuracy:
        print(out[-3000:], flush=True)
    return {
        "workers": workers,
        "staleness_power": float(power),
        "seed": int(seed),
        "acc": float(accuracy.group(1)) if accuracy else None,
        "train s": float(train[-1]) if train else None,
        "start-up s": float(startup[-1]) if startup else None,
        "wall s": round(wall, 1),
        **{
            f"{k} MB": round(memory.peak.get(k, 0.0)) for k in ("chief", "ps", "worker")
        },
        "worker RSS MB": round(memory.peak.get("worker RSS", 0.0)),
        "left": left,
    }


COLUMNS = (
    "workers",
    "staleness_power",
    "acc (each run)",
    "min acc",
    "train s",
    "start-up s",
    "chief MB",
    "ps MB",
    "worker MB",
    "worker RSS MB",
    "left",
)


def table(rows: list[dict], workers: list[int], powers: list[float]) -> list[str]:
    """The markdown table of the runs, one line per worker count and power.

    Args:
      rows: the runs, as `_run` returns them.
      workers: the worker counts, in the table's order.
      powers: the staleness powers, in the table's order.

    Returns:
      The header, the separator and one row per (workers, power), each with
      one cell per name of `COLUMNS`: every run's accuracy, the lowest, the
      median train and start-up seconds, the peak memory of each task kind
      over the runs and the processes and files the runs left.
    """
    lines = [
        "| " + " | ".join(COLUMNS) + " |",
        "| " + " | ".join("---" for _ in COLUMNS) + " |",
    ]
    for count in workers:
        for power in powers:
            cell = [
                r
                for r in rows
                if (r["workers"], r["staleness_power"]) == (count, power)
            ]
            accs = [r["acc"] for r in cell]
            done = [a for a in accs if a is not None]

            def median(key, cell=cell):
                values = [r[key] for r in cell if r[key] is not None]
                return f"{statistics.median(values):.1f}" if values else "-"

            each = ", ".join("failed" if a is None else f"{a:.3f}" for a in accs)
            low = f"{min(done):.3f}" if done else "-"
            peaks = [
                str(max(r[f"{k} MB"] for r in cell))
                for k in ("chief", "ps", "worker", "worker RSS")
            ]
            cells = [str(count), f"{power:g}", each, low]
            cells += [median("train s"), median("start-up s"), *peaks]
            cells.append(str(sum(r["left"] for r in cell)))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv):
    del argv
    f = flags.FLAGS
    rows = []
    for workers in map(int, f.workers):
        for power in f.powers:
            for seed in f.seeds:
                row = _run(workers, power, seed, f.num_ps, f.epochs, f.consoles)
                print(json.dumps(row), flush=True)
                rows.append(row)
    print()
    for line in table(rows, list(map(int, f.workers)), list(map(float, f.powers))):
        print(line, flush=True)
    if f.out:
        with open(f.out, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    define_flags()
    app.run(main)
