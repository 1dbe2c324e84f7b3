"""The outer rule's last round: the replicas' unsent progress reaches the ps.

With the outer rule (`push_rules.outer_nesterov`) a replica's progress since
its last push lives only in its cache: the local steps of a round not
finished when training ends, and with compressed pushes everything the
compression has not sent yet (`stream_fetch`'s parameter-space residual;
with the top 1% of each tensor pushed, most of a replica's progress at any
time). Without a last round it never reaches the ps, whose values are the
trained model.

`finish`, after the job's last step (no step in flight), moves the ps values
by the mean of the replicas' unsent progress, replica `i = 0 .. W-1` in
turn: `w <- w - u_i / W`, where `u_i = w'_i - cache_i` with update-stream
fetches (the replica's mirror of the ps less its cache) and the replica's
summed local steps since its last push otherwise. No outer learning rate,
momentum or damping: a synchronous round's average of where the replicas
got to (DiLoCo's outer step at rate 1 without momentum, Douillard et al.
2023), so that the model ends where the replicas' training took it rather
than one outer step behind. Then every replica starts its next round from
the ps (a refetch; with update-stream fetches its mirror is dropped and the
log restarted, `update_log.UpdateLog.restart`), so that a later `fit`
sends nothing twice.

A replica whose worker does not answer within `WAIT_SECS`, or whose unsent
progress holds a NaN or inf, is left out (a line says which); the mean
still divides by `W`. Which configs have a last round:
`DownpourConfig.has_final_round`. The NumPy side is
`schedule.simulate(final_round=True)` and `update_stream.simulate(
final_round=True)`. With sparse fetches, or without the outer rule, there is
no last round: pushes there are gradients the ps optimizer applies, which
a mean of parameter deltas is not.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import base
from tf_distbelief.tf_internals import variables as tf_variables

__all__ = ["finish"]

# How long the last round waits for a worker's variables (as long as a
# checkpoint's capture of them waits, `replica_state.WAIT_SECS`).
WAIT_SECS = 60.0


def finish(config, workers: int, dense, stream, refetch) -> list[str]:
    """Runs the last round (module docstring): `replica.Downpour.finish`.

    Call it when no step is in flight (after `ClusterCoordinator.join`), once
    per job, after its last step.

    Args:
      config: the `DownpourConfig`.
      workers: the model replicas (workers), `W`.
      dense: the `dense.DenseVariables` (the ps variables, the caches and
        the summed local steps).
      stream: the `stream_fetch.StreamFetch`, or None.
      refetch: the per-worker int64 flag whose 1 makes a replica's next step
        fetch.

    Returns:
      Lines for the console: what reached the ps, and each replica left out
      and why; empty when the config has no last round or no replica has
      stepped yet.
    """
    stepped = tf_variables.per_worker_values_exist(dense.caches[0])
    if not config.has_final_round or not stepped:
        return []
    workers = max(1, int(workers))
    left_out = []
    delivered = 0
    for i in range(workers):
        mine = _worker_state(i, dense, stream, refetch)
        if mine is None:
            left_out.append(
                f"replica {i}: its worker did not answer within {WAIT_SECS:g} s"
            )
            continue
        caches, sums, mirrors, refetches, mirrored = mine
        if stream is not None:
            unsent = [m.read_value() - c.read_value() for m, c in zip(mirrors, caches)]
        else:
            unsent = [s.read_value() for s in sums]
        finite = all(bool(tf.reduce_all(tf.math.is_finite(u))) for u in unsent)
        if not finite:
            left_out.append(f"replica {i}: its unsent progress holds NaN or inf")
        else:
            for v, u in zip(dense.variables, unsent):
                with tf.device(v.device):
                    base.add(base.ps_handle(v), -(u / tf.cast(workers, u.dtype)))
            delivered += 1
        # Its next step starts a round from the ps: nothing is sent twice.
        for s in sums:
            s.assign(tf.zeros_like(s))
        refetches.assign(tf.constant(1, tf.int64))
        if mirrored is not None:
            mirrored.assign(tf.constant(0, tf.int64))
    if stream is not None:
        stream.log.restart()  # The ps moved outside the log: fetches go whole.
    lines = [
        f"downpour: last round, {delivered} of {workers} replicas' unsent "
        "progress averaged into the ps"
    ]
    lines += [f"downpour: last round left out {why}" for why in left_out]
    return lines


def _worker_state(index: int, dense, stream, refetch):
    """Worker `index`'s `(caches, sums, mirrors, refetch, mirrored)`, its own
    variables (`mirrors` empty and `mirrored` None without update-stream
    fetches); None if they are not there within `WAIT_SECS`."""

    def own(variables):
        out = [tf_variables.worker_variable(v, index, WAIT_SECS) for v in variables]
        return None if any(x is None for x in out) else out

    caches = own(dense.caches)
    sums = own(dense.accumulators)
    flags = own([refetch])
    mirrors, mirrored = [], None
    if stream is not None:
        mirrors = own(stream.mirrors)
        flag = own([stream.mirrored_flag])
        mirrored = None if flag is None else flag[0]
        if mirrors is None or mirrored is None:
            return None
    if caches is None or sums is None or flags is None:
        return None
    return caches, sums, mirrors, flags[0], mirrored
