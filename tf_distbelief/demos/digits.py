"""Handwritten digits (scikit-learn's copy of the UCI set): data and a classifier.

The data ships inside scikit-learn (1,797 8x8 images, 10 classes), so nothing is
downloaded. The split is fixed: `test_fraction` of the examples, stratified, with
`seed`.
"""

from __future__ import annotations

import numpy as np
import tf_keras

from tf_distbelief import checks

NUM_FEATURES = 64
NUM_CLASSES = 10


def load_data(test_fraction: float = 0.25, seed: int = 0, dtype=np.float32):
    """Returns `(x_train, y_train), (x_test, y_test)`.

    Args:
      test_fraction: share of examples held out, in (0, 1).
      seed: the split's random seed (fixed: the same split every run).
      dtype: dtype of the features.

    Returns:
      `x_*`: `[n, 64]` pixel values scaled to [0, 1]; `y_*`: `[n]` int64 labels.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    if not 0 < test_fraction < 1:
        raise checks.argument_error("test_fraction", "in (0, 1)", test_fraction)
    digits = load_digits()
    x = (digits.data / 16.0).astype(dtype)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return (x_train, y_train), (x_test, y_test)


def build_model(hidden_units: int = 64, seed: int = 0) -> tf_keras.Model:
    """Returns an uncompiled MLP: 64 -> `hidden_units` (relu) -> 10 logits.

    Args:
      hidden_units: width of the hidden layer.
      seed: initializer seed.

    Returns:
      A tf_keras `Sequential` mapping `[batch, 64]` float32 to `[batch, 10]` logits.
    """
    init = tf_keras.initializers.GlorotUniform
    return tf_keras.Sequential(
        [
            tf_keras.layers.InputLayer(input_shape=(NUM_FEATURES,)),
            tf_keras.layers.Dense(
                hidden_units, activation="relu", kernel_initializer=init(seed)
            ),
            tf_keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(seed + 1)),
        ],
        name="digits_mlp",
    )


def build_keras3_model(hidden_units: int = 64, seed: int = 0):
    """`build_model`'s MLP built with Keras 3 (`import keras`, TensorFlow backend).

    For `tf_distbelief.keras3.fit` (`launch/train.py --keras=3`); build it
    outside the strategy's scope.

    Args:
      hidden_units: width of the hidden layer.
      seed: initializer seed.

    Returns:
      A built Keras 3 `Sequential` mapping `[batch, 64]` float32 to
      `[batch, 10]` logits.
    """
    import keras

    init = keras.initializers.GlorotUniform
    return keras.Sequential(
        [
            keras.Input(shape=(NUM_FEATURES,)),
            keras.layers.Dense(
                hidden_units, activation="relu", kernel_initializer=init(seed)
            ),
            keras.layers.Dense(NUM_CLASSES, kernel_initializer=init(seed + 1)),
        ],
        name="digits_mlp",
    )
