"""Export for serving from a sharded model, and from a checkpoint (issue 11)."""

import os
import re
import shlex
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests.fixtures.launch import ROOT
from tf_distbelief import adagrad
from tf_distbelief import strategy as strategy_lib
from tf_distbelief.demos import digits
from tf_distbelief.fit import export, training

VOCAB, DIM, IDS, CLASSES = 600, 16, 5, 4

# Loads the exports in a process with no cluster, no TF_CONFIG and no
# tf_distbelief import; writes their predictions and weights.
_LOADER = """
import json, sys
import numpy as np
import tensorflow as tf
import tf_keras
assert "tf_distbelief" not in sys.modules
export_dir, checkpoint_export_dir, inputs_path, out_path = sys.argv[1:]
x = np.load(inputs_path)
saved = tf.saved_model.load(export_dir + "/saved_model")
serve = saved.signatures["serving_default"]
(name, spec), = serve.structured_input_signature[1].items()
(served,) = serve(**{name: tf.constant(x, spec.dtype)}).values()
keras_model = tf_keras.models.load_model(export_dir + "/model.keras")
from_ckpt = tf_keras.models.load_model(checkpoint_export_dir + "/model.keras")
np.savez(
    out_path,
    served=served.numpy(),
    keras=keras_model(x, training=False).numpy(),
    **{f"w{i}": w for i, w in enumerate(keras_model.get_weights())},
    **{f"c{i}": w for i, w in enumerate(from_ckpt.get_weights())},
)
"""


def _embedding_model():
    return tf_keras.Sequential(
        [
            tf_keras.layers.InputLayer(input_shape=(IDS,), dtype="int64"),
            tf_keras.layers.Embedding(
                VOCAB,
                DIM,
                embeddings_initializer=tf_keras.initializers.RandomUniform(
                    -0.5, 0.5, seed=1
                ),
            ),
            tf_keras.layers.GlobalAveragePooling1D(),
            tf_keras.layers.Dense(CLASSES),
        ]
    )


def _embedding_data():
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, size=(256, IDS)).astype(np.int64)
    return x, rng.integers(0, CLASSES, size=256)


