"""A new strategy in the same process after a failed Downpour trace (issue 9).

The error message of `RowSparseReadError` advises a retry with `row_sparse=[]`;
a user does that in the same process with a new strategy, while the first
coordinator may still be creating the failed trace's per-worker variables.
"""

import numpy as np
import pytest
import tensorflow as tf

import tf_distbelief as tfdb
from tests.fixtures.downpour import _tied_model
from tf_distbelief import downpour

VOCAB, DIM, IDS, CLASSES, BATCH = 20, 4, 3, 3, 4


def _model(local_cluster):
    return _tied_model(local_cluster, VOCAB, DIM, IDS, CLASSES, 0.1)


def _trainer(local_cluster, row_sparse):
    config = downpour.DownpourConfig(3, 2, local_learning_rate=0.05)
    return downpour.DownpourTrainer(
        _model(local_cluster), config, row_sparse=row_sparse
    )


def test_retry_after_row_sparse_read_error_trains(local_cluster):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(8 * BATCH, IDS)).astype(np.int64)
    y = rng.integers(0, CLASSES, size=8 * BATCH)

    def dataset_fn():
        return tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH).repeat()

    trainer = _trainer(local_cluster, row_sparse=None)
    iterator = iter(trainer.per_worker_dataset(dataset_fn))
    with pytest.raises(tfdb.RowSparseReadError, match="row_sparse=\\[\\]"):
        trainer.step(iterator)
    # What the message advises, at once: no wait of the user's own.
    retry = _trainer(local_cluster, row_sparse=[])
    iterator = iter(retry.per_worker_dataset(dataset_fn))
    for _ in range(6):
        retry.step(iterator)
    retry.join()
    assert [s.steps for s in retry.downpour.stats()] == [6]


def test_retry_after_row_sparse_read_error_in_fit_trains(local_cluster):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, size=(8 * BATCH, IDS)).astype(np.int64)
    y = rng.integers(0, CLASSES, size=8 * BATCH)
    dataset = tf.data.Dataset.from_tensor_slices((ids, y)).batch(BATCH).repeat()
    config = downpour.DownpourConfig(3, 2, local_learning_rate=0.05)
    for row_sparse in (None, []):
        model = _model(local_cluster)
        replicas = downpour.install(model, config, row_sparse=row_sparse)
        if row_sparse is None:
            with pytest.raises(tfdb.RowSparseReadError):
                model.fit(dataset, epochs=1, steps_per_epoch=6, verbose=0)
    model.fit(dataset, epochs=1, steps_per_epoch=6, verbose=0)
    assert sum(s.steps for s in replicas.stats()) == 6
