"""A user's own model and data as a tf_distbelief `ModelSpec` (README: "Your
own model").

Train it with `tf-distbelief-train --model=tf_distbelief.demos.blobs:spec`
(or `python launch/train.py ...` in the repository): a spec is imported by name
like any module (from the working directory or PYTHONPATH), so a user's own
file works the same way. The data
are Gaussian blobs made here, so the example runs offline.
"""

import numpy as np
import tf_keras

from tf_distbelief.job import ModelSpec

NUM_FEATURES, NUM_CLASSES = 16, 4


def load_data(seed: int = 0):
    """Four Gaussian blobs in 16 dimensions: 2,000 training, 500 test examples."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(NUM_CLASSES, NUM_FEATURES)) * 3
    y = rng.integers(0, NUM_CLASSES, size=2500)
    x = (centres[y] + rng.normal(size=(2500, NUM_FEATURES))).astype(np.float32)
    return (x[:2000], y[:2000]), (x[2000:], y[2000:])


def build_model(devices=None):
    """A small MLP (one device: `devices` is None for this spec)."""
    del devices
    return tf_keras.Sequential(
        [
            tf_keras.layers.InputLayer(input_shape=(NUM_FEATURES,)),
            tf_keras.layers.Dense(32, activation="relu"),
            tf_keras.layers.Dense(NUM_CLASSES),
        ]
    )


def spec() -> ModelSpec:
    """What `--model=tf_distbelief.demos.blobs:spec` loads."""
    return ModelSpec(name="blobs", build_model=build_model, load_data=load_data)
