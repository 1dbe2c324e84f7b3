"""A user's own model trained on its own TFRecord files (README: "Your own model").

`tf-distbelief-train --model=tf_distbelief.demos.records:spec` writes the
files first (offline: the Gaussian blobs of `tf_distbelief.demos.blobs`, 2,000
training examples in 4 files, 500 test examples in 1) to `$RECORDS_DIR` (default:
`<tmp>/tf_distbelief_records`), unless they are there already, then trains on
them: each worker reads its own training files (`tf_distbelief.fit.data`), the
chief reads the test file for the test accuracy.
"""

import os
import tempfile

import tensorflow as tf

from tf_distbelief.demos import blobs
from tf_distbelief.fit import data
from tf_distbelief.job import ModelSpec

NUM_TRAIN_FILES = 4
FEATURES = {
    "x": tf.io.FixedLenFeature([blobs.NUM_FEATURES], tf.float32),
    "y": tf.io.FixedLenFeature([], tf.int64),
}


def records_dir() -> str:
    """Where the files go: `$RECORDS_DIR`, or `<tmp>/tf_distbelief_records`."""
    return os.environ.get("RECORDS_DIR") or os.path.join(
        tempfile.gettempdir(), "tf_distbelief_records"
    )


def _write(path, x, y):
    """Writes one TFRecord file of `tf.train.Example`s, atomically."""
    tmp = f"{path}.tmp{os.getpid()}"
    with tf.io.TFRecordWriter(tmp) as writer:
        for features, label in zip(x, y):
            example = tf.train.Example(
                features=tf.train.Features(
                    feature={
                        "x": tf.train.Feature(
                            float_list=tf.train.FloatList(value=features)
                        ),
                        "y": tf.train.Feature(
                            int64_list=tf.train.Int64List(value=[label])
                        ),
                    }
                )
            )
            writer.write(example.SerializeToString())
    os.replace(tmp, path)  # Another task writing the same file races harmlessly.


def write_records(folder: str) -> None:
    """Writes `train-<i>-of-4.tfrecord` and `test.tfrecord` unless present."""
    os.makedirs(folder, exist_ok=True)
    (x_train, y_train), (x_test, y_test) = blobs.load_data()
    for i in range(NUM_TRAIN_FILES):
        path = os.path.join(folder, f"train-{i}-of-{NUM_TRAIN_FILES}.tfrecord")
        if not os.path.exists(path):
            _write(path, x_train[i::NUM_TRAIN_FILES], y_train[i::NUM_TRAIN_FILES])
    if not os.path.exists(os.path.join(folder, "test.tfrecord")):
        _write(os.path.join(folder, "test.tfrecord"), x_test, y_test)


def parse(record):
    """One serialized `tf.train.Example` -> `(x [16] float32, y int64)`."""
    example = tf.io.parse_single_example(record, FEATURES)
    return example["x"], example["y"]


def spec() -> ModelSpec:
    """What `--model=tf_distbelief.demos.records:spec` loads."""
    folder = records_dir()
    write_records(folder)
    return ModelSpec(
        name="records",
        build_model=blobs.build_model,
        dataset_fn=data.FileInput(os.path.join(folder, "train-*.tfrecord"), parse),
        eval_data=data.FileInput(
            os.path.join(folder, "test.tfrecord"), parse
        ).read_arrays,
    )
