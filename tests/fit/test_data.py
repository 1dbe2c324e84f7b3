"""Training data from files (`fit.data.FileInput`), each worker its own."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

from tests.fixtures.fit import _shard_passes
from tests.fixtures.launch import ROOT
from tf_distbelief import job
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.fit import data

TRAIN = os.path.join(ROOT, "launch", "train.py")


def _write_ids(folder, num_files, per_file):
    """TFRecord files `part-<f>.tfrecord`, record ids `f * per_file + r`."""
    os.makedirs(folder, exist_ok=True)
    for f in range(num_files):
        with tf.io.TFRecordWriter(os.path.join(folder, f"part-{f}.tfrecord")) as w:
            for r in range(per_file):
                w.write(tf.io.serialize_tensor(np.int64(f * per_file + r)).numpy())
    return os.path.join(folder, "part-*.tfrecord")


def _parse_id(record):
    record_id = tf.io.parse_tensor(record, tf.int64)
    record_id.set_shape([])
    return record_id, record_id


def test_each_worker_reads_its_own_files(local_cluster, tmp_path):
    pattern = _write_ids(str(tmp_path), num_files=6, per_file=5)
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(3, 1))
    # A batch of 10 is one whole pass over a worker's 2 files of 5 records.
    passes = _shard_passes(strategy, data.FileInput(pattern, _parse_id)(10))
    assert sorted(passes) == [0, 1, 2]
    for worker, batches in passes.items():
        # Worker i reads files i and i + 3: records 5i..5i+4 and 5(i+3)..
        mine = list(range(5 * worker, 5 * worker + 5))
        mine += list(range(5 * (worker + 3), 5 * (worker + 3) + 5))
        assert all(b == mine for b in batches), (worker, batches)


def test_fewer_files_than_workers_deals_out_records(local_cluster, tmp_path):
    pattern = _write_ids(str(tmp_path), num_files=2, per_file=6)
    strategy = strategy_lib.DistBeliefStrategy(local_cluster.resolver_for(3, 1))
    passes = _shard_passes(strategy, data.FileInput(pattern, _parse_id)(4))
    assert sorted(passes) == [0, 1, 2]
    for worker, batches in passes.items():
        # Every worker reads both files and keeps records i, i + 3, ...
        assert all(b == list(range(worker, 12, 3)) for b in batches), worker


def test_csv_files_and_read_arrays(tmp_path):
    (tmp_path / "a.csv").write_text("f0,f1,label\n1.5,2.0,1\n3.0,4.5,0\n")
    (tmp_path / "b.csv").write_text("f0,f1,label\n-1.0,0.25,2\n")
    csv = data.FileInput(
        str(tmp_path / "*.csv"),
        lambda f0, f1, label: (tf.stack([f0, f1]), label),
        format="csv",
        csv_record_defaults=[0.0, 0.0, 0],
        csv_header=True,
        shuffle_buffer=0,
    )
    x, y = csv.read_arrays()
    np.testing.assert_array_equal(x, [[1.5, 2.0], [3.0, 4.5], [-1.0, 0.25]])
    np.testing.assert_array_equal(y, [1, 0, 2])
    # Without a strategy one worker reads both files (interleaved).
    (batch_x, batch_y) = next(iter(csv(3)(tf.distribute.InputContext())))
    assert sorted(zip(batch_y.numpy().tolist(), batch_x.numpy()[:, 0].tolist())) == [
        (0, 3.0),
        (1, 1.5),
        (2, -1.0),
    ]


def test_file_input_errors_name_the_value(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'/no/such/\*.tfrecord' matches no"):
        data.FileInput("/no/such/*.tfrecord", _parse_id)(8)
    with pytest.raises(ValueError, match=r"`FileInput.format` must be one of"):
        data.FileInput("x", _parse_id, format="parquet")
    with pytest.raises(ValueError, match=r"`FileInput.csv_record_defaults`"):
        data.FileInput("x", _parse_id, format="csv")
    with pytest.raises(ValueError, match=r"has no training data"):
        job.ModelSpec("m", build_model=lambda devices: None)
    with pytest.raises(ValueError, match=r"`optimizer=lbfgs`.*only `dataset_fn`"):
        job.check_spec(
            job.JobConfig(optimizer="lbfgs"),
            job.ModelSpec("m", build_model=lambda d: None, dataset_fn=lambda b, s: 0),
        )


# A user's own spec module: its own model and its own TFRecord files (written
# next to it). The model counts, in a variable on the ps, the records each
# worker's training steps used; the job's checkpoint carries the counts out.
_USER_MODULE = """
import os

