"""Where one Sandblaster objective evaluation spends its time.

`evaluation_phases` times the phases of `SandblasterObjective.__call__` on the
coordinator by wrapping, on one objective instance only, the calls that start
each phase (the library is not changed), and times alone what happens on the
workers inside "waiting for portions":

| phase | what is timed |
| --- | --- |
| copy of x to the evaluation point | `ops.assign(x, x_eval)`, on the ps |
| scheduling | `ClusterCoordinator.schedule` calls (coordinator Python, enqueue) |
| waiting for portions | `_wait_any`: workers fetch, compute, write local slots |
| reduction | `_reduce`: the accepted slots sent from the workers, summed on the ps |
| other coordinator Python | the rest: ledger, slot pool, tensors, threads |

and, measured alone on the same cluster: one parameter fetch by every worker
at once (a scheduled function that reads `x_eval` whole, as a portion does
once per evaluation), and `portions` no-op scheduled functions (the round trip
of scheduling with no work).
"""

import contextlib
import time

import numpy as np


def _timed(totals, name, function):
    def run(*args, **kwargs):
        start = time.monotonic()
        try:
            return function(*args, **kwargs)
        finally:
            totals[name] += time.monotonic() - start

    return run


@contextlib.contextmanager
def _instrumented(obj, totals):
    obj.ops.assign = _timed(totals, "copy", obj.ops.assign)
    obj.coordinator.schedule = _timed(totals, "schedule", obj.coordinator.schedule)
    obj._wait_any = _timed(totals, "wait", obj._wait_any)
    obj._reduce = _timed(totals, "reduce", obj._reduce)
    try:
        yield
    finally:
        for target, name in [
            (obj.ops, "assign"),
            (obj.coordinator, "schedule"),
            (obj, "_wait_any"),
            (obj, "_reduce"),
        ]:
            delattr(target, name)


def _alone_secs(obj, repeats):
    """`(fetch, no-op portions)` seconds, medians of `repeats`, measured alone."""
    import tensorflow as tf

    shards = obj._x_eval.shards

    @tf.function
    def fetch():
        return tf.reduce_sum(tf.concat([tf.identity(s) for s in shards], axis=0))

    @tf.function
    def noop():
        return tf.constant(0.0, tf.float64)

    results = {}
    for name, function, count in [
        ("fetch", fetch, obj.num_workers),
        ("noop", noop, obj.portions),
    ]:
        times = []
        for _ in range(repeats + 1):  # The first registers the function.
            start = time.monotonic()
            remotes = [obj.coordinator.schedule(function) for _ in range(count)]
            for remote in remotes:
                remote.fetch()
            times.append(time.monotonic() - start)
        results[name] = float(np.median(times[1:]))
    return results["fetch"], results["noop"]


def parallel_capacity(obj, repeats):
    """What the workers' cores give together: one whole-batch portion alone, then
    one per worker at once.

    Args:
      obj: a `SandblasterObjective` of 1 portion (the whole batch), warmed up
        or not: each measurement is preceded by one untimed run.
      repeats: timed runs of each; the medians are returned.

    Returns:
      `(one, together)`: seconds for one portion on one worker while the
      others idle, and for `obj.num_workers` of them scheduled at once (one
      per idle worker, as `ClusterCoordinator` hands them out). On cores of
      their own `together == one`; on shared cores more.
    """
    from tf_distbelief.sandblaster import portion

    def run(count):
        start = time.monotonic()
        remotes = [
            # Evaluation id -1: each worker fetches x_eval once.
            obj.coordinator.schedule(
                obj.portion_function, args=(portion.pack_call(0, i, -1),)
            )
            for i in range(count)
        ]
        for remote in remotes:
            remote.fetch()
        return time.monotonic() - start

    medians = []
    for count in (1, obj.num_workers):
        times = [run(count) for _ in range(repeats + 1)][1:]
        medians.append(float(np.median(times)))
    return medians[0], medians[1]


def evaluation_phases(obj, x_vector, batches):
    """Rows `[phase, secs per evaluation, share]` of one evaluation's time.

    Args:
      obj: a `SandblasterObjective` on a running cluster, warmed up.
      x_vector: the point evaluated, a vector of `obj.ops` other than the
        objective's own evaluation point (so the copy happens, as in L-BFGS).
      batches: evaluations timed; each phase is their mean.

    Returns:
      Table rows, the total last.
    """
    totals = dict.fromkeys(["copy", "schedule", "wait", "reduce"], 0.0)
    start = time.monotonic()
    with _instrumented(obj, totals):
        for _ in range(batches):
            obj(x_vector)
    total = (time.monotonic() - start) / batches
    phases = {name: secs / batches for name, secs in totals.items()}
    phases["other"] = total - sum(phases.values())
    fetch, noop = _alone_secs(obj, batches)
    labels = {
        "copy": "copy of x to the evaluation point (ps)",
        "schedule": f"scheduling: {obj.portions}+ ClusterCoordinator.schedule calls",
        "wait": "waiting for portions (workers: fetch, compute, local slot writes)",
        "reduce": "reduction: accepted slots from the workers, summed on the ps",
        "other": "other coordinator Python (ledger, slots, threads)",
    }
    rows = [
        [labels[name], f"{secs:.4f}", f"{secs / total:.0%}"]
        for name, secs in phases.items()
    ]
    rows.append(["evaluation, total", f"{total:.4f}", "100%"])
    rows.append(
        [
            f"  alone: one parameter fetch by each of {obj.num_workers} workers",
            f"{fetch:.4f}",
            f"{fetch / total:.0%}",
        ]
    )
    rows.append(
        [
            f"  alone: {obj.portions} no-op scheduled functions",
            f"{noop:.4f}",
            f"{noop / total:.0%}",
        ]
    )
    return rows
