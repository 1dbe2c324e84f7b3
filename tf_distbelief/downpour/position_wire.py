"""A push's positions on the wire, in TensorFlow: `position_codes`' `chunk16`.

`position_codes.wire_coding` chooses how a tensor's kept positions are
written (and its `position_nbytes` counts their bytes); this module writes
and reads them in TensorFlow ops, for the compressed push
(`push_rules.compression`), the ps's log of pushes and the replays of it
(`stream_fetch`). A tensor of `n` entries with `k` kept positions is sent as
two parts, the same for every tensor so that the parts of a ps task's
variables travel concatenated:

* `offsets`: uint16 `[k]`, each position less its chunk's start (chunks of
  `position_codes.WIRE_CHUNK` = 65,536 entries);
* `counts`: int32 `[c]`, the positions in each chunk, `c =
  position_codes.chunk16_counts(n)`: none (`[0]`) when `n <= 65536`, whose
  offsets are the positions.

Positions are grouped by chunk (`group`, `position_codes.wire_order` in
NumPy) before the values are gathered, so that `decode` gives them back in
the order the values were sent: for one chunk, top-k's own order.
"""

from __future__ import annotations

import tensorflow as tf

from tf_distbelief.downpour import position_codes

__all__ = ["decode", "encode", "group"]


def group(positions, size: int):
    """`positions` (int32 `[k]`) grouped by chunk, stably, as
    `position_codes.wire_order`; the same tensor for a one-chunk tensor.

    Args:
      positions: the kept entries' flat indices, an int32 tensor `[k]`.
      size: the tensor's entries.
    """
    if position_codes.chunk16_counts(size) == 0:
        return positions
    chunks = positions // position_codes.WIRE_CHUNK
    return tf.gather(positions, tf.argsort(chunks, stable=True))


def encode(positions, size: int) -> tuple:
    """`(offsets, counts)` of `positions`, grouped by chunk (`group`).

    Args:
      positions: int32 `[k]`, grouped by chunk.
      size: the tensor's entries.

    Returns:
      uint16 `[k]` and int32 `[position_codes.chunk16_counts(size)]`.
    """
    chunk = position_codes.WIRE_CHUNK
    offsets = tf.cast(positions % chunk, tf.uint16)
    c = position_codes.chunk16_counts(size)
    if c == 0:
        return offsets, tf.zeros([0], tf.int32)
    counts = tf.math.bincount(
        positions // chunk, minlength=c, maxlength=c, dtype=tf.int32
    )
    # Static: a ps task's parts travel concatenated and are split by size.
    counts.set_shape([c])
    return offsets, counts


def decode(offsets, counts, size: int):
    """The int32 positions `[k]` that `encode` wrote as `offsets`, `counts`.

    Args:
      offsets: uint16 `[k]`.
      counts: int32 `[position_codes.chunk16_counts(size)]`.
      size: the tensor's entries.
    """
    positions = tf.cast(offsets, tf.int32)
    c = position_codes.chunk16_counts(size)
    if c == 0:
        return positions
    chunks = tf.repeat(tf.range(c, dtype=tf.int32), counts)
    chunks.set_shape(offsets.shape)
    return chunks * position_codes.WIRE_CHUNK + positions
