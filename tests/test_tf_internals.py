"""The TensorFlow internals tf_distbelief relies on still have their shape."""

import ast
import importlib
import os

import pytest
import tensorflow as tf

from tests.fixtures.launch import ROOT
from tf_distbelief import tf_internals

PACKAGE = os.path.join(ROOT, "tf_distbelief")
INTERNALS = os.path.join(PACKAGE, "tf_internals")


def test_internals_keep_their_shape():
    # Fails with a message naming the TensorFlow and tf_keras versions.
    tf_internals.check()


@pytest.mark.parametrize("name", tf_internals.MODULE_NAMES)
def test_each_module_s_internals_keep_their_shape(name):
    module = importlib.import_module(f"tf_distbelief.tf_internals.{name}")
    module.check()


def test_only_the_internals_package_imports_tensorflow_python():
    offenders = []
    for folder, _, files in os.walk(PACKAGE):
        if os.path.commonpath([folder, INTERNALS]) == INTERNALS:
            continue
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py"):
                continue
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                module = None
                if isinstance(node, ast.ImportFrom):
                    module = node.module or ""
                elif isinstance(node, ast.Import):
                    module = ",".join(a.name for a in node.names)
                if module and (
                    "tensorflow.python" in module or "tf_keras.src" in module
                ):
                    offenders.append(f"{os.path.relpath(path, ROOT)}: {module}")
            with open(path) as f:
                if "tf.__internal__" in f.read():
                    offenders.append(f"{os.path.relpath(path, ROOT)}: tf.__internal__")
    assert offenders == [], offenders


def test_a_per_worker_input_is_fed_only_in_a_worker_s_call():
    from tf_distbelief.tf_internals import worker_inputs

    with pytest.raises(RuntimeError, match="while tracing a function"):
        worker_inputs.per_worker_input(lambda i: [i], tf.TensorSpec([1], tf.int32))

    @tf.function
    def shard_size():
        spec = tf.TensorSpec([None], tf.int32)
        return tf.size(worker_inputs.per_worker_input(lambda i: [i], spec))

    # No coordinator's worker is calling it: no worker index to feed.
    with pytest.raises(RuntimeError, match="outside a worker's closure"):
        shard_size()
    with pytest.raises(
        TypeError, match=r"Argument `spec` must be a tf.TensorSpec \(one tensor"
    ):
        worker_inputs.per_worker_input(lambda i: [i], [tf.TensorSpec([])])
