"""A push's positions on the wire: `position_wire` against `position_codes`.

The TensorFlow coding (`chunk16`: uint16 offsets within chunks of 65,536
entries, per-chunk counts for a larger tensor) gives back the positions it
was given, in the order `position_codes.wire_order` puts them, for tensors
smaller and larger than a chunk; a compressed push of a tensor of several
chunks decodes on the ps to `reference.compress`; and the bytes a replica
counts for its pushes (the `downpour:` line's `pushed`, `ReplicaStats`) are
`position_codes`' figure for the coding plus the values' bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.downpour import (
    STEPS,
    _dataset,
    _softmax_data,
    _softmax_model,
    _strategy,
)
from tf_distbelief import console, downpour
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import position_codes, position_wire, report
from tf_distbelief.downpour.push_rules import compression
from tf_distbelief.downpour.push_rules import reference as push_reference

Config = downpour_config.DownpourConfig
CHUNK = position_codes.WIRE_CHUNK


def _top_k_like(size, k, seed):
    """`k` distinct positions of `size` in a random order (top-k's order is
    by magnitude, not by position)."""
    return np.random.default_rng(seed).permutation(size)[:k].astype(np.int32)


@pytest.mark.parametrize(
    "size, k",
    [(1, 1), (1_000, 37), (CHUNK, CHUNK), (CHUNK + 1, 700), (3 * CHUNK + 5, 2_000)],
)
def test_positions_round_trip(size, k):
    positions = _top_k_like(size, k, seed=size)
    grouped = position_wire.group(tf.constant(positions), size)
    want = position_codes.wire_order(positions, size)
    np.testing.assert_array_equal(grouped.numpy(), want)
    if size <= CHUNK:  # One chunk: top-k's order.
        np.testing.assert_array_equal(want, positions)
    else:  # Grouped by chunk, top-k's order within each.
        chunks = want // CHUNK
        assert np.all(np.diff(chunks) >= 0)
        for c in np.unique(chunks):
            np.testing.assert_array_equal(
                want[chunks == c], positions[positions // CHUNK == c]
            )
    offsets, counts = position_wire.encode(grouped, size)
    assert (offsets.dtype, counts.dtype) == (tf.uint16, tf.int32)
    assert counts.shape == [position_codes.chunk16_counts(size)]
    decoded = position_wire.decode(offsets, counts, size)
    assert decoded.dtype == tf.int32
    np.testing.assert_array_equal(decoded.numpy(), want)
    nbytes = offsets.shape.num_elements() * 2 + counts.shape.num_elements() * 4
    assert nbytes == position_codes.position_nbytes(positions, size, "chunk16")
    assert nbytes == position_codes.position_nbytes(positions, size, "wire")
    assert nbytes == 2 * k + (4 * -(-size // CHUNK) if size > CHUNK else 0)


def test_an_empty_chunk_round_trips():
    size = 3 * CHUNK
    positions = np.array([2 * CHUNK + 7, 3, 2 * CHUNK, CHUNK - 1], np.int32)
    offsets, counts = position_wire.encode(
        position_wire.group(tf.constant(positions), size), size
    )
    np.testing.assert_array_equal(counts.numpy(), [2, 0, 2])
    decoded = position_wire.decode(offsets, counts, size)
    np.testing.assert_array_equal(
        decoded.numpy(), [3, CHUNK - 1, 2 * CHUNK + 7, 2 * CHUNK]
    )


@pytest.mark.parametrize("bits", [0, 2], ids=["values", "2 bits"])
def test_a_push_of_several_chunks_decodes_to_the_reference(bits):
    config = Config(top_k_fraction=0.01, quantize_bits=bits)
    shape = (3, CHUNK + 11)  # 4 chunks, the last short.
    variable = tf.Variable(np.zeros(shape, np.float32))
    push = compression.CompressedPush(config.rules, [variable])
    x = np.random.default_rng(4).normal(size=shape).astype(np.float32)
    _, (parts,), (sent,) = push.encode(push.handles(), [tf.constant(x)])
    (want,) = push_reference.compress(config.rules, [x])
    np.testing.assert_array_equal(sent.numpy(), want)
    (decoded,), _ = push.to_ps([parts], [[0]])
    np.testing.assert_array_equal(decoded.numpy(), want)
    k = round(0.01 * x.size)
    assert np.count_nonzero(want) <= k
    positions = np.zeros(k, np.int64)
    values = k * 4 if not bits else -(-k // 4) + -(-k // 256) * 4
    nbytes = position_codes.position_nbytes(positions, x.size, "chunk16") + values
    assert nbytes == 2 * k + 4 * 4 + values
    assert push.nbytes == nbytes == push_reference.push_nbytes(config.rules, [x])


def test_a_traced_push_of_several_tensors_travels_concatenated():
    """In a traced step (as on the cluster) the parts of a ps task's tensors
    are concatenated and split by their static sizes: the counts of a tensor
    of several chunks have a static shape too."""
    config = Config(top_k_fraction=0.01, quantize_bits=2)
    shapes = [(3, CHUNK + 11), (40,)]
    variables = [tf.Variable(np.zeros(s, np.float32)) for s in shapes]
    push = compression.CompressedPush(config.rules, variables)
    rng = np.random.default_rng(5)
    xs = [rng.normal(size=s).astype(np.float32) for s in shapes]

    @tf.function
    def step(values):
        _, parts, _ = push.encode(push.handles(), values)
        decoded, _ = push.to_ps(parts, [[0, 1]])
        return decoded

    decoded = step([tf.constant(x) for x in xs])
    for got, want in zip(decoded, push_reference.compress(config.rules, xs)):
        np.testing.assert_array_equal(got.numpy(), want)


def test_counted_push_bytes_are_the_wire_codings(local_cluster):
    """One worker with update-stream fetches: each push counts, per variable,
    `position_codes`' bytes for the wire's coding and the values' codes and
    scales; each log entry on the ps is as large."""
    config = Config(
        3,
        3,
        outer_learning_rate=0.35,
        outer_momentum=0.9,
        top_k_fraction=0.2,
        quantize_bits=2,
        quantize_chunk=4,
    )
    x, y, params = _softmax_data(seed=5)
    model = _softmax_model(_strategy(local_cluster), params)
    trainer = downpour.DownpourTrainer(model, config)
    iterator = iter(trainer.per_worker_dataset(lambda: _dataset(x, y).repeat()))
    for _ in range(STEPS):
        trainer.step(iterator)
    trainer.join()
    (coder,) = [r for r in config.rules if r.codes]
    per_variable = []
    for p in params:
        k = round(0.2 * p.size)
        where = np.zeros(k, np.int64)
        positions = position_codes.position_nbytes(where, p.size, "wire")
        assert positions == 2 * k  # One chunk each: no count.
        per_variable.append(positions + coder.coded_nbytes(k, p.itemsize))
    (stats,) = trainer.stats()
    assert stats.pushes > 0
    assert stats.bytes_pushed == stats.pushes * sum(per_variable)
    assert trainer.downpour._stream.log.part_nbytes == per_variable
    line = report.summary_line([stats])
    assert line.endswith(f"pushed {console.size(stats.pushes * sum(per_variable))}")
