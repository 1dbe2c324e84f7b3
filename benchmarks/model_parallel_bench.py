r"""Step time of model-parallel replicas with 1, 2 and 4 partitions.

Dean et al. 2012, section 3 and Figure 3: a locally connected model gains from
being split over many machines, a fully connected speech model much less. This
benchmark times one training step (forward, backward and a plain SGD update, in a
`tf.function`) of two models, split over 1, 2 and 4 logical CPU devices:

* `lc`: two wide locally connected layers (`PartitionedLocallyConnected2D`, output
  rows split into blocks).
* `mlp`: the speech model's shape: 440 inputs (11 frames of 40 filter banks), 4
  sigmoid hidden layers, softmax (`PartitionedDense`, units split).

Two set-ups, each in its own child processes, since TensorFlow fixes its threads and
devices when it initialises:

* `scaling`: every partition gets one core's worth of threads. All CPU devices of a
  process share one intra-op pool, so the child sets `intra_op_parallelism_threads=1`
  (each op runs single-threaded) and `inter_op_parallelism_threads=P` (up to P ops,
  one per partition, run at once). The baseline is 1 partition with 1 thread of each:
  one core. This is the paper's set-up (one machine per partition), scaled down;
  with fewer cores than partitions the speed-up is capped at the number of cores.
* `overhead`: TensorFlow's default threads (all cores) for every partition count.
  Partitioning then brings no extra compute; the ratio shows its cost.

Cross-partition bytes per step are forward plus backward (halo or input copies and
their gradients), from `partition_math`.

Usage:
  python benchmarks/model_parallel_bench.py --steps=10
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
from absl import app, flags

_PARTITIONS = (1, 2, 4)
_SPEECH_INPUTS = 440  # 11 frames x 40 log filter-bank energies (section 5).


def define_flags():
    flags.DEFINE_integer("steps", 10, "Timed steps per measurement.", lower_bound=1)
    flags.DEFINE_integer("warmup_steps", 2, "Untimed steps first.", lower_bound=1)
    flags.DEFINE_integer("batch_size", 32, "Examples per step.", lower_bound=1)
    flags.DEFINE_integer(
        "lc_size", 48, "Rows and columns of the lc input.", lower_bound=9
    )
    flags.DEFINE_integer("lc_channels", 8, "Channels of the lc input.", lower_bound=1)
    flags.DEFINE_integer("lc_filters", 32, "Filters of each lc layer.", lower_bound=1)
    flags.DEFINE_integer(
        "mlp_width", 2560, "Hidden units (paper: 2560).", lower_bound=4
    )
    flags.DEFINE_integer(
        "mlp_classes", 8192, "Softmax classes (paper: 8192).", lower_bound=4
    )
    # Internal: set by the parent for its children.
    flags.DEFINE_enum("setup", None, ["scaling", "overhead"], "Child: set-up to run.")
    flags.DEFINE_integer("child_partitions", 0, "Child: scaling partition count.")


def _build(model, num_partitions, batch_size):
    """Returns `(step_fn, inputs, cross_partition_bytes_per_step)`."""
    import tensorflow as tf

    from tf_distbelief import partitioned_dense, partitioned_locally_connected

    f = flags.FLAGS
    if model == "lc":
        x = tf.random.stateless_normal(
            [batch_size, f.lc_size, f.lc_size, f.lc_channels], seed=[1, 2]
        )
        layers = [
            partitioned_locally_connected.PartitionedLocallyConnected2D(
                f.lc_filters, 5, num_partitions=num_partitions, activation="relu"
            ),
            partitioned_locally_connected.PartitionedLocallyConnected2D(
                f.lc_filters, 5, num_partitions=num_partitions
            ),
        ]

        def loss_fn(y):
            return tf.reduce_mean(tf.square(y))

    else:
        x = tf.random.stateless_normal([batch_size, _SPEECH_INPUTS], seed=[1, 2])
        labels = tf.random.stateless_uniform(
            [batch_size], [1, 3], maxval=f.mlp_classes, dtype=tf.int32
        )
        layers = [
            partitioned_dense.PartitionedDense(
                f.mlp_width, num_partitions, activation="sigmoid"
            )
            for _ in range(4)
        ] + [partitioned_dense.PartitionedDense(f.mlp_classes, num_partitions)]

        def loss_fn(logits):  # The softmax is in the loss.
            return tf.reduce_mean(
                tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
            )

    h = x
    for layer in layers:
        h = layer(h)
    variables = [v for layer in layers for v in layer.trainable_weights]

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            h = x
            for layer in layers:
                h = layer(h)
            loss = loss_fn(h)
        for v, g in zip(variables, tape.gradient(loss, variables)):
            v.assign_sub(0.01 * g)  # Runs where `v` lives.
        return loss

    # Forward and backward move the same bytes.
    bytes_per_step = 2 * sum(
        layer.cross_partition_bytes(batch_size) for layer in layers
    )
    return step, x, bytes_per_step


def _time_step(step, x):
    f = flags.FLAGS
    for _ in range(f.warmup_steps):
        step(x).numpy()
    times = []
    for _ in range(f.steps):
        start = time.perf_counter()
        step(x).numpy()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _child(setup, child_partitions):
    """Runs in a fresh process: configures TF, times, prints one JSON line."""
    import tensorflow as tf

    from tf_distbelief import model_parallel

    model_parallel.configure_logical_cpus(max(_PARTITIONS))
    if setup == "scaling":
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(child_partitions)
        counts = [child_partitions]
    else:
        counts = list(_PARTITIONS)
    results = []
    for model in ("lc", "mlp"):
        for p in counts:
            step, x, nbytes = _build(model, p, flags.FLAGS.batch_size)
            results.append(
                {
                    "model": model,
                    "partitions": p,
                    "secs": _time_step(step, x),
                    "bytes": nbytes,
                }
            )
    print(json.dumps(results))


def _run_child(argv, setup, partitions=0):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    command = [sys.executable, os.path.abspath(__file__), *argv[1:]]
    command += [f"--setup={setup}", f"--child_partitions={partitions}"]
    out = subprocess.run(command, check=True, capture_output=True, text=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    f = flags.FLAGS
    if f.setup:
        _child(f.setup, f.child_partitions)
        return
    rows = {}  # (model, partitions) -> {"bytes", "scaling", "overhead"} seconds.
    for setup, children in (("scaling", _PARTITIONS), ("overhead", (0,))):
        for p in children:
            for r in _run_child(argv, setup, p):
                row = rows.setdefault((r["model"], r["partitions"]), {})
                row["bytes"], row[setup] = r["bytes"], r["secs"]
    load = ", ".join(f"{v:.1f}" for v in os.getloadavg())
    print(
        f"cores={os.cpu_count()} load={load} batch={f.batch_size} lc=2x LocallyConnected2D(5x5, "
        f"{f.lc_filters}) on {f.lc_size}x{f.lc_size}x{f.lc_channels}; "
        f"mlp=440-{f.mlp_width}x4-{f.mlp_classes}; median of {f.steps} steps"
    )
    print(
        f"{'model':5} {'parts':>5} {'MB/step':>9} {'scaling ms':>11} {'speed-up':>8}"
        f" {'overhead ms':>12} {'speed-up':>8}"
    )
    for (model, p), row in sorted(rows.items()):
        base = rows[(model, 1)]
        print(
            f"{model:5} {p:5d} {row['bytes'] / 1e6:9.2f}"
            f" {row['scaling'] * 1e3:11.1f} {base['scaling'] / row['scaling']:8.2f}"
            f" {row['overhead'] * 1e3:12.1f} {base['overhead'] / row['overhead']:8.2f}"
        )


if __name__ == "__main__":
    define_flags()
    app.run(main)
