"""The paper's speech model shape (Dean et al. 2012, section 5) on synthetic data.

The paper's acoustic model: 11 frames x 40 log-energies (440 inputs), 4 hidden
layers of 2560 sigmoid units, an 8192-way softmax (about 42M parameters). Width and
classes are configurable; the defaults (256 units, 8192 classes, about 2.4M
parameters) train on a 2-core machine. The data is synthetic and learnable: like
the paper's context-dependent HMM states, the classes are far from equally
frequent (a Zipf prior, class `c` drawn with probability proportional to
`1 / (c + 1)`), and each class is a Gaussian cluster around its own random
centre, so a model first learns the frequent classes and its accuracy climbs well
above the most frequent class's share (about 10% of examples at 8192 classes)
within a few thousand steps. Every run with the same seed gets the same data.
"""

from __future__ import annotations

import numpy as np

from tf_distbelief import checks

NUM_FEATURES = 440  # 11 frames x 40 log-energies.
PAPER_HIDDEN_UNITS = 2560
PAPER_NUM_CLASSES = 8192
NUM_HIDDEN_LAYERS = 4


def check_positive(**values):
    for name, value in values.items():
        checks.check_int(name, value, 1, "a positive integer", "a positive integer")


def load_data(
    num_train=20000,
    num_test=2000,
    num_classes=PAPER_NUM_CLASSES,
    seed=0,
    noise=1.0,
):
    """Returns synthetic `(x_train, y_train), (x_test, y_test)`.

    Args:
      num_train: training examples.
      num_test: test examples.
      num_classes: label classes; class `c` has prior probability proportional to
        `1 / (c + 1)`.
      seed: the NumPy seed of centres, labels and noise.
      noise: standard deviation of the Gaussian noise around each class centre
        (the centres are standard normal), >= 0.

    Returns:
      `x_*`: `[n, 440]` float32; `y_*`: `[n]` int64 in `[0, num_classes)`.
    """
    check_positive(num_train=num_train, num_test=num_test, num_classes=num_classes)
    if not noise >= 0:
        raise checks.argument_error("noise", ">= 0", noise)
    rng = np.random.default_rng(seed)
    prior = 1.0 / np.arange(1, num_classes + 1)
    y = rng.choice(num_classes, size=num_train + num_test, p=prior / prior.sum())
    centres = rng.standard_normal((num_classes, NUM_FEATURES)).astype(np.float32)
    x = centres[y] + noise * rng.standard_normal((len(y), NUM_FEATURES))
    x, y = x.astype(np.float32), y.astype(np.int64)
    return (x[:num_train], y[:num_train]), (x[num_train:], y[num_train:])


def build_model(hidden_units=256, num_classes=PAPER_NUM_CLASSES, seed=0):
    """Returns an uncompiled MLP: 440 -> 4 x `hidden_units` sigmoid -> logits.

    Args:
      hidden_units: width of each hidden layer (2560 in the paper).
      num_classes: softmax width (8192 in the paper).
      seed: initializer seed.

    Returns:
      A tf_keras `Sequential` mapping `[batch, 440]` float32 to
      `[batch, num_classes]` logits.
    """
    # Here, not at the top: the launch script reads this module's sizes
    # before TensorFlow loads (its flags are parsed first).
    import tf_keras

    check_positive(hidden_units=hidden_units, num_classes=num_classes)
    init = tf_keras.initializers.GlorotUniform
    layers = [tf_keras.layers.InputLayer(input_shape=(NUM_FEATURES,))]
    for i in range(NUM_HIDDEN_LAYERS):
        layers.append(
            tf_keras.layers.Dense(
                hidden_units, activation="sigmoid", kernel_initializer=init(seed + i)
            )
        )
    layers.append(
        tf_keras.layers.Dense(num_classes, kernel_initializer=init(seed + 99))
    )
    return tf_keras.Sequential(layers, name="speech_mlp")


def build_keras3_model(hidden_units=256, num_classes=PAPER_NUM_CLASSES, seed=0):
    """`build_model`'s MLP built with Keras 3 (`import keras`, TensorFlow backend).

    Args:
      hidden_units: width of each hidden layer (2560 in the paper).
      num_classes: softmax width (8192 in the paper).
      seed: initializer seed.

    Returns:
      A built Keras 3 `Sequential` mapping `[batch, 440]` float32 to
      `[batch, num_classes]` logits.
    """
    import keras

    check_positive(hidden_units=hidden_units, num_classes=num_classes)
    init = keras.initializers.GlorotUniform
    layers = [keras.Input(shape=(NUM_FEATURES,))]
    for i in range(NUM_HIDDEN_LAYERS):
        layers.append(
            keras.layers.Dense(
                hidden_units, activation="sigmoid", kernel_initializer=init(seed + i)
            )
        )
    layers.append(keras.layers.Dense(num_classes, kernel_initializer=init(seed + 99)))
    return keras.Sequential(layers, name="speech_mlp")
