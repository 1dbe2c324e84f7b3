"""Training data from files: `FileInput`, each worker reading its own files.

The model replicas of Dean et al. 2012 (section 4.1) each read their own
subset of the training data. `FileInput` reads TFRecord or CSV files with
`tf.data` and splits them between the workers the way `tf.data`'s
`AutoShardPolicy.AUTO` splits them between input pipelines:

* **by file** when there are at least as many files as workers: worker `i` of
  `W` reads files `i, i + W, i + 2W, ...` of the sorted file list, nothing
  else;
* **by record** otherwise (a warning says so): every worker opens every file
  in the same order and keeps records `i, i + W, ...` of the stream, which
  costs `W` times the reading; write at least `W` files to avoid it.

Either way one pass of every worker over its part reads each record exactly
once. TensorFlow's parameter-server strategy calls the dataset function with
input pipeline 0 of 1 on every worker, so the worker index comes from
`tf.distribute.coordinator.experimental_get_current_worker_index`, as in
`training.dataset_creator`.

In-flight records when a worker is lost: its iterator, the batches it had
prefetched (up to `prefetch_batches`) and its step in flight are lost; the
coordinator runs that step again on another worker, with that worker's data.
Until the lost worker is back its files are not read. Restarted, it rebuilds
its iterator and starts its files again from the beginning, in a new order:
in that pass the records it had read before the loss are read twice, the
others of its files once. Records are counted as read when a training step
uses them; prefetched but unused batches are never trained on.

Example (a `ModelSpec` reading its own TFRecord files: `tf_distbelief.demos.records`):

```python
def parse(record):  # one serialized tf.train.Example -> (features, label)
    ex = tf.io.parse_single_example(record, {
        "x": tf.io.FixedLenFeature([16], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64)})
    return ex["x"], ex["y"]

ModelSpec(name="mine", build_model=build_model,
          dataset_fn=data.FileInput("/data/train-*.tfrecord", parse),
          eval_data=data.FileInput("/data/test-*.tfrecord", parse).read_arrays)
```
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf
import tf_keras
from absl import logging

from tf_distbelief import checks

FORMATS = ("tfrecord", "csv")


def _num_workers() -> int:
    # `DistBeliefStrategy.num_workers`; any other strategy counts as one
    # replica (TensorFlow's own keeps its `cluster_resolver` None in `fit`).
    return max(1, getattr(tf.distribute.get_strategy(), "num_workers", 1))


@dataclasses.dataclass(frozen=True)
class FileInput:
    """Training data in TFRecord or CSV files, read by `tf.data` on each worker.

    A `ModelSpec.dataset_fn`: `file_input(batch_size, seed)` gives the
    `DatasetCreator` that `Model.fit` takes. Files must be readable at the
    same path on every worker (a shared file system, or one machine).

    Attributes:
      files: a glob pattern (`"/data/train-*.tfrecord"`) or a list of paths
        and patterns; expanded and sorted when the data are first asked for.
      parse_fn: one record -> `(features, label)`. A TFRecord record is a
        scalar `tf.string` (a serialized `tf.train.Example`, say); a CSV
        record is the tuple of the row's column tensors (the arguments of
        `parse_fn`, one per column of `csv_record_defaults`).
      format: `tfrecord` or `csv` (`FORMATS`).
      compression_type: `""` (none), `"ZLIB"` or `"GZIP"`.
      csv_record_defaults: CSV only: one default (and so the dtype) per
        column, as `tf.data.experimental.CsvDataset` takes them, e.g.
        `[0.0] * 16 + [0]`.
      csv_header: CSV only: the first line of each file is a header.
      shuffle_buffer: records in the shuffle buffer (0: no shuffling); the
        order of each worker's files is shuffled too.
      prefetch_batches: batches each worker reads ahead.
    """

    files: str | Sequence[str]
    parse_fn: Callable
    format: str = "tfrecord"
    compression_type: str = ""
    csv_record_defaults: Sequence | None = None
    csv_header: bool = False
    shuffle_buffer: int = 1024
    prefetch_batches: int = 2

    def __post_init__(self):
        checks.check_one_of("FileInput.format", self.format, FORMATS)
        checks.check_callable("FileInput.parse_fn", self.parse_fn)
        if self.format == "csv" and not self.csv_record_defaults:
            raise ValueError(
                "`FileInput.csv_record_defaults` (one default per column) is "
                "needed with format='csv'. Received: "
                f"{self.csv_record_defaults!r}"
            )
        for name in ("shuffle_buffer", "prefetch_batches"):
            if getattr(self, name) < 0:
                raise checks.argument_error(
                    f"FileInput.{name}", ">= 0", getattr(self, name)
                )

    def file_list(self) -> list[str]:
        """The files, expanded and sorted (absolute paths).

        Raises:
          FileNotFoundError: a pattern or path matches no file.
        """
        patterns = [self.files] if isinstance(self.files, str) else list(self.files)
        found = []
        for pattern in patterns:
            matches = sorted(glob.glob(os.fspath(pattern)))
            if not matches:
                raise FileNotFoundError(
                    f"`FileInput.files`: {pattern!r} matches no file (working "
                    f"directory {os.getcwd()})."
                )
            found.extend(os.path.abspath(m) for m in matches)
        return sorted(set(found))

    def _read(self, filenames: tf.data.Dataset, interleave: bool) -> tf.data.Dataset:
        """Records of the files in `filenames` (a dataset of paths), parsed."""

        def read_one(filename):
            if self.format == "tfrecord":
                return tf.data.TFRecordDataset(
                    filename, compression_type=self.compression_type
                )
            return tf.data.experimental.CsvDataset(
                filename,
                list(self.csv_record_defaults),
                compression_type=self.compression_type,
                header=self.csv_header,
            )

        if interleave:
            ds = filenames.interleave(
                read_one, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE
            )
        else:  # The same order on every worker: records are dealt out by index.
            ds = filenames.flat_map(read_one)
        parse = self.parse_fn
        if self.format == "csv":
            ds = ds.map(lambda *columns: parse(*columns))
        else:
            ds = ds.map(parse)
        return ds

    def __call__(
        self, batch_size: int, seed: int | None = 0, num_replicas: int | None = None
    ) -> tf_keras.utils.experimental.DatasetCreator:
        """Returns the `DatasetCreator` of the training data for `Model.fit`.

        Each worker reads its part (module docstring), shuffles it, repeats it
        and batches it: `(features, labels)` of `[batch_size, ...]`.

        Args:
          batch_size: examples per step per worker, >= 1.
          seed: shuffle seed (None: another order every run).
          num_replicas: parts to cut the data into; None reads the number of
            workers of the strategy whose `fit` calls the function.

        Returns:
          A `tf_keras.utils.experimental.DatasetCreator`.

        Raises:
          ValueError: `batch_size` or `num_replicas` < 1.
          FileNotFoundError: no file matches `files`.
        """
        if batch_size < 1:
            raise checks.argument_error("batch_size", ">= 1", batch_size)
        if num_replicas is not None and num_replicas < 1:
            raise checks.argument_error("num_replicas", ">= 1 or None", num_replicas)
        files = self.file_list()  # On the chief, before any step.

        def dataset_fn(input_context):
            del input_context  # Pipeline 0 of 1 on every worker.
            workers = num_replicas or _num_workers()
            names = tf.data.Dataset.from_tensor_slices(files)
            on_worker = workers > 1 and tf.inside_function()
            by_file = len(files) >= workers
            if on_worker:
                index = (
                    tf.distribute.coordinator.experimental_get_current_worker_index()
                )
            elif workers > len(files):
                # Once, on the coordinator (element spec), not per worker.
                logging.warning(
                    "%d files for %d workers: every worker reads every file and "
                    "keeps every %d-th record (%d times the reading). Write at "
                    "least %d files to give each worker its own.",
                    len(files),
                    workers,
                    workers,
                    workers,
                    workers,
                )
            if on_worker and by_file:
                names = names.shard(workers, index)
            if by_file and self.shuffle_buffer:
                names = names.shuffle(
                    len(files), seed=seed, reshuffle_each_iteration=True
                )
            ds = self._read(names, interleave=by_file)
            if on_worker and not by_file:
                ds = ds.shard(workers, index)
            if self.shuffle_buffer:
                ds = ds.shuffle(
                    self.shuffle_buffer, seed=seed, reshuffle_each_iteration=True
                )
            ds = ds.repeat().batch(batch_size, drop_remainder=True)
            return ds.prefetch(self.prefetch_batches)

        return tf_keras.utils.experimental.DatasetCreator(dataset_fn)

    def read_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Every record of the files, in file order, as NumPy arrays.

        For a test or validation set on the chief (`ModelSpec.eval_data`),
        outside any strategy.

        Returns:
          `(x, y)`: features `[num_records, ...]` and labels `[num_records,
          ...]`, stacked from `parse_fn`'s outputs.
        """
        ds = self._read(
            tf.data.Dataset.from_tensor_slices(self.file_list()), interleave=False
        )
        xs, ys = [], []
        for x, y in ds.batch(4096).as_numpy_iterator():
            xs.append(x)
            ys.append(y)
        return np.concatenate(xs), np.concatenate(ys)
