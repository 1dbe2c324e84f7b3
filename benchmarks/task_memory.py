"""Resident memory per task kind of a local cluster: chief, ps, worker (psutil).

A task's kind is the `task.type` of the `TF_CONFIG` in its environment (how
`LocalCluster` and `launch/train.py` start their tasks); the process at the
root of the tree (the benchmark's own process, or the launched job) is the
chief. The figure is the proportional set size (PSS: resident memory with each
page shared by `k` processes counted `1/k`, so that the tasks' figures add up;
TensorFlow's library is shared by every task), and the resident set size (RSS,
shared pages counted whole) under `"<kind> RSS"`; for each kind the largest
of its tasks.

Used by `benchmarks/digits_replicas.py` (`PeakMemory`, sampling every 0.5 s
while a job runs) and `benchmarks/downpour_bench.py` (`sample` at the end of
each row, off the training clock: reading a process's memory map takes CPU
that the tasks would otherwise have).
"""

from __future__ import annotations

import json
import threading

import psutil

__all__ = ["PeakMemory", "merge_peaks", "sample", "task_kind"]

_MB = 2**20


def task_kind(proc: psutil.Process) -> str | None:
    """`"ps"`, `"worker"`... from `proc`'s `TF_CONFIG`; None without one (or gone)."""
    try:
        config = proc.environ().get("TF_CONFIG")
    except psutil.Error:
        return None
    if not config:
        return None
    return json.loads(config).get("task", {}).get("type")


def sample(root_pid: int) -> dict[str, float]:
    """The largest PSS and RSS, in MB, of each task kind now.

    Args:
      root_pid: the chief's process id; its descendants with a `TF_CONFIG`
        are the tasks (others, such as `ss`, are left out).

    Returns:
      `{"chief": MB, "chief RSS": MB, "ps": MB, "ps RSS": MB, "worker": ...}`,
      each kind's largest task; a task that ends while it is read is left
      out.
    """
    root = psutil.Process(root_pid)
    procs = [(root, "chief")]
    try:
        procs += [(c, task_kind(c)) for c in root.children(recursive=True)]
    except psutil.Error:
        pass
    found: dict[str, float] = {}
    for proc, kind in procs:
        if not kind:
            continue
        try:
            memory = proc.memory_full_info()
        except psutil.Error:
            continue
        for key, value in ((kind, memory.pss), (kind + " RSS", memory.rss)):
            found[key] = max(found.get(key, 0.0), value / _MB)
    return found


def merge_peaks(peak: dict[str, float], found: dict[str, float]) -> None:
    """Raises each of `peak`'s figures to `found`'s where larger (in place)."""
    for key, value in found.items():
        peak[key] = max(peak.get(key, 0.0), value)


class PeakMemory(threading.Thread):
    """The largest PSS and RSS (MB) of the chief (`pid`) and each task kind below it.

    A daemon thread sampling (`sample`) every `interval_secs` until `done` is
    set; `peak` holds the figures so far.
    """

    def __init__(self, pid: int, interval_secs: float = 0.5):
        super().__init__(daemon=True)
        self.pid, self.interval_secs = pid, interval_secs
        self.peak: dict[str, float] = {}
        self.done = threading.Event()

    def run(self):
        while not self.done.wait(self.interval_secs):
            try:
                merge_peaks(self.peak, sample(self.pid))
            except psutil.Error:
                continue