CASES = {
    "default-2ps": (digits.build_model, lambda n: None, 2),
    "fixed2-2ps": (
        digits.build_model,
        tf.distribute.experimental.partitioners.FixedShardsPartitioner,
        2,
    ),
    "fixed3-3ps": (
        digits.build_model,
        tf.distribute.experimental.partitioners.FixedShardsPartitioner,
        3,
    ),
    "embedding-fixed2": (
        _embedding_model,
        tf.distribute.experimental.partitioners.FixedShardsPartitioner,
        2,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_exports_load_in_a_plain_process_and_predict_bit_equal(
    local_cluster, case, tmp_path
):
    build, partitioner, num_ps = CASES[case]
    if case.startswith("embedding"):
        x, y = _embedding_data()
    else:
        (x, y), _ = digits.load_data()
    strategy = strategy_lib.DistBeliefStrategy(
        local_cluster.resolver_for(num_workers=1, num_ps=num_ps), partitioner(num_ps)
    )
    with strategy.scope():
        model = build()
        model.compile(
            adagrad.Adagrad(0.1),
            tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    first = model.layers[0]
    table = first.embeddings if case.startswith("embedding") else first.kernel
    shards = len(getattr(table, "variables", [table]))
    assert shards == (1 if case == "default-2ps" else num_ps)
    model_dir = str(tmp_path / "run")
    training.fit(
        model,
        training.dataset_creator(x, y, 32),
        epochs=1,
        steps_per_epoch=10,
        batch_size=32,
        model_dir=model_dir,
        print_fn=lambda line: None,
    )
    fixed = x[:64]
    expected = model(fixed, training=False).numpy()
    paths = export.export_model(model, build, str(tmp_path / "export"))
    assert os.path.isdir(paths.saved_model) and os.path.isfile(paths.keras_file)
    export.export_checkpoint(model_dir, build, str(tmp_path / "from_checkpoint"))
    np.save(tmp_path / "x.npy", fixed)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOADER,
            str(tmp_path / "export"),
            str(tmp_path / "from_checkpoint"),
            str(tmp_path / "x.npy"),
            str(tmp_path / "out.npz"),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(out["served"], expected)
    np.testing.assert_array_equal(out["keras"], expected)
    weights = sorted(k for k in out.files if k.startswith("w"))
    assert weights and len(weights) == len([k for k in out.files if k.startswith("c")])
    for k in weights:
        assert out[k].tobytes() == out["c" + k[1:]].tobytes()


def test_export_inside_a_strategy_scope_is_refused(tmp_path):
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        with pytest.raises(RuntimeError, match=r"outside `strategy.scope\(\)`"):
            export.export_checkpoint(str(tmp_path), digits.build_model, str(tmp_path))


def test_export_from_a_missing_checkpoint_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at"):
        export.export_checkpoint(
            str(tmp_path / "none"), digits.build_model, str(tmp_path / "e")
        )


TRAIN = os.path.join(ROOT, "launch", "train.py")


def _launch(args, timeout=600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, TRAIN, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _load_in_a_plain_process(tmp_path, export_dir, checkpoint_export_dir, x):
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _LOADER,
            str(export_dir),
            str(checkpoint_export_dir),
            str(tmp_path / "x.npy"),
            str(tmp_path / "out.npz"),
        ],
        cwd=str(tmp_path),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return np.load(tmp_path / "out.npz")


def _readme_command(prefix):
    """The README line starting with `prefix`: its environment and arguments."""
    with open(os.path.join(ROOT, "README.md")) as f:
        (line,) = [x for x in f if x.startswith(prefix)]
    words = shlex.split(line)
    command = words.index("tf-distbelief-train")  # `TRAIN`'s command.
    return dict(w.split("=", 1) for w in words[:command]), words[command + 1 :]


@pytest.mark.slow
def test_readme_records_command_trains_and_exports(tmp_path):
    """README "Your own model" / "Export": the records spec, exported."""
    from tf_distbelief.demos import blobs, records

    env, args = _readme_command("RECORDS_DIR=")
    assert "--export_dir=records_export" in args and "--model_dir=records_run" in args
    proc = subprocess.run(
        [sys.executable, TRAIN, *args],
        cwd=str(tmp_path),  # The relative paths of the command land here.
        env=dict(
            {k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
            TF_CPP_MIN_LOG_LEVEL="2",
            RECORDS_DIR=str(tmp_path / os.path.basename(env["RECORDS_DIR"])),
        ),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = re.findall(r"^test accuracy: ([0-9.]+)$", proc.stdout, re.MULTILINE)
    assert accuracy and float(accuracy[-1]) >= 0.95, proc.stdout[-2000:]
    export_dir = tmp_path / "records_export"
    assert "exported: records_export/saved_model records_export/model.keras" in (
        proc.stdout
    )
    assert len(os.listdir(tmp_path / "records")) == records.NUM_TRAIN_FILES + 1
    # The last checkpoint holds the final weights: exported again, no cluster.
    export.export_checkpoint(
        str(tmp_path / "records_run"), blobs.build_model, str(tmp_path / "ckpt")
    )
    _, (x_test, y_test) = blobs.load_data()
    out = _load_in_a_plain_process(tmp_path, export_dir, tmp_path / "ckpt", x_test)
    np.testing.assert_array_equal(out["served"], out["keras"])
    assert np.mean(out["keras"].argmax(axis=1) == y_test) >= 0.95
    weights = sorted(k for k in out.files if k.startswith("w"))
    assert len(weights) == 4  # Two Dense layers, each kernel joined whole.
    for k in weights:
        assert out[k].tobytes() == out["c" + k[1:]].tobytes()
    # README's loading command, in a plain process with no TF_CONFIG.
    with open(os.path.join(ROOT, "README.md")) as f:
        (line,) = [x for x in f if x.startswith("python -c ")]
    load = subprocess.run(
        [sys.executable, *shlex.split(line)[1:]],
        cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert load.returncode == 0, load.stderr[-2000:]
    assert "TensorSpec(shape=(None, 4)" in load.stdout, load.stdout


def test_export_dir_rules(tmp_path):
    export.check_export_dir(str(tmp_path / "new" / "export"))
    export.check_export_dir(str(tmp_path))  # Empty.
    (tmp_path / "saved_model").mkdir()
    (tmp_path / "saved_model" / "saved_model.pb").write_bytes(b"")
    (tmp_path / "model.keras").write_bytes(b"")
    export.check_export_dir(str(tmp_path))  # An earlier export: replaced.
    with pytest.raises(ValueError, match=r"must not be the `model_dir`"):
        export.check_export_dir(str(tmp_path), model_dir=str(tmp_path))
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"also holds notes.txt.*nothing was deleted"):
        export.check_export_dir(str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    with pytest.raises(ValueError, match=r"must be a directory.*\(a file\)"):
        export.check_export_dir(str(tmp_path / "notes.txt"))


def test_export_dir_with_a_users_file_is_refused_before_any_cluster(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = _launch(
        ["--model=tf_distbelief.demos.blobs:spec", f"--export_dir={tmp_path}"], 300
    )
    assert proc.returncode != 0
    assert "also holds notes.txt" in proc.stderr, proc.stderr[-2000:]
    assert "local cluster" not in proc.stdout
    assert (tmp_path / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("flag", ["--model_dir", "--export_dir"])
def test_an_unwritable_folder_is_refused_before_any_cluster_in_one_line(flag):
    # Root passes the permission bits on /proc: only writing tells.
    proc = _launch(
        ["--model=tf_distbelief.demos.blobs:spec", f"{flag}=/proc/tfdb_test/run"], 300
    )
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.endswith(
        f"error: `{flag[2:]}` '/proc/tfdb_test/run' cannot be written: "
        "No such file or directory."
    ), proc.stderr[-2000:]
    assert "local cluster" not in proc.stdout


@pytest.mark.parametrize("flag", ["--model_dir", "--export_dir"])
def test_a_read_only_mount_is_refused_before_any_cluster_in_one_line(flag, tmp_path):
    # The command in a mount namespace of its own where `tmp_path` is a
    # read-only bind mount: the permission bits say writable (root in the
    # user namespace), only the write says otherwise.
    target = tmp_path / "run"
    mount = (
        f"mount --bind {tmp_path} {tmp_path} && "
        f"mount -o remount,bind,ro {tmp_path} && "
        f'exec {sys.executable} {TRAIN} --model=tf_distbelief.demos.blobs:spec "$0"'
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", mount]
        + [f"{flag}={target}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    if proc.returncode and "unshare:" in proc.stderr:
        # A host without unprivileged user namespaces cannot make the mount;
        # the /proc test above still shows the launch's write probe.
        pytest.skip(f"no user and mount namespaces here: {proc.stderr.strip()}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    # Refused by the parent's check (access(2) knows a read-only mount).
    assert re.search(
        rf"error: `{flag[2:]}` '{target}' cannot be (made|written): "
        rf"'{tmp_path}' is not a writable directory\.$",
        line,
    ), proc.stderr[-2000:]
    assert "local cluster" not in proc.stdout
    assert not target.exists()


def test_an_export_that_cannot_be_written_after_training_goes_elsewhere(tmp_path):
    import keras

    model = keras.Sequential([keras.layers.Input((3,)), keras.layers.Dense(2)])
    written = export.export_keras3_model(model, "/proc/tfdb_test/export")
    try:
        assert written.refused == "No such file or directory"
        assert os.path.isfile(written.keras_file)
        assert os.path.isfile(os.path.join(written.saved_model, "saved_model.pb"))
        assert written.line("/proc/tfdb_test/export") == (
            "export_dir '/proc/tfdb_test/export' could not be written (No such "
            f"file or directory); exported to {os.path.dirname(written.keras_file)}"
            f" instead: {written.saved_model} {written.keras_file}"
        )
    finally:
        shutil.rmtree(os.path.dirname(written.keras_file))


# Serves the embedding model's SavedModel with int64 ids, in a plain process.
_INT64_SERVER = """
import sys
import numpy as np
import tensorflow as tf
import tf_keras
export_dir, inputs_path, out_path = sys.argv[1:]
x = np.load(inputs_path)
serve = tf.saved_model.load(export_dir + "/saved_model").signatures["serving_default"]
(name, spec), = serve.structured_input_signature[1].items()
assert spec.dtype == tf.int64, spec
assert spec.shape.as_list() == [None, x.shape[1]], spec
(served,) = serve(**{name: tf.constant(x)}).values()
trained = tf_keras.models.load_model(export_dir + "/model.keras")
np.savez(out_path, served=served.numpy(), trained=trained(x, training=False).numpy())
"""


@pytest.mark.slow
def test_an_embedding_export_is_served_with_int64_ids(tmp_path):
    from tf_distbelief import demos

    export_dir = tmp_path / "export"
    proc = _launch(["--model=embedding", "--epochs=1", f"--export_dir={export_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (_, _), (x_test, _) = demos.spec("embedding").load_data()
    assert x_test.dtype == np.int64
    np.save(tmp_path / "x.npy", x_test[:256])
    served = subprocess.run(
        [
            sys.executable,
            "-c",
            _INT64_SERVER,
            str(export_dir),
            str(tmp_path / "x.npy"),
            str(tmp_path / "out.npz"),
        ],
        cwd=str(tmp_path),
        env={k: v for k, v in os.environ.items() if k != "TF_CONFIG"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert served.returncode == 0, served.stderr[-3000:]
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(out["served"], out["trained"])
