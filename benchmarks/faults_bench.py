r"""Fault injection: the digits job survives one SIGKILL of a ps, a worker or the chief.

Each run is `launch/train.py --model=digits` on its local cluster (2 workers,
2 ps, `--model_dir`, `--checkpoint_every_steps`), with one SIGKILL of a task
drawn at random (seeded): a ps or a worker (found by the `TF_CONFIG` in its
environment, read with psutil; the local cluster restarts it on its address,
the chief recovers a ps from the last checkpoint, the coordinator reconnects a
worker)
or the chief (the launch process; its cluster dies with it, and the benchmark
reruns the same command with the same `--model_dir`, as a user would). The
step of the fault is drawn uniformly between the second checkpoint and 80% of
the run (before the first checkpoint a lost ps is an error by design: nothing
to restore); the kill comes when the chief's progress line reports that step
finished. One unfaulted run of the same command gives the reference accuracy.

Columns: `at step` the last step the chief reported finished before the kill;
`restored` the checkpoint training resumed from; `steps redone` the steps
between the two (the work lost, up to the steps that finished after the
last progress line); `recover s` from the kill to the restored values checked on
the ps (ps, chief: the rerun's start-up included) or to the restarted worker
serving (the coordinator then reconnects it within seconds); `acc` test
accuracy and `d acc` its difference to the unfaulted run, in points;
`bit-exact` whether every restored value read back from the ps equals the
checkpoint file's bytes (`tf_keras_fit.VerifyRestored`; a difference would fail
the run).

Usage:
  python benchmarks/faults_bench.py                   # 12 runs, about 17 min
  python benchmarks/faults_bench.py --runs=3 --quick  # 1 fault of each kind, 4-9 min
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
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
FAULTS = ("ps", "worker", "chief")
_POLL_SECS = 0.02
# A run that takes longer than this is stuck (a healthy one: about a minute).
_RUN_TIMEOUT_SECS = 900.0


def define_flags():
    flags.DEFINE_integer("runs", 12, "Faulted runs.", lower_bound=1)
    flags.DEFINE_integer("seed", 0, "Seed of the faults (task and step).")
    flags.DEFINE_bool("quick", False, "2 epochs of 50 steps instead of 5 of 100.")
    flags.DEFINE_integer(
        "checkpoint_every_steps", 20, "Steps between checkpoints.", lower_bound=1
    )
    flags.DEFINE_string("out", None, "Also write the results as JSON here.")


def _environ(pid):
    try:
        return psutil.Process(pid).environ()
    except psutil.Error:  # Gone, a zombie, or not ours to read.
        return {}


def _marked(marker):
    return [
        p for p in psutil.pids() if _environ(p).get("FAULTS_BENCH_MARKER") == marker
    ]


def _task_pid(marker, job, index):
    for pid in _marked(marker):
        task = json.loads(_environ(pid).get("TF_CONFIG") or "{}").get("task")
        if task == {"type": job, "index": index}:
            return pid
    raise RuntimeError(f"no process of {job}:{index} (marker {marker})")


class _Job:
    """One `launch/train.py` process, its output in a file, lines timestamped."""

    def __init__(self, args, folder, name, marker):
        self.path = os.path.join(folder, f"{name}.out")
        self.marker = marker
        env = dict(os.environ, FAULTS_BENCH_MARKER=marker, TF_CPP_MIN_LOG_LEVEL="2")
        env.pop("TF_CONFIG", None)
        started = time.monotonic()
        with open(self.path, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-u", TRAIN, *args],
                env=env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.lines: list[tuple[float, str]] = []
        # For each line of `lines`, a time it was written after: the start
        # of the read before the one that found it (`lines` holds the time
        # it was read, which can be a poll later than it was written).
        self.written_after: list[float] = []
        self._read_began = started
        self._offset = 0

    def poll_lines(self):
        began = time.monotonic()
        with open(self.path, errors="replace") as f:
            f.seek(self._offset)
            text = f.read()
        end = text.rfind("\n") + 1
        self._offset += len(text[:end].encode())
        now = time.monotonic()
        new = text[:end].splitlines()
        self.lines += [(now, line) for line in new]
        self.written_after += [self._read_began] * len(new)
        self._read_began = began
        return self.lines

    def find(self, pattern, since=0.0):
        for at, line in self.poll_lines():
            if at >= since:
                found = re.search(pattern, line)
                if found:
                    return at, found
        return None

    def wait_for(self, pattern, since=0.0, timeout_secs=_RUN_TIMEOUT_SECS):
        deadline = time.monotonic() + timeout_secs
        while True:
            found = self.find(pattern, since)
            if found or self.proc.poll() is not None:
                return found or self.find(pattern, since)
            if time.monotonic() > deadline:
                return None
            time.sleep(_POLL_SECS)

    def finish(self, timeout_secs=_RUN_TIMEOUT_SECS):
        try:
            self.proc.wait(timeout_secs)
        finally:
            self.proc.kill()
            self.proc.wait()
        self.poll_lines()
        deadline = time.monotonic() + 30
        while _marked(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = _marked(self.marker)
        for pid in left:  # Only ever this run's own processes.
            os.kill(pid, signal.SIGKILL)
        return self.proc.returncode, len(left)


def _accuracy(job):
    found = job.find(r"^test accuracy: ([0-9.]+)$")
    return float(found[1][1]) if found else None


def _run(args, folder, fault, index, kill_step):
    """One faulted run; returns its row."""
    marker = uuid.uuid4().hex
    model_dir = os.path.join(folder, "model")
    args = [*args, f"--model_dir={model_dir}"]
    job = _Job(args, folder, "run", marker)
    row = {"fault": fault, "task": f"{fault}:{index}", "drawn step": kill_step}
    deadline = time.monotonic() + _RUN_TIMEOUT_SECS
    while time.monotonic() < deadline:
        found = [
            int(m[1])
            for _, line in job.poll_lines()
            if (m := re.match(r"^step (\d+)/\d+: ", line))
        ]
        at_step = max(found, default=0)
        ckpts = os.path.join(model_dir, "checkpoints", "checkpoint")
        if at_step >= kill_step and os.path.exists(ckpts):
            break
        if job.proc.poll() is not None:
            break
        time.sleep(_POLL_SECS)
    row["at step"] = at_step
    pid = job.proc.pid if fault == "chief" else _task_pid(marker, fault, index)
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    final = job
    if fault == "chief":
        code, left = job.finish()
        row["left behind"] = left
        final = _Job(args, folder, "rerun", uuid.uuid4().hex)
        done = final.wait_for(r"^restored ckpt-(\d+) \(step \d+\): .* bit for bit")
    elif fault == "ps":
        done = job.wait_for(r"^restored ckpt-(\d+) \(step \d+\): .* bit for bit")
    else:
        done = job.wait_for(rf"^local cluster: worker:{index} .* serving after")
    if done is not None:
        row["recover s"] = round(done[0] - killed_at, 1)
        if fault != "worker":
            row["restored"] = int(done[1][1])
            row["steps redone"] = at_step - row["restored"]
            row["bit-exact"] = "yes"
        else:
            row["restored"] = None
            row["steps redone"] = 0
            row["bit-exact"] = "n/a"
    code, left = final.finish()
    row["exit"] = code
    row["left behind"] = row.get("left behind", 0) + left
    row["acc"] = _accuracy(final)
    row["completed"] = code == 0 and row["acc"] is not None and done is not None
    if not row["completed"]:
        row["log tail"] = "\n".join(line for _, line in final.lines[-15:])
    return row


def _cell(row, column):
    value = row.get(column)
    if value is None:
        return "-"
    if column == "acc":
        return f"{value:.4f}"
    if column == "d acc":
        return f"{value:+.2f}"
    if column == "completed":
        return "yes" if value else "no"
    return str(value)


def main(argv):
    del argv
    f = flags.FLAGS
    epochs, steps = (2, 50) if f.quick else (5, 100)
    every = f.checkpoint_every_steps
    total = epochs * steps
    args = [
        "--model=digits",
        "--num_workers=2",
        "--num_ps=2",
        f"--epochs={epochs}",
        f"--steps_per_epoch={steps}",
        f"--checkpoint_every_steps={every}",
        "--log_every_steps=10",
    ]
    rng = random.Random(f.seed)
    faults = [FAULTS[i % len(FAULTS)] for i in range(f.runs)]
    rng.shuffle(faults)
    plan = [
        (
            fault,
            0 if fault == "chief" else rng.randrange(2),
            rng.randint(min(2 * every, total - 1), max(2 * every, int(0.8 * total))),
        )
        for fault in faults
    ]
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="faults_bench_") as root:
        base_dir = os.path.join(root, "unfaulted")
        os.makedirs(base_dir)
        base = _Job(
            [*args, f"--model_dir={base_dir}/model"], base_dir, "run", uuid.uuid4().hex
        )
        base_code, _ = base.finish()
        reference = _accuracy(base)
        print(
            f"unfaulted: exit {base_code}, test accuracy {reference}, "
            f"{time.monotonic() - start:.0f} s",
            flush=True,
        )
        rows = []
        for i, (fault, index, kill_step) in enumerate(plan):
            folder = os.path.join(root, f"run{i}")
            os.makedirs(folder)
            row = _run(args, folder, fault, index, kill_step)
            row["run"] = i + 1
            if row["acc"] is not None and reference is not None:
                row["d acc"] = round(100 * (row["acc"] - reference), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    columns = [
        "run", "task", "at step", "restored", "steps redone", "recover s",
        "acc", "d acc", "bit-exact", "completed",
    ]  # fmt: skip
    print()
    print(f"| {' | '.join(columns)} |")
    print(f"|{'---|' * len(columns)}")
    for row in rows:
        print(f"| {' | '.join(_cell(row, c) for c in columns)} |")
    print()
    completed = sum(r["completed"] for r in rows)
    print(f"completed runs: {completed} of {len(rows)}; unfaulted accuracy {reference}")
    for fault in FAULTS:
        mine = [r for r in rows if r["fault"] == fault and r.get("recover s")]
        if mine:
            redone = [r["steps redone"] for r in mine]
            print(
                f"{fault}: {len(mine)} faults, steps redone mean "
                f"{statistics.mean(redone):.1f} (max {max(redone)}), recover "
                f"mean {statistics.mean(r['recover s'] for r in mine):.1f} s"
            )
    deltas = [abs(r["d acc"]) for r in rows if r.get("d acc") is not None]
    if deltas:
        print(f"largest accuracy difference: {max(deltas):.2f} points")
    print(f"processes left behind: {sum(r['left behind'] for r in rows)}")
    print(f"total {time.monotonic() - start:.0f} s")
    for row in rows:
        if not row["completed"]:
            print(f"run {row['run']} ({row['task']}) failed:\n{row['log tail']}")
    if f.out:
        with open(f.out, "w") as out:
            json.dump({"reference": reference, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    define_flags()
    app.run(main)
