"""A bag-of-ids classifier with a large Embedding, for sharding work.

The embedding table (`vocab_size x embedding_dim`) is the variable that a
partitioner cuts over the ps tasks; a lookup reads only the rows of the ids it is
given. The data is synthetic: each example is `ids_per_example` ids, its label
the class that a fixed random table assigns to the majority of them.
"""

from __future__ import annotations

import numpy as np
import tf_keras

from tf_distbelief import checks


def load_data(
    vocab_size=100_000,
    ids_per_example=8,
    num_classes=10,
    num_train=20000,
    num_test=2000,
    seed=0,
):
    """Returns synthetic `(x_train, y_train), (x_test, y_test)`.

    Args:
      vocab_size: number of distinct ids.
      ids_per_example: ids in one example.
      num_classes: label classes.
      num_train: training examples.
      num_test: test examples.
      seed: NumPy seed.

    Returns:
      `x_*`: `[n, ids_per_example]` int64 ids; `y_*`: `[n]` int64 labels.
    """
    for name, value in locals().items():
        if name != "seed":
            checks.check_int(name, value, 1, "a positive integer", "a positive integer")
    rng = np.random.default_rng(seed)
    id_class = rng.integers(0, num_classes, vocab_size)
    # Examples draw their ids from a small active vocabulary so that rows repeat
    # often enough to be learned.
    active = rng.choice(vocab_size, min(vocab_size, 2000), replace=False)
    x = rng.choice(active, (num_train + num_test, ids_per_example)).astype(np.int64)
    y = np.array(
        [np.bincount(id_class[row], minlength=num_classes).argmax() for row in x],
        dtype=np.int64,
    )
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def build_model(vocab_size=100_000, embedding_dim=64, num_classes=10, seed=0):
    """Returns an uncompiled model: Embedding -> mean over ids -> Dense logits.

    Args:
      vocab_size: rows of the embedding table.
      embedding_dim: columns of the embedding table.
      num_classes: logits.
      seed: initializer seed.

    Returns:
      A tf_keras `Sequential` mapping `[batch, ids]` int64 to `[batch, num_classes]`.
    """
    return tf_keras.Sequential(
        [
            tf_keras.layers.Embedding(
                vocab_size,
                embedding_dim,
                embeddings_initializer=tf_keras.initializers.RandomUniform(
                    -0.05, 0.05, seed=seed
                ),
                name="embedding",
            ),
            tf_keras.layers.GlobalAveragePooling1D(),
            tf_keras.layers.Dense(
                num_classes,
                kernel_initializer=tf_keras.initializers.GlorotUniform(seed + 1),
                name="logits",
            ),
        ],
        name="embedding_classifier",
    )