import numpy as np
import tensorflow as tf
import tf_keras

from tf_distbelief.fit import data
from tf_distbelief.job import ModelSpec

FOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "records")
NUM_FILES, PER_FILE, WORKERS = 4, 24, 2
NUM_RECORDS = NUM_FILES * PER_FILE


def _ints(values):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=values))


def write_records():
    os.makedirs(FOLDER, exist_ok=True)
    rng = np.random.default_rng(0)
    for f in range(NUM_FILES):
        with tf.io.TFRecordWriter(os.path.join(FOLDER, f"part-{f}.tfrecord")) as w:
            for r in range(PER_FILE):
                record_id = f * PER_FILE + r
                feature = {
                    "id": _ints([record_id]),
                    "x": tf.train.Feature(float_list=tf.train.FloatList(
                        value=rng.normal(size=4) + record_id % 2)),
                    "y": _ints([record_id % 2]),
                }
                w.write(tf.train.Example(features=tf.train.Features(
                    feature=feature)).SerializeToString())


def parse(record):
    ex = tf.io.parse_single_example(record, {
        "id": tf.io.FixedLenFeature([], tf.int64),
        "x": tf.io.FixedLenFeature([4], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64),
    })
    return {"id": ex["id"], "x": ex["x"]}, ex["y"]


class Counting(tf_keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = tf_keras.layers.Dense(2)
        self.reads = tf.Variable(
            tf.zeros([WORKERS, NUM_RECORDS], tf.int64), trainable=False)

    def call(self, inputs, training=False):
        return self.dense(inputs["x"])

    def train_step(self, batch):
        ids = batch[0]["id"]
        worker = tf.cast(
            tf.distribute.coordinator.experimental_get_current_worker_index(),
            tf.int64)
        self.reads.scatter_nd_add(
            tf.stack([tf.fill(tf.shape(ids), worker), ids], axis=1),
            tf.ones_like(ids))
        return super().train_step(batch)


def build_model(devices=None):
    model = Counting()
    model({"id": tf.zeros([1], tf.int64), "x": tf.zeros([1, 4])})
    return model


def spec():
    write_records()
    return ModelSpec(
        name="counting",
        build_model=build_model,
        dataset_fn=data.FileInput(os.path.join(FOLDER, "part-*.tfrecord"), parse),
    )
"""


@pytest.mark.slow
def test_a_user_module_trains_on_its_own_tfrecord_files(tmp_path):
    (tmp_path / "user_records.py").write_text(textwrap.dedent(_USER_MODULE))
    batch, steps = 8, 48
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        [
            sys.executable,
            TRAIN,
            "--model=user_records:spec",
            "--num_workers=2",
            "--num_ps=1",
            f"--batch_size={batch}",
            "--epochs=2",
            f"--steps_per_epoch={steps // 2}",
            "--steps_per_execution=2",
            f"--model_dir={tmp_path / 'run'}",
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"epoch 2/2: steps {steps}/{steps}" in proc.stdout, proc.stdout[-2000:]
    checkpoint = tf.train.latest_checkpoint(str(tmp_path / "run" / "checkpoints"))
    reads = tf.train.load_variable(checkpoint, "model/reads/.ATTRIBUTES/VARIABLE_VALUE")
    assert reads.shape == (2, 96)
    # Every step trained on one batch: `steps * batch` records in all.
    assert reads.sum() == steps * batch
    for worker in range(2):
        # Worker w reads files w and w + 2 (24 records each), nothing else.
        mine = np.zeros(96, bool)
        for f in (worker, worker + 2):
            mine[24 * f : 24 * (f + 1)] = True
        assert not reads[worker][~mine].any(), (worker, reads[worker])
        # Its k steps read its 48 records in whole passes, then part of one:
        # each record q or q + 1 times, exactly r of them q + 1 times.
        total = int(reads[worker].sum())
        assert total % batch == 0 and total > 0
        q, r = divmod(total, 48)
        counts = reads[worker][mine]
        assert set(counts.tolist()) <= {q, q + 1}, counts
        assert int((counts == q + 1).sum()) == r, counts
