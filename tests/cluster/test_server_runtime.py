"""A ps or worker task's server without TensorFlow's Python API
(`tf_internals.server_runtime`): what it leaves out, and that a chief's work
runs on it as on a full one."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import portpicker

from tests.fixtures.launch import ROOT

_ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
_ENV.pop("TF_CONFIG", None)


def _python(code, env=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env or _ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_lean_load_leaves_the_python_api_unbuilt():
    done = _python(
        """
        import sys
        from tf_distbelief.tf_internals import server_runtime
        assert server_runtime.lean_possible()
        runtime = server_runtime.load(lean=True)
        built = [m for m in ("tensorflow.python.eager.polymorphic_function"
                             ".polymorphic_function", "tensorflow.python.data",
                             "tensorflow.python.autograph.impl.api", "keras",
                             "tf_keras") if m in sys.modules]
        print(runtime.lean, built, runtime.Server.__name__,
              runtime.ConfigProto(device_count={"CPU": 2}).device_count["CPU"])
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "True [] Server 2"


def test_full_tensorflow_imported_first_is_used_whole():
    done = _python(
        """
        import tensorflow as tf
        from tf_distbelief.tf_internals import server_runtime
        runtime = server_runtime.load(lean=True)
        print(server_runtime.lean_possible(), runtime.lean,
              runtime.Server is tf.distribute.Server)
        """
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "False False True"


def test_a_lean_worker_and_ps_run_a_chief_s_function():
    chief, worker, ps = (f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in "abc")
    cluster = {"chief": [chief], "worker": [worker], "ps": [ps]}
    servers = []
    try:
        for job in ("worker", "ps"):
            env = dict(
                _ENV,
                TF_CONFIG=json.dumps(
                    {"cluster": cluster, "task": {"type": job, "index": 0}}
                ),
            )
            servers.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tf_distbelief.cluster.server_main"],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        done = _python(
            f"""
            import json
            import numpy as np
            import tensorflow as tf
            from tf_distbelief.cluster import connect
            connect.wait_for_tasks({{"worker": ["{worker}"], "ps": ["{ps}"]}}, 60)
            tf.config.experimental_connect_to_cluster(
                tf.train.ClusterSpec({cluster!r}), job_name="chief", task_index=0,
                make_master_device_default=False)
            with tf.device("/job:ps/task:0"):
                v = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))

            @tf.function
            def step(x):
                with tf.device("/job:worker/task:0"):
                    total = tf.data.Dataset.range(4).reduce(
                        tf.constant(0, tf.int64), lambda a, b: a + b)
                    return tf.matmul(x, v) + tf.cast(total, tf.float32)

            y = step(np.array([[1.0, 2.0]], np.float32))
            v.assign_add(tf.ones_like(v))
            print(json.dumps([y.numpy().tolist(), v.numpy().tolist()]))
            """
        )
        assert done.returncode == 0, done.stderr
    finally:
        for proc in servers:
            proc.kill()
            proc.wait()
    x = np.array([[1.0, 2.0]], np.float32)
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    y, v = json.loads(done.stdout.strip().splitlines()[-1])
    # A worker summed 0..3 with tf.data and multiplied; the ps holds v.
    np.testing.assert_array_equal(np.array(y, np.float32), x @ w + 6.0)
    np.testing.assert_array_equal(np.array(v, np.float32), w + 1.0)
