"""The synthetic speech data: deterministic, Zipf-distributed, learnable."""

import numpy as np
import pytest

from tf_distbelief.demos import speech


def test_speech_data_is_deterministic_and_shaped():
    (x, y), (x_test, y_test) = speech.load_data(500, 100, num_classes=64, seed=3)
    assert x.shape == (500, speech.NUM_FEATURES) and x.dtype == np.float32
    assert y.shape == (500,) and y.dtype == np.int64
    assert x_test.shape == (100, speech.NUM_FEATURES) and y_test.shape == (100,)
    assert 0 <= y.min() and y.max() < 64
    (x2, y2), _ = speech.load_data(500, 100, num_classes=64, seed=3)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)


def test_speech_classes_follow_the_zipf_prior():
    classes, n = 8192, 200_000
    (_, y), _ = speech.load_data(n, 1, num_classes=classes, noise=0.0)
    prior = 1.0 / np.arange(1, classes + 1)
    prior /= prior.sum()  # Class 0: 1 / H(8192) = 0.1049.
    counts = np.bincount(y, minlength=classes)
    for c in (0, 1, 9):
        expected = n * prior[c]
        # Within 5 binomial standard deviations.
        assert abs(counts[c] - expected) < 5 * np.sqrt(expected), c


def test_speech_task_is_learnable_by_nearest_centre():
    """Class means of the training set classify the test set far above the
    most frequent class's share: the labels carry signal."""
    (x, y), (x_test, y_test) = speech.load_data(20000, 2000, num_classes=8192)
    seen = np.unique(y)
    means = np.stack([x[y == c].mean(axis=0) for c in seen])
    distances = (
        (x_test**2).sum(1)[:, None] - 2 * x_test @ means.T + (means**2).sum(1)[None]
    )
    accuracy = np.mean(seen[np.argmin(distances, axis=1)] == y_test)
    majority = np.mean(y_test == np.bincount(y).argmax())
    assert majority < 0.15
    assert accuracy > 0.8


def test_speech_data_errors():
    with pytest.raises(ValueError, match=r"`noise` must be >= 0. Received: -1"):
        speech.load_data(noise=-1)
    with pytest.raises(ValueError, match=r"`num_classes` must be a positive"):
        speech.load_data(num_classes=0)
