"""Downpour with row-sparse embedding tables: only looked-up rows move.

The exact runs compare the ps parameters with `downpour_schedule.simulate` given
`row_sparse` (rows fetched when first read after a fetch, pushed when touched),
and check that the test can tell those semantics from whole-table caching.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.downpour import _tied_model
from tests.fixtures.helpers import cluster_bytes
from tf_distbelief import adagrad, downpour
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.downpour import config as downpour_config
from tf_distbelief.downpour import schedule as downpour_schedule
from tf_distbelief.downpour import variables as downpour_variables

VOCAB, DIM, IDS, CLASSES, BATCH, STEPS = 20, 4, 3, 3, 4, 12
LEARNING_RATE = 0.1
CONFIG = downpour_config.DownpourConfig(3, 2, local_learning_rate=0.05)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(STEPS * BATCH, IDS)).astype(np.int64)
    y = rng.integers(0, CLASSES, size=STEPS * BATCH)
    table = rng.normal(size=(VOCAB, DIM)) * 0.5
    kernel = rng.normal(size=(DIM, CLASSES)) * 0.5
    bias = rng.normal(size=CLASSES) * 0.1
    return ids, y, [table, kernel, bias]


def _grad(params, batch):
    """Mean softmax cross-entropy of `mean(table[ids]) @ kernel + bias`."""
    (table, kernel, bias), (ids, y) = params, batch
    e = table[ids].mean(axis=1)
    logits = e @ kernel + bias
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    p /= len(y)
    d_table = np.zeros_like(table)
    np.add.at(d_table, ids, np.repeat((p @ kernel.T)[:, None, :] / IDS, IDS, 1))
    return [d_table, e.T @ p, p.sum(axis=0)]


def _batches(ids, y):
    return [(ids[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(y), BATCH)]


def _simulate(params, ids, y, row_sparse, config=CONFIG):
    return downpour_schedule.simulate(
        params,
        _grad,
        [_batches(ids, y)],
        config,
        downpour_schedule.adagrad_ps(LEARNING_RATE),
        row_sparse=[0] if row_sparse else (),
        rows_fn=lambda batch: {0: batch[0]},
    )


def _model(local_cluster, params):
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=2),
        tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
    )
    downpour.enable(strategy)
    table, kernel, bias = params
    constant = tf_keras.initializers.Constant
    with strategy.scope():
        model = tf_keras.Sequential(
            [
                tf_keras.layers.InputLayer(input_shape=(IDS,), dtype="int64"),
                tf_keras.layers.Embedding(
                    VOCAB, DIM, embeddings_initializer=constant(table), dtype="float64"
                ),
                tf_keras.layers.GlobalAveragePooling1D(dtype="float64"),
                tf_keras.layers.Dense(
                    CLASSES,
                    kernel_initializer=constant(kernel),
                    bias_initializer=constant(bias),
                    dtype="float64",
                ),
            ]
        )
        model.compile(
            adagrad.Adagrad(LEARNING_RATE),
            loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def _ps_params(model):
    """Table, kernel and bias from the ps, shards concatenated along axis 0."""
    out = []
    dense = model.layers[2]
    for variable in (model.layers[0].embeddings, dense.kernel, dense.bias):
        shards = getattr(variable, "variables", [variable])
        out.append(np.concatenate([s.numpy() for s in shards]))
    return out


@pytest.mark.parametrize(
    "loop, cadence, row_sparse",
    [
        ("trainer", (3, 2), True),
        ("trainer", (3, 2), False),
        ("fit", (3, 2), True),
        ("fit", (3, 2), False),
        ("trainer", (1, 1), True),
        ("trainer", (1, 3), True),
        ("trainer", (2, 1), True),
        ("fit", (1, 1), True),
    ],
)
def test_embedding_rows_match_numpy_reference(local_cluster, loop, cadence, row_sparse):
    config = downpour_config.DownpourConfig(*cadence, local_learning_rate=0.05)
    ids, y, params = _data()
    model = _model(local_cluster, params)
    table_shards = model.layers[0].embeddings.variables
    assert len(table_shards) == 2  # The lookups cross a shard boundary.
    row_sparse_arg = None if row_sparse else []
    if loop == "trainer":
        trainer = downpour.DownpourTrainer(model, config, row_sparse=row_sparse_arg)
        replicas = trainer.downpour
        iterator = iter(
            trainer.per_worker_dataset(
                lambda: tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)
            )
        )
        logs = [trainer.step(iterator) for _ in range(STEPS)]
        trainer.join()
    else:
        replicas = downpour.install(model, config, row_sparse=row_sparse_arg)
        assert replicas.runs_segments == (min(cadence) > 1)
        dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH).repeat()
        model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0)
    assert replicas.row_sparse == [row_sparse] * 2 + [False] * 4
    want, (want_stats,) = _simulate(params, ids, y, row_sparse, config)
    for got, w in zip(_ps_params(model), want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    if cadence == (3, 2):
        # The two semantics differ on this data: the test tells them apart.
        other, _ = _simulate(params, ids, y, not row_sparse, config)
        assert np.abs(other[0] - want[0]).max() > 1e-4
    (stats,) = replicas.stats()
    assert (stats.steps, stats.fetches, stats.pushes) == (
        STEPS,
        downpour_schedule.num_fetches(STEPS, cadence[0]),
        downpour_schedule.num_pushes(STEPS, cadence[1]),
    )
    assert stats.row_bytes_fetched == want_stats.row_bytes_fetched
    assert stats.row_bytes_pushed == want_stats.row_bytes_pushed
    assert stats.bytes_fetched == want_stats.bytes_fetched
    assert stats.bytes_pushed == want_stats.bytes_pushed
    table_bytes = VOCAB * DIM * 8
    if row_sparse:
        # Rows: a row read twice between two fetches is fetched once.
        assert 0 < stats.row_bytes_fetched < stats.fetches * table_bytes
        unique = [np.unique(b[0]).size for b in _batches(ids, y)]
        assert stats.row_bytes_fetched <= sum(unique) * DIM * 8
    else:
        assert stats.row_bytes_fetched == stats.row_bytes_pushed == 0
    if loop == "trainer":
        per_step = [log.fetch() for log in logs]
        assert sum(int(log["bytes_fetched"]) for log in per_step) == (
            stats.bytes_fetched
        )
        assert sum(int(log["bytes_pushed"]) for log in per_step) == (stats.bytes_pushed)


def test_row_sparse_errors(local_cluster):
    ids, y, params = _data()
    model = _model(local_cluster, params)
    outsider = tf.Variable(tf.zeros([3, 2]), name="outsider")
    with pytest.raises(ValueError, match=r"`row_sparse` must hold.*outsider"):
        downpour.install(model, CONFIG, row_sparse=[outsider])
    embedding_layer = model.layers[0]
    for bad in ("embedding", embedding_layer):
        with pytest.raises(TypeError, match=r"`row_sparse` must be a list of var"):
            downpour.install(model, CONFIG, row_sparse=[bad])
    # A bare table is taken as a list of one.
    replicas = downpour.Downpour(
        model.distribute_strategy,
        model.trainable_variables,
        model.optimizer,
        CONFIG,
        row_sparse=embedding_layer.embeddings,
    )
    assert replicas.row_sparse == [True] * 2 + [False] * 4


def test_reading_a_sharded_row_sparse_table_whole_names_it(local_cluster):
    ids, y, (table, kernel, bias) = _data()
    model = _tied_model(local_cluster, VOCAB, DIM, IDS, CLASSES, LEARNING_RATE)
    embedding_layer = model.get_layer("tied")
    assert len(embedding_layer.embeddings.variables) == 2
    trainer = downpour.DownpourTrainer(model, CONFIG)
    iterator = iter(
        trainer.per_worker_dataset(
            lambda: tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH)
        )
    )
    with pytest.raises(
        downpour_variables.RowSparseReadError,
        match=r"tied/embeddings/part_0.*row-sparse.*read it whole",
    ):
        trainer.step(iterator)
    # Tracing created the per-worker variables (caches first, counters last)
    # and the iterator asynchronously, on the coordinator's worker threads.
    # Reading the counters waits for all of them: one still being created when
    # the next test connects to the cluster anew crashed the process (SIGSEGV
    # in TensorFlow's eager runtime).
    assert [s.steps for s in trainer.downpour.stats()] == [0]


def test_frozen_embedding_is_not_row_sparse(local_cluster):
    ids, y, params = _data()
    model = _model(local_cluster, params)
    model.layers[0].trainable = False
    assert downpour.embedding_tables(model) == []
    replicas = downpour.install(model, CONFIG)
    assert replicas.row_sparse == [False] * 4  # Kernel and bias shards only.
    dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH).repeat()
    model.fit(dataset, epochs=1, steps_per_epoch=4, verbose=0)
    np.testing.assert_array_equal(_ps_params(model)[0], params[0])


@pytest.mark.slow
def test_large_table_moves_rows_not_the_table(local_cluster):
    """A 25.6 MB table: the cluster's bytes in 8 steps, rows against whole."""
    from tf_distbelief.demos import embedding

    vocab, dim, ids_per_example, batch = 100_000, 64, 8, 32
    (x, y), _ = embedding.load_data(vocab, ids_per_example, num_train=2048)
    table_bytes = vocab * dim * 4
    moved = {}
    for row_sparse in (None, []):
        strategy = strategy_lib.DistBeliefStrategy(
            local_cluster.resolver_for(num_workers=1, num_ps=2),
            tf.distribute.experimental.partitioners.FixedShardsPartitioner(2),
        )
        downpour.enable(strategy)
        with strategy.scope():
            model = embedding.build_model(vocab, dim)
            model.build((None, ids_per_example))
            model.compile(
                adagrad.Adagrad(0.1),
                loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        trainer = downpour.DownpourTrainer(
            model, downpour_config.DownpourConfig(4, 4, 0.05), row_sparse
        )
        iterator = iter(
            trainer.per_worker_dataset(
                lambda: tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
            )
        )
        for _ in range(4):  # Traces, creates the caches, one fetch and push.
            trainer.step(iterator)
        trainer.join()
        before, (stats_before,) = cluster_bytes(local_cluster), trainer.stats()
        for _ in range(8):
            trainer.step(iterator)
        trainer.join()
        moved[row_sparse is None] = cluster_bytes(local_cluster) - before
        (stats,) = trainer.stats()
        tensors = (stats.bytes_fetched + stats.bytes_pushed) - (
            stats_before.bytes_fetched + stats_before.bytes_pushed
        )
        assert moved[row_sparse is None] >= tensors
    print(f"cluster bytes of 8 steps: {moved}, table {table_bytes}")
    # Whole: 2 fetches of the table, and 2 pushes of it with its squared
    # gradients (AdaGrad's default `adagrad_accumulator="squares"`). Rows: at
    # most 8 * 32 * 8 = 2048 ids, fetched at 256 B and pushed at 2 * 256 + 8 B:
    # 1.59 MB, 6.2% of the table, plus gRPC framing.
    assert moved[False] >= 6 * table_bytes, moved
    assert moved[True] < table_bytes / 10, moved
