"""Batched operations on vectors sharded over ps tasks, for vector-free L-BFGS.

`ps_vectors.PsVectorOps.combine` and `.gram` call these `tf.function`s: each
does on every shard, in one call from the coordinator, what the vector-free
two-loop recursion (Chen, Wang and Zhou, NIPS 2014; `sandblaster.two_loop`)
would otherwise do in `2 m + 1` operations. Vectors are passed as tuples of
their shard variables; the shards' devices are python arguments (part of the
trace key), as in `ps_vectors`.
"""

import tensorflow as tf

__all__ = ["combine", "gram"]


def _combination(coefficients, vectors, shard: int):
    # Summed in order, as `NumpyVectorOps.combine`: c_0 v_0 + c_1 v_1 + ...
    total = coefficients[0] * vectors[0][shard]
    for j in range(1, len(vectors)):
        total = total + coefficients[j] * vectors[j][shard]
    return total


@tf.function(autograph=False)
def combine(devices, coefficients, vectors, outs):
    """On each shard `i`: `outs[i] <- sum_j coefficients[j] * vectors[j][i]`.

    Args:
      devices: the ps device of each shard.
      coefficients: `[k]` float64.
      vectors: `k` tuples of shard variables.
      outs: the output vector's shard variables.
    """
    for i, (device, out) in enumerate(zip(devices, outs)):
        with tf.device(device):
            out.assign(_combination(coefficients, vectors, i))


@tf.function(autograph=False)
def gram(coordinator_device, devices, updates, rows, columns):
    """Applies `updates` on each shard, then returns `rows · columns^T`.

    Args:
      coordinator_device: where the shards' `[r, c]` partial sums are added.
      devices: the ps device of each shard.
      updates: `(coefficients, vectors, outs)` triples, each as `combine`.
      rows: `r` tuples of shard variables.
      columns: `c` tuples of shard variables.

    Returns:
      `[r, c]` float64 on the coordinator.
    """
    # Each shard applies the updates, then multiplies its slices of the rows
    # and columns: `[r, n_i] x [n_i, c]`, one matmul; only the `[r, c]`
    # partial sums come back, added on the coordinator. Automatic control
    # dependencies order each read after the writes to its variable.
    partials = []
    for i, device in enumerate(devices):
        with tf.device(device):
            for coefficients, vectors, outs in updates:
                outs[i].assign(_combination(coefficients, vectors, i))
            row_slices = tf.stack([r[i] for r in rows])
            column_slices = tf.stack([c[i] for c in columns])
            partials.append(tf.matmul(row_slices, column_slices, transpose_b=True))
    with tf.device(coordinator_device):
        return tf.add_n(partials)
