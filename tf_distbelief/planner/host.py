"""Workers that share one host's cores: the planner's compute under contention.

On a real cluster each worker has a host of its own, and its step computes
for `Cluster.compute_secs` whatever the other workers do. In a local
emulation (`LocalCluster`: every task on this machine) the workers share the
host's `Cluster.host_cores` cores, and their steps slow each other down.

The model: `compute_secs` is then the single process's step on the whole
host (plain `fit`, one process, every core), so a step is `w = compute_secs
* host_cores` core-seconds of work (the single process taken as using every
core). A worker task computes with at most `Cluster.cores_per_worker` cores
(its intra-op threads; `LocalCluster(intra_op_threads=1)` as the benchmarks
run it), so alone its compute takes `w / cores_per_worker`. Workers
computing together share the cores evenly (processor sharing, mean-field as
the ps NICs' queueing): with `n = 1 + (W - 1) * x / T` workers computing
(`x` a worker's compute per step, `T` its whole step), each runs on
`min(cores_per_worker, host_cores / n)` cores, so `x = max(w /
cores_per_worker, (w / host_cores) * n)`. When the transfers vanish against
the compute, `T = x` and the workers together run `host_cores / w` steps/s,
the single process's rate. Not modelled: the chief's and the ps tasks' CPU
on the shared host. No TensorFlow.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from tf_distbelief.planner import records

__all__ = ["alone_secs", "compute_at"]


def alone_secs(c: records.Cluster) -> float:
    """One worker's compute of one step with the host's cores to itself.

    Args:
      c: the cluster.

    Returns:
      Seconds: `compute_secs` without a shared host; else the step's
      core-seconds over the cores a worker can use
      (`compute_secs * host_cores / min(cores_per_worker, host_cores)`).
    """
    if c.host_cores is None:
        return c.compute_secs
    cores = c.host_cores if c.cores_per_worker is None else c.cores_per_worker
    return c.compute_secs * c.host_cores / min(cores, c.host_cores)


def compute_at(c: records.Cluster) -> Callable[[float], float] | None:
    """A worker's compute per step as a function of the step's seconds.

    Args:
      c: the cluster.

    Returns:
      None without a shared host (`host_cores` None: the compute is
      `compute_secs` at any step time); else `x(T)`, the mean-field compute
      of the module docstring for a step of `T` seconds, in seconds:
      non-increasing in `T`, infinite where `T` is too short for the host to
      run the other workers' compute beside it.
    """
    if c.host_cores is None:
        return None
    alone = alone_secs(c)
    shared = c.compute_secs  # Core-seconds over the host's cores: w / C.
    others = c.num_workers - 1

    def compute(step_secs: float) -> float:
        # x = max(alone, shared * (1 + others * x / T)): the shared branch is
        # x = shared / (1 - shared * others / T).
        if others == 0 or shared == 0:
            return alone
        room = 1.0 - shared * others / step_secs
        if room <= 0:
            return math.inf
        return max(alone, shared / room)

    return compute
